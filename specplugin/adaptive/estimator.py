"""The difficulty estimator: P(a draft token is accepted), learned from verification.

A candidate's token j is described by a *cell*: (proposer, greedy or sampled
request, position group of j, bucket of the proposer's own per-token signal in
[0, 1], bucket of the request's recent acceptance). The signal is whatever the
proposer knows (a suffix continuation's frequency, an n-gram match's length, a
draft model's top probability); the estimator never assumes it is a probability:
it learns what each bucket is worth on this model and this text.

Each cell counts judged tokens ``n`` and accepted ones ``s`` (a token is judged
when every token before it in its draft was accepted: its acceptance is then the
conditional ``P(accept j | accepted < j)`` that the controller multiplies). The
estimate shrinks the cell toward its parent (same proposer, mode and position,
pooled over signal and history), and the parent toward the prior ``prior_mean``::

    parent = (s_p + m0 * prior_mean) / (n_p + m0)
    a      = (s + m * parent) / (n + m)

so a cell with no evidence says what its parent says, and a parent with no
evidence says ``prior_mean`` (0.5: a coin flip, then the cost model decides
whether even that pays). Counts decay by ``1 - 1 / memory`` per step, so a cell
that stopped being drafted (because it looked bad) drifts back toward its parent
and is tried again: the estimator keeps up with text that changes.

**Exploration.** A point estimate learnt from two unlucky rejections would switch a
good proposer off for thousands of steps (a cell that is never drafted learns
nothing). :meth:`AcceptanceEstimator.estimate_cells` therefore can draw a token's
acceptance from its cell's posterior, ``Beta(s + m * parent, n - s + m * (1 - parent))``
(Thompson sampling): a cell with little evidence is sometimes tried, one with much
evidence behaves like its mean. One draw per cell, kept until the counts change; draws
are seeded, so runs repeat (a token's cell draws from numba's generator, compiled with the
union's plan, :mod:`specplugin.adaptive.kernels`: one per process, so two estimators in one
process share its stream; the draft model's pooled cells from the estimator's own). (The
union explores through one request per step; see :class:`~specplugin.adaptive.union.Union`.)

The request's recent acceptance is an exponential average of its own judged
tokens (accepted = 1, rejected = 0), bucketed; a new request has its own bucket.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specplugin.adaptive import kernels

POSITION_EDGES = np.array([1, 2, 3, 4, 8])  # groups: 0, 1, 2, 3, 4-7, 8+
HISTORY_EDGES = np.array([0.3, 0.7])  # recent acceptance: low, mid, high (+ "new")
_HISTORY_EDGE_LIST = HISTORY_EDGES.tolist()
# the position group of draft positions 0, 1, ... (see position_groups)
_POSITION_GROUPS = np.searchsorted(POSITION_EDGES, np.arange(64), side="right").tolist()


@dataclass(frozen=True)
class TokenCells:
    """Flat arrays, one entry per candidate token (all candidates of a step concatenated)."""

    proposer: np.ndarray  # [num_tokens] int: index into the estimator's proposer names
    sampled: np.ndarray  # [num_tokens] bool
    position: np.ndarray  # [num_tokens] int: 0-based position in its draft
    signal: np.ndarray  # [num_tokens] float in [0, 1]
    history: np.ndarray  # [num_tokens] int: history bucket (see history_bucket)

    def subset(self, mask: np.ndarray) -> TokenCells:  # mask: [num_tokens] bool
        return TokenCells(*(np.asarray(a)[mask] for a in
                            (self.proposer, self.sampled, self.position, self.signal,
                             self.history)))


class AcceptanceEstimator:
    """The cells' counts and posteriors (see the module docstring).

    Kept in flat float64 arrays that the union's compiled step reads and writes
    (:mod:`specplugin.adaptive.kernels`: the posterior means of a step's offers and the
    plan in one call, a batch of verdicts in another), right after the target's forward has
    evicted the caches, where Python pays for every call and object it touches. Decay is a
    common scale (the stored counts times ``_scale`` are the counts), so fading every cell
    costs one multiplication; the sums a cell's parent and its signal-pooled cell need are
    kept beside the counts, updated with them.
    """

    def __init__(self, proposers: tuple[str, ...], num_signal_buckets: int = 8,
                 prior_mean: float = 0.5, parent_strength: float = 4.0,
                 prior_strength: float = 2.0, memory: float = 4000.0, seed: int = 0):
        self.proposers = proposers
        self.num_signal_buckets = num_signal_buckets
        self.prior_mean, self.m, self.m0 = prior_mean, parent_strength, prior_strength
        self.decay = 1.0 - 1.0 / memory
        self.shape = (len(proposers), 2, len(POSITION_EDGES) + 1, num_signal_buckets,
                      len(HISTORY_EDGES) + 2)
        self.random = random.Random(seed)  # the pooled draws (seeded: runs repeat)
        kernels.seed(seed)  # the cells' draws (kernels.posterior_draw)
        _, modes, groups, buckets, histories = self.shape
        self._strides = (modes * groups * buckets * histories, groups * buckets * histories,
                         buckets * histories, histories)
        self._position_list = [g * buckets * histories for g in position_groups(64)]
        self._groups = np.array(position_groups(64), dtype=np.int64)  # (the last repeats)
        # what the compiled plan needs to build a token's cell (kernels.plan_offers)
        self.strides = (self._strides[0], self._strides[1], buckets * histories, histories,
                        buckets)
        self.set_counts(0.0, 0.0)

    # -- the counts -------------------------------------------------------------------

    @property
    def judged(self) -> np.ndarray:
        """n per cell, an array of the tables' shape (a copy: change it with set_counts)."""
        return np.array(self._n).reshape(self.shape) * self._scale

    @property
    def accepted(self) -> np.ndarray:
        """s per cell (a copy, as :attr:`judged`)."""
        return np.array(self._s).reshape(self.shape) * self._scale

    def set_counts(self, judged, accepted) -> None:
        """Replace the counts (arrays of the tables' shape, or scalars): a restored state,
        or 0 to forget everything learned."""
        n = np.broadcast_to(np.asarray(judged, dtype=float), self.shape)
        s = np.broadcast_to(np.asarray(accepted, dtype=float), self.shape)
        self._scale = 1.0
        self._n, self._s = n.ravel().copy(), s.ravel().copy()
        # per (proposer, mode, position): the parent; and per (..., history): pooled
        self._parent_n, self._parent_s = (a.sum(axis=(3, 4)).ravel() for a in (n, s))
        self._pool_n, self._pool_s = (a.sum(axis=3).ravel() for a in (n, s))
        # each cell's posterior draw, kept while its stamp is the tables' (_changed)
        self._drawn = np.zeros(self._n.size)
        self._stamps = np.full(self._n.size, -1, dtype=np.int64)
        self._stamp = 0
        self._changed()

    @property
    def tables(self) -> kernels.EstimatorTables:
        """What the compiled estimates read (:func:`kernels.posterior_value
        <specplugin.adaptive.kernels.posterior_value>`, :func:`kernels.plan_offers
        <specplugin.adaptive.kernels.plan_offers>`), by name; built when the counts
        change, not on each read (several a step)."""
        return self._tables

    def _changed(self) -> None:
        """The counts changed: every kept estimate and draw is stale."""
        self._stamp += 1
        self._tables = kernels.EstimatorTables(
            self._n, self._s, self._parent_n, self._parent_s, self._drawn, self._stamps,
            self._groups, self._strides[2], self._scale, float(self.m), float(self.m0),
            float(self.prior_mean), self._stamp)
        # draw -> signal-pooled cell -> its posterior mean or draw (see _pooled_value; a
        # token's own cell's are kept by the compiled estimates, kernels.posterior_draw)
        self._kept: dict[bool, dict[int, float]] = {False: {}, True: {}}

    def step(self, num_steps: int = 1) -> None:
        """Once per engine step (or for ``num_steps`` steps at once): old evidence fades."""
        self._scale *= self.decay ** num_steps
        if self._scale < 1e-200:  # (after ~2 million steps) back to scale 1, same counts
            g = self._scale
            for table in (self._n, self._s, self._parent_n, self._parent_s,
                          self._pool_n, self._pool_s):
                table *= g
            self._scale = 1.0
        self._changed()

    def update_cells(self, cells: Sequence[int], accepted: Sequence[bool | float]) -> None:
        """One judged token per entry: its cell (:meth:`cells`) and whether it was accepted,
        or the probability that it would be (a sampled token's, as the verifier computed
        it: the same average with less noise). One compiled call
        (:func:`kernels.update_cells <specplugin.adaptive.kernels.update_cells>`)."""
        kernels.update_cells(self._n, self._s, self._parent_n, self._parent_s, self._pool_n,
                             self._pool_s, np.asarray(cells, dtype=np.int64),
                             np.asarray(accepted, dtype=np.float64), 1.0 / self._scale,
                             self._strides[2], self._strides[3])
        self._changed()

    def update(self, t: TokenCells, accepted: np.ndarray) -> None:
        """``accepted``: [num_tokens] bool for judged tokens only."""
        self.update_cells(self._flat(t).tolist(), np.asarray(accepted, dtype=bool).tolist())

    def index(self, name: str) -> int:
        return self.proposers.index(name)

    def judged_tokens(self, proposer: int) -> float:
        """Judged tokens of one proposer in all (decayed), without building :attr:`judged`."""
        per_proposer = len(self._parent_n) // self.shape[0]
        start = proposer * per_proposer
        return float(self._parent_n[start:start + per_proposer].sum()) * self._scale

    # -- cells --------------------------------------------------------------------------

    def _cells(self, t: TokenCells) -> tuple[np.ndarray, ...]:
        position = np.searchsorted(POSITION_EDGES, t.position, side="right")
        signal = np.clip((np.asarray(t.signal) * self.num_signal_buckets).astype(int), 0,
                         self.num_signal_buckets - 1)
        return (np.asarray(t.proposer), np.asarray(t.sampled, dtype=int), position, signal,
                np.asarray(t.history))

    def _flat(self, t: TokenCells) -> np.ndarray:  # [num_tokens] flat cell index
        return np.ravel_multi_index(np.broadcast_arrays(*self._cells(t)), self.shape)

    def cells(self, proposer: int, sampled: bool, history: int, signal) -> list[int]:
        """Flat cell index of each token of one candidate (``signal`` [k], positions 0 ..
        k - 1), in plain Python: what :meth:`_flat` gives for them as :class:`TokenCells`."""
        per_proposer, per_mode, _, histories = self._strides
        buckets = self.num_signal_buckets
        base = proposer * per_proposer + int(sampled) * per_mode + history
        terms = self._position_list
        if len(signal) > len(terms):
            terms = self._position_list = [
                g * buckets * histories for g in position_groups(2 * len(signal))]
        # the signal's bucket as _cells' clip(int(x * buckets)): NaN -> 0, 1 -> last
        return [base + terms[j] + histories * (
                    int(x * buckets) if 0.0 <= x < 1.0 else (buckets - 1 if x >= 1.0 else 0))
                for j, x in enumerate(signal.tolist() if isinstance(signal, np.ndarray)
                                      else signal)]

    # -- posteriors ---------------------------------------------------------------------

    def _posterior(self, c: int, pooled: bool = False) -> tuple[float, float, float]:
        """(alpha, beta, mean) of cell ``c``'s posterior; ``pooled``: ``c`` indexes the
        signal-pooled table ((proposer, mode, position, history): a token not drafted
        yet, its cell pooled over signal buckets: what tokens of that proposer, position
        and history brought)."""
        g, per_parent, histories = self._scale, self._strides[2], self._strides[3]
        p = c // histories if pooled else c // per_parent
        # (arr.item(i): one call for a Python float, where arr[i].item() makes two)
        parent = ((self._parent_s.item(p) * g + self.m0 * self.prior_mean)
                  / (self._parent_n.item(p) * g + self.m0))
        n, s = ((self._pool_n, self._pool_s) if pooled else (self._n, self._s))
        n, s = n.item(c) * g, s.item(c) * g
        alpha = s + self.m * parent
        return alpha, max(n - s, 0.0) + self.m * (1.0 - parent), alpha / (n + self.m)

    def _draw(self, alpha: float, beta: float) -> float:
        return min(max(self.random.betavariate(alpha, beta), 1e-6), 1.0 - 1e-6)

    def _pooled_value(self, c: int, draw: bool) -> float:
        """Signal-pooled cell ``c``'s posterior mean, or (``draw``) one draw from it, kept
        until the counts change (see :meth:`_posterior`)."""
        kept = self._kept[draw]
        x = kept.get(c)
        if x is None:
            alpha, beta, mean = self._posterior(c, pooled=True)
            x = kept[c] = self._draw(alpha, beta) if draw else mean
        return x

    def estimate_cells(self, cells: Sequence[int], draw: bool = False) -> list[float]:
        """Acceptance of tokens given by their cells (:meth:`cells`): posterior means, or
        (``draw``) one posterior draw per cell, kept until the counts change (tokens of the
        same cell, within a step and across the steps until the next update, get the same
        draw: Thompson sampling with the estimator's batched updates)."""
        return self.values([-c - 1 for c in cells] if draw else list(cells))

    def values(self, codes: list[int]) -> list[float]:
        """Acceptance of tokens given by their codes: cell ``c`` its posterior mean,
        ``-(c + 1)`` its draw (as :meth:`estimate_cells`), in one compiled call
        (:func:`kernels.posterior_values <specplugin.adaptive.kernels.posterior_values>`)."""
        out = np.empty(len(codes))
        tables = self._tables
        kernels.posterior_values(np.array(codes, dtype=np.int64), *tables.posterior_arrays(),
                                 *tables.numbers(), out)
        return out.tolist()

    def estimate(self, t: TokenCells, signal_known: bool = True,
                 draw: np.ndarray | None = None) -> np.ndarray:  # [num_tokens]
        """Posterior means; ``draw`` [num_tokens] bool: those tokens drawn from the
        posterior instead (fresh draws, one per token); ``signal_known`` False: the
        tokens' cells pooled over signal buckets (a token not drafted yet)."""
        flat = self._flat(t).tolist()
        drawn = [False] * len(flat) if draw is None else np.asarray(draw, dtype=bool).tolist()
        out = []
        for c, d in zip(flat, drawn):
            alpha, beta, mean = (self._posterior(c) if signal_known
                                 else self._posterior(self._pool_index(c), pooled=True))
            out.append(self._draw(alpha, beta) if d else mean)
        return np.array(out, dtype=float)

    def _pool_index(self, c: int) -> int:
        """The signal-pooled cell of flat cell ``c``."""
        per_parent, histories = self._strides[2], self._strides[3]
        return (c // per_parent) * histories + c % histories

    def pooled_cells(self, proposer: int, sampled: bool, history: int, num_tokens: int,
                     draw: bool = False) -> list[float]:  # [num_tokens]
        """Acceptance of positions 0 .. num_tokens - 1 of a candidate not drafted yet (the
        draft model before it runs): its cells pooled over signal buckets, per position
        group; posterior means, or (``draw``) one posterior draw per cell, shared by every
        row and position that reads the cell and kept until the counts change, as
        :meth:`estimate_cells`'s (a decision that holds for many rows at once, such as
        running the draft model, must weigh one guess at what its tokens are worth, not
        many independent ones whose average is the mean again)."""
        _, modes, groups, _, histories = self.shape
        base = (proposer * modes + int(sampled)) * groups
        values, last, x = [], -1, 0.0
        for g in position_groups(num_tokens):  # (non-decreasing: one lookup per group)
            if g != last:
                x, last = self._pooled_value((base + g) * histories + history, draw), g
            values.append(x)
        return values


def as_list(values) -> list:
    """An engine array's values as Python numbers (one call instead of one per element)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def expected_emitted(num_scheduled: Sequence[int], num_emitted: Sequence[int],
                     expected: Sequence[Sequence[float] | None] | None,
                     sampled: Sequence[bool]) -> float:
    """Tokens the step emitted in expectation, what the step arbiter counts for its rate:
    for a sampled row whose ``k`` verified drafts have acceptance probabilities
    ``a_1 .. a_k`` (``expected[row]``, as the verifier computed them),
    ``1 + a_1 + a_1 a_2 + ... + a_1 ... a_k``; for any other row the tokens it emitted
    (``num_emitted``: accepted + 1). The same mean as the emitted tokens (it is their
    expectation given the drafts, the acceptance draws averaged out) with far less noise:
    at temperature 1 a 4-step block's emitted tokens vary with the draws (measured on the
    validation pair, batch 1, fresh engine: 1.0 to 3.75 a step from one block to the
    next, the blocks' rates 182-608 tok/s around a plain rate of 370), and the arbiter
    compares such blocks' rates with plain ones."""
    if not expected:  # (no row sampled: the step's emitted tokens, without a loop)
        return float(sum(num_emitted))
    total = 0.0
    for row, (k, emitted) in enumerate(zip(num_scheduled, num_emitted)):
        probs = expected[row] if k > 0 and sampled[row] and row < len(expected) else None
        if probs is None or len(probs) < k:
            total += emitted
            continue
        reach = tokens = 1.0
        for a in probs[:k]:
            reach *= a
            tokens += reach
        total += tokens
    return total


def judged_outcomes(expected: Sequence[Sequence[float]] | None, row: int, sampled: bool,
                    judged: int, num_accepted: int) -> list:  # [judged] bool or float
    """What a row's ``judged`` tokens teach: for a sampled request, each token's acceptance
    probability where the verifier gave them (``expected[row]``, one per verified token:
    the same average as the verdicts, without their noise); else whether it was accepted
    (the first ``num_accepted`` were)."""
    probs = expected[row] if sampled and expected and row < len(expected) else None
    if probs is not None and len(probs) >= judged:
        return list(probs[:judged])
    return [j < num_accepted for j in range(judged)]


def position_groups(num_tokens: int) -> list[int]:
    """The position group (the estimator's cell axis) of draft positions 0 .. n - 1."""
    groups = _POSITION_GROUPS[:num_tokens]
    return groups + groups[-1:] * (num_tokens - len(groups))


def history_bucket(recent_acceptance: float | None) -> int:
    """Bucket of a request's recent acceptance; ``None`` (no evidence yet) has its own."""
    if recent_acceptance is None:
        return len(HISTORY_EDGES) + 1
    # the edges at or below it (np.searchsorted, side="right", without numpy's call cost)
    return sum(recent_acceptance >= edge for edge in _HISTORY_EDGE_LIST)


class RequestHistory:
    """Per-request exponential average of judged tokens' acceptance (weight ``alpha``)."""

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self._recent: dict[str, float] = {}

    def __len__(self) -> int:  # requests with a recent acceptance
        return len(self._recent)

    def get(self, req_id: str) -> float | None:
        return self._recent.get(req_id)

    def update(self, req_id: str, judged: int, accepted: int) -> None:
        """``judged`` tokens of one draft were judged, its first ``accepted`` accepted
        (and, if fewer, the next one rejected): averaged in that order."""
        value, alpha = self._recent.get(req_id), self.alpha
        for j in range(judged):
            a = 1.0 if j < accepted else 0.0
            value = a if value is None else value + alpha * (a - value)
        if value is not None:
            self._recent[req_id] = value

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._recent.pop(req_id, None)

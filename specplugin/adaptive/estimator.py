"""The difficulty estimator: P(a draft token is accepted), learned from verification.

A token's *cell*: (proposer, greedy or sampled, position group, bucket of the proposer's
signal in [0, 1] (never assumed a probability), bucket of the request's recent
acceptance). Each cell counts judged tokens ``n`` (all earlier draft tokens accepted)
and accepted ones ``s``, and shrinks toward its parent (same proposer, mode and
position group), the parent toward ``prior_mean``::

    parent = (s_p + m0 * prior_mean) / (n_p + m0)
    a      = (s + m * parent) / (n + m)

Counts decay by ``1 - 1 / memory`` per step, so a cell no longer drafted drifts back and
is tried again. Exploration: a seeded draw from ``Beta(s + m * parent, n - s + m * (1 -
parent))`` (Thompson sampling), one per cell kept until the counts change.
(see docs/design.md)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from specplugin.adaptive import kernels

POSITION_EDGES = np.array([1, 2, 3, 4, 8])  # groups: 0, 1, 2, 3, 4-7, 8+
HISTORY_EDGES = np.array([0.3, 0.7])  # recent acceptance: low, mid, high (+ "new")
_HISTORY_EDGE_LIST = HISTORY_EDGES.tolist()
# the position group of draft positions 0, 1, ... (see position_groups)
_POSITION_GROUPS = np.searchsorted(POSITION_EDGES, np.arange(64), side="right").tolist()


class AcceptanceEstimator:
    """The cells' counts and posteriors, in flat arrays the compiled kernels read and
    write. Decay is one common scale (counts = stored * ``_scale``)."""

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
        # for kernels.plan_offers
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
        """Replace the counts (arrays of the tables' shape, or scalars; 0 forgets all)."""
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
        """What the compiled kernels read; rebuilt when the counts change, not per read."""
        return self._tables

    def _changed(self) -> None:
        """The counts changed: every kept estimate and draw is stale."""
        self._stamp += 1
        self._tables = kernels.EstimatorTables(
            self._n, self._s, self._parent_n, self._parent_s, self._drawn, self._stamps,
            self._groups, self._strides[2], self._scale, float(self.m), float(self.m0),
            float(self.prior_mean), self._stamp)
        # draw -> signal-pooled cell -> its posterior mean or draw (see _pooled_value)
        self._kept: dict[bool, dict[int, float]] = {False: {}, True: {}}

    def step(self, num_steps: int = 1) -> None:
        """Once per engine step (or for ``num_steps`` steps at once): old evidence fades."""
        self._scale *= self.decay ** num_steps
        if self._scale < 1e-200:  # renormalise (after ~2 million steps)
            g = self._scale
            for table in (self._n, self._s, self._parent_n, self._parent_s,
                          self._pool_n, self._pool_s):
                table *= g
            self._scale = 1.0
        self._changed()

    def update_cells(self, cells: Sequence[int], accepted: Sequence[bool | float]) -> None:
        """One judged token per entry: its cell and whether it was accepted, or (sampled
        tokens) the verifier's acceptance probability: same mean, less noise."""
        kernels.update_cells(self._n, self._s, self._parent_n, self._parent_s, self._pool_n,
                             self._pool_s, np.asarray(cells, dtype=np.int64),
                             np.asarray(accepted, dtype=np.float64), 1.0 / self._scale,
                             self._strides[2], self._strides[3])
        self._changed()

    def index(self, name: str) -> int:
        return self.proposers.index(name)

    def judged_tokens(self, proposer: int) -> float:
        """Judged tokens of one proposer in all (decayed)."""
        per_proposer = len(self._parent_n) // self.shape[0]
        start = proposer * per_proposer
        return float(self._parent_n[start:start + per_proposer].sum()) * self._scale

    # -- cells --------------------------------------------------------------------------

    def cells(self, proposer: int, sampled: bool, history: int, signal) -> list[int]:
        """Flat cell index of each token of one candidate (``signal`` [k]), in plain Python."""
        per_proposer, per_mode, _, histories = self._strides
        buckets = self.num_signal_buckets
        base = proposer * per_proposer + int(sampled) * per_mode + history
        terms = self._position_list
        if len(signal) > len(terms):
            terms = self._position_list = [
                g * buckets * histories for g in position_groups(2 * len(signal))]
        # the signal's bucket, clip(int(x * buckets)): NaN -> 0, 1 -> last
        return [base + terms[j] + histories * (
                    int(x * buckets) if 0.0 <= x < 1.0 else (buckets - 1 if x >= 1.0 else 0))
                for j, x in enumerate(signal.tolist() if isinstance(signal, np.ndarray)
                                      else signal)]

    # -- posteriors ---------------------------------------------------------------------

    def _posterior(self, c: int, pooled: bool = False) -> tuple[float, float, float]:
        """(alpha, beta, mean) of cell ``c``'s posterior; ``pooled``: ``c`` indexes the
        table pooled over signal buckets (for tokens not drafted yet)."""
        g, per_parent, histories = self._scale, self._strides[2], self._strides[3]
        p = c // histories if pooled else c // per_parent
        # arr.item(i): one call, where arr[i].item() makes two
        parent = ((self._parent_s.item(p) * g + self.m0 * self.prior_mean)
                  / (self._parent_n.item(p) * g + self.m0))
        n, s = ((self._pool_n, self._pool_s) if pooled else (self._n, self._s))
        n, s = n.item(c) * g, s.item(c) * g
        alpha = s + self.m * parent
        return alpha, max(n - s, 0.0) + self.m * (1.0 - parent), alpha / (n + self.m)

    def _draw(self, alpha: float, beta: float) -> float:
        return min(max(self.random.betavariate(alpha, beta), 1e-6), 1.0 - 1e-6)

    def _pooled_value(self, c: int, draw: bool) -> float:
        """Pooled cell ``c``'s posterior mean, or a draw kept until the counts change."""
        kept = self._kept[draw]
        x = kept.get(c)
        if x is None:
            alpha, beta, mean = self._posterior(c, pooled=True)
            x = kept[c] = self._draw(alpha, beta) if draw else mean
        return x

    def values(self, codes: list[int]) -> list[float]:
        """Acceptance per code: cell ``c`` its posterior mean, ``-(c + 1)`` its draw (one
        per cell, kept until the counts change), in one compiled call."""
        out = np.empty(len(codes))
        tables = self._tables
        kernels.posterior_values(np.array(codes, dtype=np.int64), *tables.posterior_arrays(),
                                 *tables.numbers(), out)
        return out.tolist()

    def pooled_cells(self, proposer: int, sampled: bool, history: int, num_tokens: int,
                     draw: bool = False) -> list[float]:  # [num_tokens]
        """Acceptance of positions 0 .. num_tokens - 1 of a candidate not drafted yet (the
        draft model before it runs), from cells pooled over signal. With ``draw``, one draw
        per cell shared by all rows: a decision for many rows (running the draft) must
        weigh one guess, not many whose average is the mean again."""
        _, modes, groups, _, histories = self.shape
        base = (proposer * modes + int(sampled)) * groups
        values, last, x = [], -1, 0.0
        for g in position_groups(num_tokens):  # non-decreasing: one lookup per group
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
    """Tokens the step emitted in expectation, what the step arbiter counts: a sampled row
    with verifier acceptances ``a_1 .. a_k`` (``expected[row]``) counts
    ``1 + a_1 + a_1 a_2 + ... + a_1 ... a_k``, any other row its ``num_emitted``. Same
    mean as the emitted tokens, far less noise (sampled blocks' rates otherwise swing
    ~3x from block to block)."""
    if not expected:  # no row sampled
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
    """What a row's ``judged`` tokens teach: for a sampled request the verifier's acceptance
    probabilities (``expected[row]``) if given, else whether each was accepted."""
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
    # np.searchsorted(side="right") without numpy's call cost
    return sum(recent_acceptance >= edge for edge in _HISTORY_EDGE_LIST)

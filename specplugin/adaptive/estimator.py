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
nothing). :meth:`AcceptanceEstimator.sample` therefore draws each token's acceptance
from the cell's posterior, ``Beta(s + m * parent, n - s + m * (1 - parent))``
(Thompson sampling): a cell with little evidence is sometimes tried, one with much
evidence behaves like its mean. Draws are seeded, so runs repeat. (The union
explores through one request per step; see :class:`~specplugin.proposers.union.Union`.)

The request's recent acceptance is an exponential average of its own judged
tokens (accepted = 1, rejected = 0), bucketed; a new request has its own bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
    def __init__(self, proposers: tuple[str, ...], num_signal_buckets: int = 8,
                 prior_mean: float = 0.5, parent_strength: float = 4.0,
                 prior_strength: float = 2.0, memory: float = 4000.0, seed: int = 0):
        self.proposers = proposers
        self.num_signal_buckets = num_signal_buckets
        self.prior_mean, self.m, self.m0 = prior_mean, parent_strength, prior_strength
        self.decay = 1.0 - 1.0 / memory
        shape = (len(proposers), 2, len(POSITION_EDGES) + 1, num_signal_buckets,
                 len(HISTORY_EDGES) + 2)
        self.judged = np.zeros(shape)  # n per cell
        self.accepted = np.zeros(shape)  # s per cell
        self.rng = np.random.default_rng(seed)  # draws (seeded: runs repeat)
        # the counts' sums over signal (and history) buckets, kept until the counts change
        # (update, step, changed): a step estimates several times between two changes,
        # and each sum is a reduction over the whole table
        self._marginals: tuple[np.ndarray, ...] | None = None
        self._position_terms = np.zeros(0, dtype=np.intp)  # [positions] (see flat_cells)

    def set_counts(self, judged, accepted) -> None:
        """Replace the counts (arrays of the tables' shape, or scalars): a restored state,
        or 0 to forget everything learned. The kept sums are recomputed on next use."""
        self.judged[...] = judged
        self.accepted[...] = accepted
        self._marginals = None

    def _sums(self) -> tuple[np.ndarray, ...]:
        """(n, s) summed over signal and history buckets, then (n, s) over signal only."""
        if self._marginals is None:
            self._marginals = (self.judged.sum(axis=(3, 4)), self.accepted.sum(axis=(3, 4)),
                               self.judged.sum(axis=3), self.accepted.sum(axis=3))
        return self._marginals

    def index(self, name: str) -> int:
        return self.proposers.index(name)

    def _cells(self, t: TokenCells) -> tuple[np.ndarray, ...]:
        position = np.searchsorted(POSITION_EDGES, t.position, side="right")
        signal = np.clip((np.asarray(t.signal) * self.num_signal_buckets).astype(int), 0,
                         self.num_signal_buckets - 1)
        return (np.asarray(t.proposer), np.asarray(t.sampled, dtype=int), position, signal,
                np.asarray(t.history))

    def _flat(self, t: TokenCells) -> np.ndarray:  # [num_tokens] flat cell index
        return np.ravel_multi_index(np.broadcast_arrays(*self._cells(t)), self.judged.shape)

    def flat_cells(self, proposer: Sequence[int], sampled: Sequence[bool],
                   history: Sequence[int], signals: Sequence[np.ndarray]) -> np.ndarray:
        """Flat cell index (into the tables raveled) of every token of several candidates
        at once, concatenated: per candidate its proposer, mode, history bucket and its
        tokens' signals ``[k]`` (positions 0 .. k - 1). What :class:`TokenCells` says, for
        the union's per-step path: the per-candidate part of the index in Python, the
        per-token part in four numpy calls."""
        _, modes, groups, buckets, histories = self.judged.shape
        lengths = [len(x) for x in signals]
        if max(lengths, default=0) > len(self._position_terms):
            groups_of = np.array(position_groups(max(64, *lengths)), dtype=np.intp)
            self._position_terms = groups_of * (buckets * histories)
        base = [((p * modes + int(s)) * groups * buckets) * histories + h
                for p, s, h in zip(proposer, sampled, history)]
        bucket = np.clip((np.concatenate(signals) * buckets).astype(np.intp), 0, buckets - 1)
        position = np.concatenate([self._position_terms[:k] for k in lengths])
        return np.repeat(base, lengths) + position + bucket * histories

    def _evidence(self, flat: np.ndarray, signal_known: bool = True):
        """(judged n, accepted s, parent) per token (``flat``: cell indices). ``signal_known``
        False: the token is not drafted yet (the draft model before it runs), so its cell
        is pooled over signal buckets: what tokens of that proposer, position and history
        brought."""
        buckets, histories = self.judged.shape[3:]
        judged_ph, accepted_ph, judged_p, accepted_p = self._sums()
        parent_cell = flat // (buckets * histories)  # (proposer, mode, position)
        parent = ((accepted_ph.reshape(-1)[parent_cell] + self.m0 * self.prior_mean)
                  / (judged_ph.reshape(-1)[parent_cell] + self.m0))
        if signal_known:
            return self.judged.reshape(-1)[flat], self.accepted.reshape(-1)[flat], parent
        pooled = parent_cell * histories + flat % histories
        return judged_p.reshape(-1)[pooled], accepted_p.reshape(-1)[pooled], parent

    def estimate(self, t: TokenCells, signal_known: bool = True,
                 draw: np.ndarray | None = None) -> np.ndarray:  # [num_tokens]
        """Posterior means; ``draw`` [num_tokens] bool: those tokens drawn from the
        posterior instead (as :meth:`sample` on them would), from the same lookup."""
        return self.estimate_flat(self._flat(t), signal_known, draw)

    def estimate_flat(self, flat: np.ndarray, signal_known: bool = True,
                      draw: np.ndarray | None = None) -> np.ndarray:  # [num_tokens]
        """:meth:`estimate` of tokens given by their cell indices (:meth:`flat_cells`)."""
        n, s, parent = self._evidence(flat, signal_known)
        alpha = s + self.m * parent
        mean = alpha / (n + self.m)
        if draw is not None and draw.any():
            beta = np.maximum(n[draw] - s[draw], 0.0) + self.m * (1.0 - parent[draw])
            mean[draw] = np.clip(self.rng.beta(alpha[draw], beta), 1e-6, 1.0 - 1e-6)
        return mean

    def sample(self, t: TokenCells, signal_known: bool = True,
               shared: bool = False) -> np.ndarray:  # [num_tokens]
        """One draw per token from its cell's posterior (see the module docstring);
        ``shared``: one draw per distinct cell, the same for every token in it (a
        decision that holds for many rows at once, such as running the draft model,
        must weigh one guess at what its tokens are worth, not many independent ones
        whose average is the mean again)."""
        if shared and not signal_known:
            return self._sample_pooled(t)
        flat = self._flat(t)
        n, s, parent = self._evidence(flat, signal_known)
        alpha = s + self.m * parent
        beta = np.maximum(n - s, 0.0) + self.m * (1.0 - parent)
        if shared and alpha.size:
            # distinct cells by their flat indices (np.unique over the stacked columns,
            # axis=1, costs ~10x more: it runs through numpy's Python axis handling)
            _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
            draws = self.rng.beta(alpha[first], beta[first])
            return np.clip(draws[np.ravel(inverse)], 1e-6, 1.0 - 1e-6)
        return np.clip(self.rng.beta(alpha, beta), 1e-6, 1.0 - 1e-6)

    def _sample_pooled(self, t: TokenCells) -> np.ndarray:  # [num_tokens]
        """:meth:`sample` shared over cells pooled over signal buckets: one draw for every
        cell of that table (a few hundred), read by the tokens' cells; cheaper than
        finding the tokens' distinct cells (np.unique) on every step's gate."""
        draws = self._pooled(slice(None), draw=True)  # [proposers, 2, positions, histories]
        proposer, sampled, position, _, history = self._cells(t)
        return draws[proposer, sampled, position, history]

    def pooled(self, proposer: int, draw: bool = False) -> list:  # [2][positions][histories]
        """One proposer's acceptance per (greedy / sampled, position group, history bucket),
        pooled over signal buckets (a token not drafted yet): posterior means, or
        (``draw``) one posterior draw per cell, as :meth:`sample` shared would give its
        tokens. As nested lists: a caller reads a few cells per row, in Python
        (:func:`position_groups`). The draw covers this proposer's cells only."""
        return self._pooled(proposer, draw).tolist()

    def _pooled(self, proposer, draw: bool) -> np.ndarray:
        judged_ph, accepted_ph, judged_p, accepted_p = (a[proposer] for a in self._sums())
        parent = ((accepted_ph + self.m0 * self.prior_mean) / (judged_ph + self.m0))[..., None]
        alpha = accepted_p + self.m * parent  # [..., 2, positions, histories]
        if not draw:
            return alpha / (judged_p + self.m)
        beta = np.maximum(judged_p - accepted_p, 0.0) + self.m * (1.0 - parent)
        return np.clip(self.rng.beta(alpha, beta), 1e-6, 1.0 - 1e-6)

    def update(self, t: TokenCells, accepted: np.ndarray) -> None:
        """``accepted``: [num_tokens] bool for judged tokens only."""
        self.update_flat(self._flat(t), accepted)

    def update_flat(self, flat: np.ndarray, accepted: np.ndarray) -> None:
        """:meth:`update` of tokens given by their cell indices (:meth:`flat_cells`)."""
        # counted per flat cell index (np.add.at on the index tuple costs several times more)
        size = self.judged.size
        self.judged += np.bincount(flat, minlength=size).reshape(self.judged.shape)
        self.accepted += np.bincount(flat, weights=np.asarray(accepted, dtype=float),
                                     minlength=size).reshape(self.judged.shape)
        self._marginals = None

    def step(self, num_steps: int = 1) -> None:
        """Once per engine step (or for ``num_steps`` steps at once): old evidence fades."""
        factor = self.decay ** num_steps
        self.judged *= factor
        self.accepted *= factor
        self._marginals = None


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

    def update(self, req_id: str, accepted: np.ndarray) -> None:
        value = self._recent.get(req_id)
        for a in np.asarray(accepted, dtype=float):
            value = a if value is None else value + self.alpha * (a - value)
        if value is not None:
            self._recent[req_id] = value

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._recent.pop(req_id, None)

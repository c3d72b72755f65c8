"""The K controller: for the whole batch, which candidate and how many of its tokens to verify.

Request r verifying the first k tokens of a candidate with conditional acceptances
a_1, a_2, ... emits on average ``E_r(k) = 1 + sum_{j <= k} P_j``, ``P_j = a_1 * ... * a_j``
(the 1 is the recovered or bonus token). A step of n query tokens takes T(n) seconds
(:mod:`~specplugin.adaptive.cost`). Draft tokens of all requests are offered in
decreasing P and the step verifies the prefix with the highest rate::

    j* = argmax_j (num_reqs + P_(1) + ... + P_(j)) / (T(n0 + j) + spec_overhead * [j > 0])

A request none of whose tokens pays decodes plainly (k = 0); a large batch backs off by
itself. Each request's candidate is the one worth most at the starting price
``theta = (T(n0 + 1) - T(n0)) * num_reqs / T(n0)``: ``sum_j max(0, P_j - theta)``.
(see docs/design.md)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specplugin.adaptive.cost import StepCostModel

NO_CANDIDATE = -1


@dataclass(frozen=True)
class Choice:
    candidate: int  # index into the request's candidates; NO_CANDIDATE: decode plainly
    num_tokens: int  # draft tokens to verify (0 with NO_CANDIDATE)


def plan(acceptance: Sequence[Sequence[np.ndarray]],  # [num_reqs][num_candidates] -> [k]
         step_seconds: Callable[[np.ndarray], np.ndarray] | StepCostModel,
         num_base_tokens: int | None = None, spec_overhead: float = 0.0) -> list[Choice]:
    """The choice for the batch (see :func:`planned`, which also gives its rate's terms)."""
    return planned(acceptance, step_seconds, num_base_tokens, spec_overhead)[0]


def planned(acceptance: Sequence[Sequence[np.ndarray]],  # [num_reqs][num_candidates] -> [k]
            step_seconds: Callable[[np.ndarray], np.ndarray] | StepCostModel,
            num_base_tokens: int | None = None, spec_overhead: float = 0.0,
            best: Sequence[tuple[int, list[float], float]] | None = None,
            ) -> tuple[list[Choice], float, float]:
    """The batch's choices, expected emitted tokens and predicted seconds.

    ``acceptance[r][c]``: conditional acceptance per token of candidate c of request r,
    cut to the request's limit. ``step_seconds``: vectorised T(n), or a cost model with
    ``step_times(first, count)``. ``num_base_tokens``: query tokens without drafts
    (default num_reqs). ``best``: :func:`best_candidates`, if the caller has it.
    T is asked once; the rest is plain floats (numpy per-call cost dominates at this size)."""
    num_reqs = len(acceptance)
    n0 = num_reqs if num_base_tokens is None else num_base_tokens
    if num_reqs == 0:
        return [], 0.0, 0.0
    if best is None:
        most = sum(max((len(a) for a in cands), default=0) for cands in acceptance)
    else:  # the table need only reach the chosen candidates' tokens
        most = sum(len(probs) for _, probs, _ in best)
    times = _step_times(step_seconds, n0, most + 2)  # T(n0) .. T(n0 + most + 1)
    t0 = times[0]
    if best is None:
        best = best_candidates(acceptance, _price(times, num_reqs))
    # every offered token: (P, request, position), in decreasing P
    offers = [(p, r, j) for r, (c, probs, _) in enumerate(best) if c != NO_CANDIDATE
              for j, p in enumerate(probs)]
    if not offers:
        return [Choice(NO_CANDIDATE, 0)] * num_reqs, float(num_reqs), t0
    offers.sort(key=lambda o: (-o[0], o[1], o[2]))
    # the first best prefix: rate (num_reqs + P_(1) + ... + P_(j)) / (T(n0 + j) + overhead)
    num_taken, best_rate, expected, best_expected = 0, num_reqs / t0, float(num_reqs), 0.0
    for j, (p, _, _) in enumerate(offers, 1):
        expected += p
        rate = expected / (times[j] + spec_overhead)
        if rate > best_rate:
            num_taken, best_rate, best_expected = j, rate, expected
    if not num_taken:
        return [Choice(NO_CANDIDATE, 0)] * num_reqs, float(num_reqs), t0
    counts = [0] * num_reqs
    for _, r, _ in offers[:num_taken]:
        counts[r] += 1
    return ([Choice(best[r][0], counts[r]) if counts[r] else Choice(NO_CANDIDATE, 0)
             for r in range(num_reqs)], best_expected, times[num_taken] + spec_overhead)


def _step_times(step_seconds, n0: int, count: int) -> list[float]:
    """[T(n0), ..., T(n0 + count - 1)] (see :func:`planned`)."""
    step_times = getattr(step_seconds, "step_times", None)
    return (step_times(n0, count) if step_times is not None
            else step_seconds(n0 + np.arange(count)).tolist())


def token_price(step_seconds, num_reqs: int, num_base_tokens: int | None = None) -> float:
    """Price ``theta`` of one more verified token, in emitted tokens:
    ``(T(n0 + 1) - T(n0)) * num_reqs / T(n0)``."""
    n0 = num_reqs if num_base_tokens is None else num_base_tokens
    return _price(_step_times(step_seconds, n0, 2), num_reqs)


def _price(times: Sequence[float], num_reqs: int) -> float:
    """:func:`token_price` from ``times`` = [T(n0), T(n0 + 1), ...]."""
    return (times[1] - times[0]) * num_reqs / times[0]


def best_candidates(acceptance: Sequence[Sequence[np.ndarray]],
                    theta: float) -> list[tuple[int, list[float], float]]:
    """Per request, (index or NO_CANDIDATE, cumulative P, worth ``sum max(0, P_j - theta)``)
    of its candidate worth most at price ``theta``; ties go to the earlier candidate."""
    return [_best_candidate(cands, theta) for cands in acceptance]


def cumulative(acceptance) -> list[float]:
    """P_j = a_1 * ... * a_j for each j, as floats (multiplied in order, as np.cumprod)."""
    probs, p = [], 1.0
    for a in acceptance.tolist() if isinstance(acceptance, np.ndarray) else acceptance:
        p *= a
        probs.append(p)
    return probs


def with_candidates(best: Sequence[tuple[int, list[float], float]],
                    added: Sequence[tuple[int, int, Sequence[float]]],
                    theta: float) -> tuple[list[tuple[int, list[float], float]], bool]:
    """``best`` as if each ``(row, index, acceptance)`` of ``added`` were appended to its
    row's candidates (it wins only if worth strictly more), and whether any row changed."""
    out, changed = list(best), False
    for r, index, acceptance in added:
        _, probs, value = _best_candidate([acceptance], theta)
        if value > out[r][2]:
            out[r] = (index, probs, value)
            changed = True
    return out, changed


def _best_candidate(candidates: Sequence[np.ndarray],
                    theta: float) -> tuple[int, list[float], float]:
    """(index, cumulative P, worth) of the candidate worth most at price theta."""
    best, best_value, best_p = NO_CANDIDATE, 0.0, []
    for c, a in enumerate(candidates):
        if len(a) == 0:
            continue
        p = cumulative(a)
        value = sum(q - theta for q in p if q > theta)
        if value > best_value:
            best, best_value, best_p = c, value, p
    return best, best_p, best_value


# most extra rows (candidates beyond each request's first) one step verifies
MAX_EXTRA_ROWS = 8


@dataclass(frozen=True)
class Extra:
    """A candidate a request verifies beside its chosen one (batch-expanding scorer)."""

    candidate: int
    num_tokens: int


def expand(choices: Sequence[Choice],
           acceptance: Sequence[Sequence[np.ndarray]],  # [num_reqs][num_candidates] -> [k]
           divergence: Sequence[Sequence[int]],  # [num_reqs][num_candidates]
           step_seconds: Callable[[np.ndarray], np.ndarray],
           max_candidates: int, eligible: Sequence[bool] | None = None,
           max_rows: int = MAX_EXTRA_ROWS, spec_overhead: float = 0.0,
           num_base_tokens: int | None = None) -> list[list[Extra]]:
    """Which other candidates each request verifies too, as extra rows of the same pass.

    Candidate c, cut to the chosen draft's length k (vLLM rolls a request back by its
    scheduled draft length), helps only when the chosen one is rejected exactly at their
    divergence d (``divergence[r][c]``)::

        gain = P_(d) * (1 - a_(d+1)) * sum_{j = d+1..k} prod_{i = d+1..j} b_i

    (``a``: the chosen draft's acceptances, ``b``: c's), for ``1 + k`` verified tokens.
    Extras are taken in decreasing gain per token while each raises the step's rate, at
    most ``max_candidates - 1`` per request and ``max_rows`` in all; ``eligible[r]``
    False: never expand r. (see docs/design.md)"""
    num_reqs = len(choices)
    n = (num_reqs if num_base_tokens is None else num_base_tokens) + sum(
        c.num_tokens for c in choices)
    expected = float(num_reqs)
    offers = []  # (gain per token, gain, request, candidate, tokens)
    for r, choice in enumerate(choices):
        if choice.candidate == NO_CANDIDATE:
            continue
        primary = np.asarray(acceptance[r][choice.candidate][:choice.num_tokens], dtype=float)
        expected += float(np.cumprod(primary).sum())
        if eligible is not None and not eligible[r]:
            continue
        for c, other in enumerate(acceptance[r]):
            k, d = min(len(other), choice.num_tokens), divergence[r][c]
            if c == choice.candidate or d >= k:
                continue
            reach = float(np.prod(primary[:d])) * (1.0 - float(primary[d]))
            gain = reach * float(np.cumprod(np.asarray(other[d:k], dtype=float)).sum())
            if gain > 0:
                offers.append((gain / (1 + k), gain, r, c, k))
    extras: list[list[Extra]] = [[] for _ in range(num_reqs)]
    if not offers or max_candidates < 2:
        return extras
    offers.sort(key=lambda o: (-o[0], o[2], o[3]))
    seconds = float(step_seconds(np.array([n]))[0]) + spec_overhead
    taken = 0
    for _, gain, r, c, k in offers:
        if taken == max_rows:
            break
        if len(extras[r]) >= max_candidates - 1:
            continue
        longer = float(step_seconds(np.array([n + 1 + k]))[0]) + spec_overhead
        if (expected + gain) / longer <= expected / seconds:
            continue
        extras[r].append(Extra(c, k))
        taken, expected, n, seconds = taken + 1, expected + gain, n + 1 + k, longer
    return extras


def divergence(chosen: np.ndarray, other: np.ndarray) -> int:
    """First position where two token sequences differ (their common length if none)."""
    k = min(len(chosen), len(other))
    differ = np.flatnonzero(np.asarray(chosen[:k]) != np.asarray(other[:k]))
    return int(differ[0]) if len(differ) else k

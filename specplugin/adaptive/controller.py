"""The K controller: for the whole batch, which candidate and how many of its tokens to verify.

Request r verifying the first k tokens of a candidate whose tokens have conditional
acceptance estimates a_1, a_2, ... emits on average::

    E_r(k) = 1 + sum_{j <= k} P_j,    P_j = a_1 * ... * a_j

(the 1 is the recovered or bonus token). A step that verifies n query tokens in all
takes T(n) seconds (:mod:`~specplugin.adaptive.cost`), so the batch emits
``sum_r E_r / T(n)`` tokens per second. Starting from plain decoding (every
request k = 0, n = num_reqs), adding draft token j of request r raises that rate
exactly when::

    P_j / (T(n + 1) - T(n))  >  sum_r E_r / T(n)

its gain per second beats the rate already reached. Tokens are offered in
decreasing order of P (a request's own tokens come in order, since P falls along
a draft). A step that verifies any draft also pays the engine's speculative
machinery once (``spec_overhead`` seconds, measured by the cost model), so the
step verifies the prefix of offers with the highest rate::

    j* = argmax_j (num_reqs + P_(1) + ... + P_(j)) / (T(n0 + j) + spec_overhead * [j > 0])

(with T convex or linear in n the rate rises then falls along j, so this is the
point where the next offer stops paying). A request none of whose
tokens pays decodes plainly (k = 0), and a large batch, whose rate is already
high, backs off by itself.

Among one request's candidates, the one chosen is the one worth most at the
step's starting price ``theta = (T(n0 + 1) - T(n0)) * num_reqs / T(n0)``:
``sum_j max(0, P_j - theta)``.
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
    """``acceptance[r][c]``: conditional acceptance of each token of candidate c of request r
    (already cut to the request's limit). ``step_seconds(n)``: T(n), vectorised; or a
    cost model with ``step_times(first, count)``
    (:meth:`~specplugin.adaptive.cost.StepCostModel.step_times`, a cached table).
    ``num_base_tokens``: query tokens the step runs without drafts (default num_reqs).
    ``best``: each request's candidate worth most at the token price
    (:func:`best_candidates` of ``acceptance``), when the caller has it already.

    Returns the choices, the tokens the step is expected to emit and its predicted
    seconds (the step's rate is their ratio).

    It runs every step on a few dozen numbers: ``T`` is asked once, for every ``n`` the
    step may reach, and the rest is plain Python floats (numpy's per-call cost on arrays
    this small is most of the work otherwise)."""
    num_reqs = len(acceptance)
    n0 = num_reqs if num_base_tokens is None else num_base_tokens
    if num_reqs == 0:
        return [], 0.0, 0.0
    if best is None:
        most = sum(max((len(a) for a in cands), default=0) for cands in acceptance)
    else:  # (the table need only reach the chosen candidates' tokens)
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
    """The price ``theta`` at which :func:`planned` weighs a draft token: what one more
    verified token adds to the step, in tokens the step's rows emit,
    ``(T(n0 + 1) - T(n0)) * num_reqs / T(n0)``."""
    n0 = num_reqs if num_base_tokens is None else num_base_tokens
    return _price(_step_times(step_seconds, n0, 2), num_reqs)


def _price(times: Sequence[float], num_reqs: int) -> float:
    """:func:`token_price` from ``times`` = [T(n0), T(n0 + 1), ...]."""
    return (times[1] - times[0]) * num_reqs / times[0]


def best_candidates(acceptance: Sequence[Sequence[np.ndarray]],
                    theta: float) -> list[tuple[int, list[float], float]]:
    """Each request's candidate worth most at token price ``theta``: (index or
    NO_CANDIDATE, its cumulative P, its worth ``sum of (P_j - theta) over P_j > theta``).
    Adding a candidate to a request's list changes its entry only if the new one is worth
    strictly more (ties go to the earlier candidate), so the union's draft gate plans with
    the draft's candidate without weighing the others again."""
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
    """:func:`best_candidates` after each ``(row, index, acceptance)`` of ``added`` joined
    its row's list as its last candidate (``index``: its place there), from ``best``, the
    entries before: a row's entry changes only if the new candidate is worth strictly more
    (ties to the earlier, as :func:`best_candidates`). Returns the entries and whether any
    row changed."""
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
    """An extra candidate a request verifies beside its chosen one (the batch-expanding
    scorer): its index among the request's candidates and how many of its tokens."""

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

    ``divergence[r][c]``: the first position where candidate c differs from the chosen
    candidate of request r. Candidate c, cut to the chosen draft's length k (vLLM rolls a
    request back by its scheduled draft length, so no candidate may be longer), can only
    beat the chosen one when that one is rejected exactly at c's divergence point d, and
    then adds the tokens c gets accepted from d on::

        gain = P_(d) * (1 - a_(d+1)) * sum_{j = d+1..k} prod_{i = d+1..j} b_i

    (``P_(d)``: the chosen draft's first d tokens all accepted, ``a`` its conditional
    acceptances, ``b`` c's). The extra row costs ``1 + k`` verified tokens. As in
    :func:`plan`, extras are taken in decreasing gain per token while each raises the
    step's expected tokens per second, ``(E + gain) / T(n + 1 + k) > E / T(n)``, at most
    ``max_candidates - 1`` per request and ``max_rows`` in all. ``eligible[r]`` False:
    request r is never expanded (its acceptance is not one the scorer reproduces)."""
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

"""Compiled loops for the union's per-step decisions (numba, which vLLM requires).

Right after the target's forward the caches are cold and Python pays for every object it
touches (one compiled call took ``Union.choose`` from ~0.12 to ~0.05-0.07 ms at batch 1),
so a step's offers are flat arrays and estimate + plan are one call. The arithmetic
matches the Python it stands for (``AcceptanceEstimator._posterior``,
:func:`specplugin.adaptive.controller.planned`) operation for operation; tested against
it in ``tests/test_kernels.py``. Kernels are compiled eagerly at import (cached on disk)
so no compile lands inside a timed step.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from specplugin.host_kernels import JIT


class EstimatorTables(NamedTuple):
    """What the kernels read of an ``AcceptanceEstimator`` (its ``tables``): its own arrays,
    changed in place; the numbers as of its last change."""

    n: np.ndarray  # [num_cells] judged tokens per cell (over the decay scale)
    s: np.ndarray  # [num_cells] of them accepted
    parent_n: np.ndarray  # [num_parents] judged per (proposer, mode, position group)
    parent_s: np.ndarray  # [num_parents] of them accepted
    drawn: np.ndarray  # [num_cells] each cell's kept posterior draw
    stamps: np.ndarray  # [num_cells] int64 the tables' stamp when it was drawn
    groups: np.ndarray  # [positions] int64 each draft position's group
    per_parent: int  # cells per parent
    scale: float  # the decay scale: counts times it are the decayed counts
    m: float  # the prior's weight around the parent's mean
    m0: float  # the parent's prior weight
    prior_mean: float  # the parent's prior mean
    stamp: int  # the tables' count of changes (a draw older than it is stale)

    def posterior_arrays(self) -> tuple:
        """The arrays a posterior reads: counts, parents' counts, kept draws, stamps."""
        return self.n, self.s, self.parent_n, self.parent_s, self.drawn, self.stamps

    def numbers(self) -> tuple:
        """per_parent, scale, m, m0, prior_mean, stamp (the kernels' order)."""
        return self.per_parent, self.scale, self.m, self.m0, self.prior_mean, self.stamp


@numba.njit("float64(int64, float64[::1], float64[::1], float64[::1], float64[::1], int64, "
            "float64, float64, float64, float64)", **JIT)
def posterior_mean(c, n, s, pn, ps, per_parent, g, m, m0, prior_mean):
    """Cell ``c``'s posterior mean (counts times decay scale ``g``): shrunk toward its
    parent, the parent toward ``prior_mean``."""
    p = c // per_parent
    parent = (ps[p] * g + m0 * prior_mean) / (pn[p] * g + m0)
    return (s[c] * g + m * parent) / (n[c] * g + m)


@numba.njit("void(int64)", **JIT)
def seed(value):
    """Seed the draws of :func:`posterior_draw` (numba's generator: one per process)."""
    np.random.seed(value)


@numba.njit("float64(int64, float64[::1], float64[::1], float64[::1], float64[::1], "
            "float64[::1], int64[::1], int64, float64, float64, float64, float64, int64)", **JIT)
def posterior_draw(c, n, s, pn, ps, drawn, stamps, per_parent, g, m, m0, prior_mean, stamp):
    """A draw from ``Beta(s + m * parent, n - s + m * (1 - parent))``, clipped into
    (0, 1), kept in ``drawn[c]`` until the counts change (``stamps[c] != stamp``)."""
    if stamps[c] == stamp:
        return drawn[c]
    p = c // per_parent
    parent = (ps[p] * g + m0 * prior_mean) / (pn[p] * g + m0)
    judged, accepted = n[c] * g, s[c] * g
    alpha = accepted + m * parent
    beta = max(judged - accepted, 0.0) + m * (1.0 - parent)
    x = min(max(np.random.beta(alpha, beta), 1e-6), 1.0 - 1e-6)
    drawn[c] = x
    stamps[c] = stamp
    return x


@numba.njit("float64(int64, float64[::1], float64[::1], float64[::1], float64[::1], "
            "float64[::1], int64[::1], int64, float64, float64, float64, float64, int64)", **JIT)
def posterior_value(code, n, s, pn, ps, drawn, stamps, per_parent, g, m, m0, prior_mean, stamp):
    """Code ``c`` >= 0: cell c's posterior mean; ``-(c + 1)``: its kept draw."""
    if code >= 0:
        return posterior_mean(code, n, s, pn, ps, per_parent, g, m, m0, prior_mean)
    return posterior_draw(-code - 1, n, s, pn, ps, drawn, stamps, per_parent, g, m, m0,
                          prior_mean, stamp)


@numba.njit("void(int64[::1], float64[::1], float64[::1], float64[::1], float64[::1], "
            "float64[::1], int64[::1], int64, float64, float64, float64, float64, int64, "
            "float64[::1])", **JIT)
def posterior_values(codes, n, s, pn, ps, drawn, stamps, per_parent, g, m, m0, prior_mean,
                     stamp, out):
    """:func:`posterior_value` of each of ``codes`` [num_tokens] into ``out``."""
    for t in range(codes.shape[0]):
        out[t] = posterior_value(codes[t], n, s, pn, ps, drawn, stamps, per_parent, g, m, m0,
                                 prior_mean, stamp)


@numba.njit("void(float64[::1], float64[::1], float64[::1], float64[::1], float64[::1], "
            "float64[::1], int64[::1], float64[::1], float64, int64, int64)", **JIT)
def update_cells(n, s, pn, ps, qn, qs, cells, accepted, inc, per_parent, histories):
    """Add ``inc`` judged and ``inc * accepted`` accepted (1/0 or a probability) to each
    token's cell, parent and signal-pooled cell."""
    for t in range(cells.shape[0]):
        c = cells[t]
        a = accepted[t]
        p = c // per_parent
        q = p * histories + c % histories
        n[c] += inc
        pn[p] += inc
        qn[q] += inc
        if a != 0.0:
            s[c] += inc * a
            ps[p] += inc * a
            qs[q] += inc * a


# head lengths of plan_offers' two packed inputs
PLAN_INTS = 9  # [num_offers, num_reqs, per_parent, stamp, the cells' strides (5), ...]
PLAN_FLOATS = 5  # [decay scale, m, m0, prior mean, speculative overhead, ...]
OFFER_INTS = 5  # per offer: row, proposer, sampled, history bucket, drawn


@numba.njit("UniTuple(float64, 2)(int64[::1], float64[::1], float64[::1], float64[::1], "
            "float64[::1], float64[::1], float64[::1], int64[::1], int64[::1], float64[::1], "
            "int64[::1], int64[::1])", **JIT)
def plan_offers(ints, floats, n, s, pn, ps, drawn, stamps, groups, tok_acc, tok_cell, out):
    """:func:`~specplugin.adaptive.controller.planned` over flat offers; returns expected
    emitted tokens and seconds. Inputs are packed in two arrays (each conversion from
    Python costs microseconds with cold caches):

    ``ints`` = [num_offers, num_reqs, per_parent, stamp, strides per proposer, mode,
    position group and signal bucket (= num histories), num signal buckets, per offer (row,
    proposer, sampled, history, drawn) in row order, offer starts [num_offers + 1]].
    ``floats`` = [scale, m, m0, prior_mean, spec_overhead, T(n0), T(n0 + 1), ...,
    each offered token's signal]. ``groups``: position group per draft position (the
    last repeats).

    Outputs: ``tok_cell`` [num_tokens] cells; ``tok_acc`` [2 * num_tokens + num_reqs]
    acceptances, cumulative acceptances, each row's best worth; ``out`` [3 * num_reqs]
    chosen offer (-1: none), its tokens, best offer before the prefix cut (for the draft
    gate)."""
    num_offers, num_reqs, per_parent, stamp = ints[0], ints[1], ints[2], ints[3]
    per_proposer, per_mode, per_group, histories, buckets = (ints[4], ints[5], ints[6],
                                                             ints[7], ints[8])
    g, m, m0, prior_mean, spec_overhead = floats[0], floats[1], floats[2], floats[3], floats[4]
    meta = ints[PLAN_INTS:PLAN_INTS + OFFER_INTS * num_offers]
    off_start = ints[PLAN_INTS + OFFER_INTS * num_offers:]
    total = off_start[num_offers]
    times = floats[PLAN_FLOATS:floats.shape[0] - total]
    signals = floats[floats.shape[0] - total:]
    out_offer = out[:num_reqs]
    out_k = out[num_reqs:2 * num_reqs]
    out_best = out[2 * num_reqs:3 * num_reqs]
    theta = (times[1] - times[0]) * num_reqs / times[0]
    cum = tok_acc[total:2 * total]
    best_worth = tok_acc[2 * total:2 * total + num_reqs]
    best_worth[:] = 0.0
    out_offer[:] = -1
    out_k[:] = 0
    last_group = groups.shape[0] - 1
    for o in range(num_offers):
        r = meta[OFFER_INTS * o]
        base = (meta[OFFER_INTS * o + 1] * per_proposer + meta[OFFER_INTS * o + 2] * per_mode
                + meta[OFFER_INTS * o + 3])
        draw = meta[OFFER_INTS * o + 4] != 0
        p, worth = 1.0, 0.0
        for t in range(off_start[o], off_start[o + 1]):
            x = signals[t]  # its bucket: clip(int(x * buckets)), NaN -> 0
            bucket = int(x * buckets) if 0.0 <= x < 1.0 else (buckets - 1 if x >= 1.0 else 0)
            c = base + groups[min(t - off_start[o], last_group)] * per_group + histories * bucket
            tok_cell[t] = c
            a = posterior_value(-c - 1 if draw else c, n, s, pn, ps, drawn, stamps,
                                per_parent, g, m, m0, prior_mean, stamp)
            tok_acc[t] = a
            p *= a
            cum[t] = p
            if p > theta:
                worth += p - theta
        if worth > best_worth[r]:
            best_worth[r] = worth
            out_offer[r] = o
    out_best[:] = out_offer
    count = 0
    for r in range(num_reqs):
        o = out_offer[r]
        if o >= 0:
            count += off_start[o + 1] - off_start[o]
    t0 = times[0]
    if count == 0:
        return float(num_reqs), t0
    values = np.empty(count)
    rows = np.empty(count, np.int64)
    i = 0
    for r in range(num_reqs):  # (row, position) order: the sort below is stable
        o = out_offer[r]
        if o >= 0:
            for t in range(off_start[o], off_start[o + 1]):
                values[i] = cum[t]
                rows[i] = r
                i += 1
    order = np.argsort(-values, kind="mergesort")
    taken, best_rate, expected, best_expected = 0, num_reqs / t0, float(num_reqs), 0.0
    for j in range(count):
        expected += values[order[j]]
        rate = expected / (times[j + 1] + spec_overhead)
        if rate > best_rate:
            taken, best_rate, best_expected = j + 1, rate, expected
    for j in range(taken):
        out_k[rows[order[j]]] += 1
    for r in range(num_reqs):
        if out_k[r] == 0:
            out_offer[r] = -1
    if taken == 0:
        return float(num_reqs), t0
    return best_expected, times[taken] + spec_overhead


def pack_plan(num_reqs: int, meta: list[int], starts: list[int], signals: list,
              times: list[float], tables: EstimatorTables, strides: tuple[int, ...],
              spec_overhead: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_offers`' two packed inputs (``meta``: per offer row, proposer, sampled,
    history, drawn; ``signals``: each offer's [k]; ``tables``, ``strides``: the estimator's)."""
    per_parent, scale, m, m0, prior_mean, stamp = tables.numbers()
    ints = np.array([len(starts) - 1, num_reqs, per_parent, stamp, *strides] + meta + starts,
                    dtype=np.int64)
    head = [scale, m, m0, prior_mean, spec_overhead] + times
    for signal in signals:
        head += signal.tolist() if isinstance(signal, np.ndarray) else signal
    floats = np.array(head, dtype=np.float64)
    return ints, floats


def _warm_up() -> None:
    """Call each kernel once on a tiny input: a first call costs ~4 ms beyond the compile
    (numba's dispatcher setup), which would land in the first planned step. Makes no draw,
    so the generator's stream is untouched."""
    counts = [np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)]
    tables = EstimatorTables(*counts, np.zeros(4), np.zeros(4, dtype=np.int64),
                             np.zeros(1, dtype=np.int64), 1, 1.0, 4.0, 2.0, 0.5, 1)
    out = np.empty(4)
    posterior_values(np.zeros(1, dtype=np.int64), *tables.posterior_arrays(),
                     *tables.numbers(), out)
    update_cells(*counts, np.zeros(4), np.zeros(4), np.zeros(1, dtype=np.int64), np.zeros(1),
                 0.0, 1, 1)
    ints, floats = pack_plan(1, [0, 0, 0, 0, 0], [0, 1], [np.full(1, 0.5)], [1.0, 1.1, 1.2],
                             tables, (1, 1, 1, 1, 1), 0.0)
    plan_offers(ints, floats, *tables.posterior_arrays(), tables.groups, out,
                np.empty(1, dtype=np.int64), np.empty(3, dtype=np.int64))


_warm_up()

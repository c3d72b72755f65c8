"""An experiment, not the plugin's code: what issue 19's "offers as flat arrays, one
vectorised estimate and plan per step" would cost. One numba call does the choose stage
of a step (each offered token's posterior mean from the estimator's tables, each row's
candidate worth most at the step's token price, the batch's best prefix of tokens by
their cumulative acceptance) on flat arrays, the Python glue that builds them (each
token's cell, from the project's ``AcceptanceEstimator``) included; timed warm and with cold caches as ``scripts/core_bench.py``
times them. Left out beside ``Union.choose``: the Thompson draw of one row, the scorer's
alternates, remembering what was sent. Compare with::

    .venv/bin/python scripts/core_bench.py --batch 1 --cold --choose-only
    .venv/bin/python scripts/flat_plan_bench.py --batch 1

Three offers per row (n-gram, suffix, the draft model) of 8 tokens, as the core bench
offers them.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch

from specplugin.adaptive.controller import NO_CANDIDATE, planned
from specplugin.adaptive.estimator import AcceptanceEstimator

K = 8  # tokens per offer
OFFERS = 3  # offers per row (n-gram, suffix, the draft model)


@numba.njit(cache=True)
def plan_flat(tok_cell, off_start, off_row, n, s, pn, ps, per_parent, g, m, m0, prior_mean,
              times, num_reqs, spec_overhead, out_offer, out_k):
    """``tok_cell`` [num_tokens] each offered token's estimator cell, offer o's tokens at
    ``off_start[o]:off_start[o + 1]``, ``off_row`` [num_offers] its row; ``n``, ``s`` the
    cells' judged and accepted counts, ``pn``, ``ps`` their parents' (one per
    ``per_parent`` cells), ``g`` the decay scale, ``m``, ``m0``, ``prior_mean`` the
    priors: ``AcceptanceEstimator``'s tables and posterior mean, as its ``_posterior``; ``times`` [T(n0), T(n0 + 1), ...].
    Writes each row's chosen offer (-1: none) and its tokens to ``out_offer``, ``out_k``
    [num_reqs] (as ``controller.planned`` chooses)."""
    num_offers = off_row.shape[0]
    theta = (times[1] - times[0]) * num_reqs / times[0]
    total = tok_cell.shape[0]
    P = np.empty(total)
    best_worth = np.full(num_reqs, -1.0)
    out_offer[:] = -1
    out_k[:] = 0
    for o in range(num_offers):
        cum, worth = 1.0, 0.0
        for t in range(off_start[o], off_start[o + 1]):
            c = tok_cell[t]
            p = c // per_parent
            parent = (ps[p] * g + m0 * prior_mean) / (pn[p] * g + m0)
            a = (s[c] * g + m * parent) / (n[c] * g + m)
            cum *= a
            P[t] = cum
            if cum > theta:
                worth += cum - theta
        r = off_row[o]
        if worth > best_worth[r]:
            best_worth[r] = worth
            out_offer[r] = o
    # every token of the rows' best offers, by decreasing P
    count = 0
    for r in range(num_reqs):
        o = out_offer[r]
        if o >= 0:
            count += off_start[o + 1] - off_start[o]
    vals = np.empty(count)
    rows = np.empty(count, np.int64)
    i = 0
    for r in range(num_reqs):
        o = out_offer[r]
        if o >= 0:
            for t in range(off_start[o], off_start[o + 1]):
                vals[i] = P[t]
                rows[i] = r
                i += 1
    order = np.argsort(-vals, kind="mergesort")
    taken, best_rate, expected = 0, num_reqs / times[0], float(num_reqs)
    for j in range(count):
        expected += vals[order[j]]
        rate = expected / (times[j + 1] + spec_overhead)
        if rate > best_rate:
            taken, best_rate = j + 1, rate
    for j in range(taken):
        out_k[rows[order[j]]] += 1
    for r in range(num_reqs):
        if out_k[r] == 0:
            out_offer[r] = -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    batch = parser.parse_args().batch
    torch.set_num_threads(1)
    weights = [torch.randn(1024, 1024) for _ in range(8)]
    x = torch.randn(8, 1024)

    def sweep() -> None:  # as scripts/core_bench.py's: 32 MB of matrices
        y = x
        for w in weights:
            y = y @ w
    # the estimator's tables with counts as a few thousand judged tokens leave them; the
    # kernel reads them as arrays (what a flat-array estimator would keep)
    rng = np.random.default_rng(0)
    estimator = AcceptanceEstimator(("ngram", "suffix", "draft"))
    judged = rng.uniform(0, 50, estimator.shape)
    estimator.set_counts(judged, judged * rng.uniform(0, 1, estimator.shape))
    tables = [np.array(t) for t in (estimator._n, estimator._s, estimator._parent_n,
                                    estimator._parent_s)]
    per_parent = estimator._strides[2]
    times = 0.004 + 0.0002 * np.arange(OFFERS * batch * K + 4)  # T(n0), T(n0 + 1), ...
    # each offer's K tokens' signals (greedy rows, the first history bucket)
    signals = [rng.uniform(0.3, 1.0, K) for _ in range(OFFERS * batch)]
    rows = np.repeat(np.arange(batch), OFFERS).astype(np.int64)
    out_offer, out_k = np.empty(batch, np.int64), np.empty(batch, np.int64)

    def flat_step():
        # the glue: every offered token's cell (the estimator's own, as Union._estimate
        # asks it), then one flat array
        cells = []
        for o, sig in enumerate(signals):
            cells += estimator.cells(o % OFFERS, False, 0, sig)
        tok_cell = np.array(cells, dtype=np.int64)
        off_start = np.arange(0, (OFFERS * batch + 1) * K, K, dtype=np.int64)
        plan_flat(tok_cell, off_start, rows, *tables, per_parent, estimator._scale,
                  estimator.m, estimator.m0, estimator.prior_mean, times, batch, 0.0005,
                  out_offer, out_k)

    flat_step()  # compile
    # the same choice as the union's controller on the estimator's posterior means
    acceptance = [[] for _ in range(batch)]
    for o, sig in enumerate(signals):
        means = estimator.estimate_cells(estimator.cells(o % OFFERS, False, 0, sig))
        acceptance[int(rows[o])].append(np.array(means))
    choices = planned(acceptance, lambda k: times[k - batch], batch, 0.0005)[0]
    assert [c.num_tokens for c in choices] == out_k.tolist() and out_k.any(), (choices, out_k)
    assert [OFFERS * r + c.candidate if c.candidate != NO_CANDIDATE else -1
            for r, c in enumerate(choices)] == out_offer.tolist()
    for cold in (False, True):
        total = 0.0
        for _ in range(400):
            if cold:
                sweep()
            start = time.perf_counter()
            flat_step()
            total += time.perf_counter() - start
        print(f"batch {batch}, flat plan (glue + one compiled call), "
              f"{'cold' if cold else 'warm'} caches: {total / 400 * 1e3:.3f} ms a step")


if __name__ == "__main__":
    main()

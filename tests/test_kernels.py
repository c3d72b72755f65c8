"""The union's compiled plan and learning against the Python they stand for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specplugin.adaptive import kernels
from specplugin.adaptive.controller import NO_CANDIDATE, best_candidates, planned, token_price
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.estimator import AcceptanceEstimator


def _estimator(seed: int) -> AcceptanceEstimator:
    rng = np.random.default_rng(seed)
    estimator = AcceptanceEstimator(("ngram", "suffix", "draft"))
    judged = rng.uniform(0, 30, estimator.shape) * (rng.random(estimator.shape) < 0.5)
    estimator.set_counts(judged, judged * rng.uniform(0, 1, estimator.shape))
    estimator.step(int(rng.integers(0, 500)))  # a decay scale other than 1
    return estimator


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), num_reqs=st.integers(1, 9), drawn=st.booleans(),
       overhead=st.sampled_from([0.0, 0.0004, 0.003]))
def test_the_compiled_plan_is_the_controllers(seed, num_reqs, drawn, overhead):
    """plan_offers on flat offers chooses what controller.planned chooses on the same
    estimates (the posterior means, some tokens' posterior draws), with the same expected
    tokens and seconds, bit for bit."""
    rng = np.random.default_rng(seed)
    estimator = _estimator(seed)
    cost = StepCostModel(max_tokens=256)
    cost.calibrate(np.array([1, 8, 64, 256]),
                   np.array([0.004, 0.0045, 0.008, 0.03]) * rng.uniform(0.5, 2.0))
    cells, codes, starts, meta, signals, rows = [], [], [0], [], [], []
    for r in range(num_reqs):
        for proposer in range(int(rng.integers(0, 4))):
            k = int(rng.integers(1, 10)) if rng.random() < 0.9 else 70
            signal = rng.uniform(-0.1, 1.1, k).astype(rng.choice([np.float32, np.float64]))
            signal[rng.random(k) < 0.1] = np.nan
            signal[rng.random(k) < 0.1] = 1.0  # (the last bucket's edge)
            mode, history = bool(rng.random() < 0.5), int(rng.integers(0, 4))
            offer = estimator.cells(proposer % 3, mode, history, signal)
            draw = drawn and rng.random() < 0.4  # (the explorer's: posterior draws)
            for _ in range(1 + int(rng.random() < 0.3)):  # (a twin: ties go to the first)
                cells += offer
                codes += [-c - 1 for c in offer] if draw else offer
                starts.append(len(cells))
                meta += (r, proposer % 3, int(mode), history, int(draw))
                signals.append(signal)
                rows.append(r)
    estimates = estimator.values(codes)
    assert estimates == [estimator.values([code])[0] for code in codes]
    acceptance = [[] for _ in range(num_reqs)]
    for o, r in enumerate(rows):
        acceptance[r].append(np.array(estimates[starts[o]:starts[o + 1]]))
    choices, expected, seconds = planned(acceptance, cost, spec_overhead=overhead)

    out_acc = np.empty(2 * len(cells) + num_reqs)
    out_cell, out = np.empty(len(cells), dtype=np.int64), np.empty(3 * num_reqs, dtype=np.int64)
    times = cost.step_times(num_reqs, len(cells) + 2)
    ints, floats = kernels.pack_plan(num_reqs, meta, starts, signals, times, estimator.tables,
                                     estimator.strides, overhead)
    tables = estimator.tables
    got = kernels.plan_offers(ints, floats, *tables.posterior_arrays(), tables.groups, out_acc,
                              out_cell, out)
    out_offer, out_k = out[:num_reqs], out[num_reqs:2 * num_reqs]
    assert out_cell.tolist() == cells
    assert out_acc[:len(cells)].tolist() == estimates
    # each row's best offer before the prefix is cut, its cumulative P and worth
    best = best_candidates(acceptance, token_price(cost, num_reqs))
    first = {r: rows.index(r) for r in set(rows)}
    assert out[2 * num_reqs:].tolist() == [NO_CANDIDATE if c == NO_CANDIDATE else first[r] + c
                                           for r, (c, _, _) in enumerate(best)]
    assert out_acc[2 * len(cells):].tolist() == [worth for _, _, worth in best]
    for r, (c, probs, _) in enumerate(best):
        if c != NO_CANDIDATE:
            o = first[r] + c
            assert out_acc[len(cells) + starts[o]:len(cells) + starts[o + 1]].tolist() == probs
    assert out_offer.tolist() == [NO_CANDIDATE if c.candidate == NO_CANDIDATE
                                  else first[r] + c.candidate for r, c in enumerate(choices)]
    assert out_k.tolist() == [c.num_tokens for c in choices]
    assert got == (expected, seconds)


def test_the_compiled_update_is_the_tables_sums():
    """update_cells adds each judged token to its cell, its parent and its signal-pooled
    cell: the tables stay the sums set_counts would build from the cells' counts."""
    estimator = _estimator(3)
    rng = np.random.default_rng(4)
    cells = rng.integers(0, estimator._n.size, 500)
    accepted = np.where(rng.random(500) < 0.5, rng.random(500), 0.0)
    judged, accepted_counts = estimator.judged, estimator.accepted
    estimator.update_cells(cells.tolist(), accepted.tolist())
    np.add.at(judged.reshape(-1), cells, 1.0)
    np.add.at(accepted_counts.reshape(-1), cells, accepted)
    np.testing.assert_allclose(estimator.judged, judged, rtol=1e-12)
    np.testing.assert_allclose(estimator.accepted, accepted_counts, rtol=1e-12)
    rebuilt = AcceptanceEstimator(estimator.proposers)
    rebuilt.set_counts(judged, accepted_counts)
    for mine, theirs in zip(estimator.tables.posterior_arrays()[:4],
                            rebuilt.tables.posterior_arrays()[:4]):
        np.testing.assert_allclose(mine * estimator._scale, theirs, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(estimator._pool_n * estimator._scale, rebuilt._pool_n, rtol=1e-9)
    np.testing.assert_allclose(estimator._pool_s * estimator._scale, rebuilt._pool_s, rtol=1e-9,
                               atol=1e-9)


def test_means_and_draws_are_the_posteriors():
    """values: compiled means equal the Python posterior's; draws are kept per
    cell until the counts change, and follow the posterior (its mean, over fresh draws)."""
    estimator = _estimator(5)
    cells = list(range(0, estimator._n.size, 7))
    draws = [-c - 1 for c in cells]
    assert estimator.values(cells) == [estimator._posterior(c)[2] for c in cells]
    drawn = estimator.values(draws)
    assert drawn == estimator.values(draws)
    estimator.step()
    assert drawn != estimator.values(draws)
    cell = 11
    alpha, beta, mean = estimator._posterior(cell)
    samples = []
    for _ in range(4000):
        estimator._changed()
        samples.append(estimator.values([-cell - 1])[0])
    assert np.mean(samples) == pytest.approx(mean, abs=4 * np.sqrt(
        alpha * beta / ((alpha + beta) ** 2 * (alpha + beta + 1)) / 4000))

"""Difficulty estimator, cost model, controller and the union, on constructed cases."""

import itertools
from unittest.mock import patch

import numpy as np
import pytest

from specplugin.adaptive.arbiter import PLAIN_BLOCK_FACTOR, SPECULATE, StepArbiter
from specplugin.adaptive.controller import (NO_CANDIDATE, Choice, Extra, divergence, expand, plan,
                                           planned)
from specplugin.adaptive.cost import StepCostModel, StepSums
from specplugin.adaptive.estimator import (POSITION_EDGES, AcceptanceEstimator, history_bucket,
                                           position_groups)
from specplugin.proposers.base import Candidate, StepBatch
from specplugin.adaptive.draft_gate import DRAFT_TRIAL_ROWS, rate_terms
from specplugin.adaptive.learning import Verified
from specplugin.adaptive.union import DRAFT_TRIALS, Union


def linear(t0: float, per_token: float):
    return lambda n: t0 + per_token * np.asarray(n, dtype=float)


# ------------------------------------------------------------------ controller


def test_confident_long_match_is_verified_whole_and_no_match_decodes_plainly():
    choices = plan([[np.full(8, 0.95)], []], linear(0.010, 0.001))
    assert choices == [Choice(0, 8), Choice(NO_CANDIDATE, 0)]


def test_adversarial_text_gets_no_drafts():
    assert plan([[np.full(4, 0.05)]] * 4, linear(0.010, 0.001)) == [Choice(NO_CANDIDATE, 0)] * 4


def test_a_draft_stops_where_its_next_token_no_longer_pays():
    # P = 0.9, 0.45, 0.09, ...; at batch 1 a token costs 1 ms of a 10 ms step:
    # worth it while P > 1/11 * ... i.e. the rate 1/T(1) times the marginal cost
    [choice] = plan([[np.array([0.9, 0.5, 0.2, 0.5])]], linear(0.010, 0.001))
    assert choice == Choice(0, 2)


def test_large_batch_backs_off_where_batch_one_drafts():
    candidate = [np.full(4, 0.6)]
    cheap_fixed = linear(0.002, 0.001)  # a step is mostly per-token work
    assert plan([candidate], cheap_fixed)[0].num_tokens > 0
    assert all(c.num_tokens == 0 for c in plan([candidate] * 16, cheap_fixed))


def test_the_better_candidate_of_a_request_is_chosen():
    weak, strong = np.full(4, 0.3), np.full(3, 0.95)
    assert plan([[weak, strong]], linear(0.010, 0.001))[0] == Choice(1, 3)


def test_the_batch_shares_one_budget_best_tokens_first():
    # two requests, one confident, one middling: the step verifies more of the first
    choices = plan([[np.full(6, 0.95)], [np.full(6, 0.5)]], linear(0.004, 0.001))
    assert choices[0].num_tokens > choices[1].num_tokens >= 0


def test_the_plans_rate_terms_are_the_expected_tokens_and_seconds_of_its_choice():
    """planned gives, beside the choice, what the union's arbiter and draft gate weigh
    it by: expected tokens 1 + sum of P_j per request, and T(n) of the tokens verified
    plus the speculative machinery's price once if any draft is verified."""
    rng = np.random.default_rng(11)
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.004, 0.010]))
    union = Union([], cost=cost)
    for num_reqs in (1, 3, 8):
        for overhead in (0.0, 0.0005):
            acceptance = [[rng.random(int(rng.integers(1, 9))) ** 0.3
                           for _ in range(int(rng.integers(0, 3)))] for _ in range(num_reqs)]
            choices, expected, seconds = planned(acceptance, cost, spec_overhead=overhead)
            assert choices == plan(acceptance, cost, spec_overhead=overhead)
            terms = rate_terms(union.cost, acceptance, choices)  # (its machinery price is 0)
            assert expected == pytest.approx(terms[0])
            drafts = any(c.num_tokens for c in choices)
            assert seconds == pytest.approx(terms[1] + overhead * drafts)


def test_a_plan_with_one_more_candidate_per_row_reuses_the_rows_best():
    """The draft's gate plans the step twice, the second time with the draft's candidate
    added to some rows: the rows' best candidates at the token price need not be weighed
    again (with_candidates), and the plan from them is the plan from scratch; no row
    changing means no row would choose the added candidate."""
    from specplugin.adaptive.controller import best_candidates, token_price, with_candidates

    rng = np.random.default_rng(5)
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.004, 0.010]))
    unchanged = changed = 0
    for _ in range(400):
        num_reqs = int(rng.integers(1, 9))
        acceptance = [[list(rng.random(int(rng.integers(1, 9))) ** float(rng.uniform(0.1, 3)))
                       for _ in range(int(rng.integers(0, 3)))] for _ in range(num_reqs)]
        theta = token_price(cost, num_reqs)
        best = best_candidates(acceptance, theta)
        assert planned(acceptance, cost, best=best) == planned(acceptance, cost)
        added = []
        for r in range(num_reqs):
            if rng.random() < 0.6:
                # sometimes a copy of the row's best (a tie: the earlier one stays)
                a = (list(acceptance[r][best[r][0]]) if rng.random() < 0.2 and best[r][0] >= 0
                     else list(rng.random(int(rng.integers(1, 9))) ** float(rng.uniform(0.1, 3))))
                acceptance[r].append(a)
                added.append((r, len(acceptance[r]) - 1, a))
        best_with, any_changed = with_candidates(best, added, theta)
        assert best_with == best_candidates(acceptance, theta)
        full = plan(acceptance, cost)
        if any_changed:
            changed += 1
            assert planned(acceptance, cost, best=best_with) == planned(acceptance, cost)
        else:
            unchanged += 1
            assert not any(c.candidate == i for r, i, _ in added for c in full[r:r + 1])
    assert changed > 50 and unchanged > 50  # both branches exercised


def test_divergence_is_the_first_differing_position():
    assert divergence(np.array([1, 2, 3]), np.array([1, 5, 3])) == 1
    assert divergence(np.array([1, 2, 3]), np.array([1, 2])) == 2  # a prefix: never differs
    assert divergence(np.array([4]), np.array([5, 6])) == 0


def test_an_extra_candidate_is_verified_where_the_chosen_one_is_doubtful_and_rows_are_cheap():
    chosen, other = np.array([0.5, 0.9, 0.9]), np.full(3, 0.8)
    flat = linear(0.010, 0.0001)  # batch 1 on CPU: a few more tokens cost almost nothing
    choices = [Choice(0, 3)]
    assert expand(choices, [[chosen, other]], [[-1, 0]], flat, 2) == [[Extra(1, 3)]]
    # the same offer when each verified token costs much: not worth it
    assert expand(choices, [[chosen, other]], [[-1, 0]], linear(0.010, 0.004), 2) == [[]]
    # a sure chosen draft leaves nothing to win
    assert expand(choices, [[np.ones(3), other]], [[-1, 0]], flat, 2) == [[]]


def test_extra_candidates_are_cut_to_the_chosen_length_and_bounded():
    flat = linear(0.010, 0.00001)
    chosen, other = np.full(2, 0.3), np.full(6, 0.9)
    # never longer than the chosen draft (vLLM rolls back by the scheduled length)
    assert expand([Choice(0, 2)], [[chosen, other]], [[-1, 0]], flat, 2) == [[Extra(1, 2)]]
    # a candidate that agrees with the chosen one over its whole length adds nothing
    assert expand([Choice(0, 2)], [[chosen, other]], [[-1, 2]], flat, 2) == [[]]
    # at most max_candidates - 1 per request, max_rows in all, ineligible rows never
    three = [[chosen, other, other]] * 3
    diverge = [[-1, 0, 0]] * 3
    extras = expand([Choice(0, 2)] * 3, three, diverge, flat, 2, max_rows=2)
    assert [len(e) for e in extras] == [1, 1, 0]
    extras = expand([Choice(0, 2)] * 3, three, diverge, flat, 3, eligible=[False, True, True])
    assert [len(e) for e in extras] == [0, 2, 2]


# ------------------------------------------------------------------ estimator


def _cells(est, n, proposer=0, sampled=False, signal=0.9, history=3):
    """The cells of one candidate of ``n`` tokens (positions 0 .. n - 1)."""
    return est.cells(proposer, sampled, history, np.full(n, signal))


def _reference_cells(est, proposer, sampled, position, signal, history):
    """Flat cells from per-token arrays, as the estimator's axes define them (numpy's
    ravel, independent of :meth:`AcceptanceEstimator.cells`' arithmetic)."""
    buckets = est.num_signal_buckets
    axes = (np.asarray(proposer), np.asarray(sampled, dtype=int),
            np.searchsorted(POSITION_EDGES, position, side="right"),
            np.clip((np.nan_to_num(np.asarray(signal, dtype=float)) * buckets).astype(int), 0,
                    buckets - 1), np.asarray(history))
    return np.ravel_multi_index(np.broadcast_arrays(*axes), est.shape)


def _reference_means(est, cells, pooled=False):
    """Posterior means from the counts (:attr:`judged`, :attr:`accepted`), by the formula
    of the estimator's docstring; ``pooled``: each cell's signal-pooled cell instead."""
    n, s = est.judged, est.accepted  # [proposer, mode, position, signal, history]
    parent = ((s.sum(axis=(3, 4)) + est.m0 * est.prior_mean)
              / (n.sum(axis=(3, 4)) + est.m0))  # [proposer, mode, position]
    out = []
    for c in cells:
        i, j, g, b, h = np.unravel_index(c, est.shape)
        nc, sc = (n[i, j, g, :, h].sum(), s[i, j, g, :, h].sum()) if pooled else (
            n[i, j, g, b, h], s[i, j, g, b, h])
        out.append((sc + est.m * parent[i, j, g]) / (nc + est.m))
    return out


def test_estimator_cold_start_is_the_prior_and_learns_per_mode():
    est = AcceptanceEstimator(("ngram",))
    assert est.values(_cells(est, 3)) == pytest.approx([0.5] * 3)
    for _ in range(200):
        est.update_cells(_cells(est, 4), [True, True, True, False])
        est.update_cells(_cells(est, 4, sampled=True), [False] * 4)
    greedy, sampled = est.values(_cells(est, 4)), est.values(_cells(est, 4, sampled=True))
    assert greedy[0] > 0.95 and greedy[3] < 0.05
    assert max(sampled) < 0.05


def test_estimator_tells_signal_buckets_apart_and_forgets_slowly():
    est = AcceptanceEstimator(("suffix",), memory=50)
    high, low_cells = _cells(est, 1, signal=0.95), _cells(est, 1, signal=0.15)
    for _ in range(300):
        est.update_cells(high, [True])
        est.update_cells(low_cells, [False])
    assert est.values(high)[0] > 0.8
    low = est.values(low_cells)[0]
    assert low < 0.2
    for _ in range(500):  # no new evidence: back toward the prior, so it gets tried again
        est.step()
    assert est.values(low_cells)[0] > low + 0.2


def test_history_buckets():
    assert history_bucket(None) == 3
    assert [history_bucket(x) for x in (0.0, 0.5, 0.9)] == [0, 1, 2]


# ------------------------------------------------------------------ cost model


def test_cost_model_calibrates_then_tracks_observed_steps():
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 4, 16]), np.array([0.005, 0.008, 0.020]))
    assert cost.forward_seconds(4) == pytest.approx(0.008)
    assert cost.forward_seconds(16) - cost.forward_seconds(4) == pytest.approx(0.012)
    assert cost.forward_seconds(64) == pytest.approx(0.020 + 48 * 0.001)  # extrapolated
    for _ in range(400):  # the engine adds 3 ms of its own per step
        cost.observe(4, 0.011)
    assert cost.step_seconds(4) == pytest.approx(0.011, rel=0.05)
    assert cost.step_seconds(16) - cost.step_seconds(4) == pytest.approx(0.012, rel=0.3)


def test_the_cost_models_table_of_t_follows_every_observation():
    """step_times reads a table of F kept between observations and mended where a knot
    moved: after each observation it says what T(n) computed afresh says, for every n,
    past the last knot included."""
    rng = np.random.default_rng(4)
    for max_tokens in (16, 512):
        cost = StepCostModel(max_tokens=max_tokens, warmup=2)
        cost.calibrate(np.array([1, 4, 16]), np.array([0.004, 0.005, 0.008]))
        for _ in range(300):
            n = int(rng.integers(1, 2 * max_tokens))
            cost.observe(n, float(cost.step_seconds(np.array([n]))[0] * rng.uniform(0.7, 1.4)),
                         speculative=bool(rng.random() < 0.5))
            fresh = cost.step_seconds(np.arange(96)).tolist()
            assert cost.step_times(0, 96) == pytest.approx(fresh, rel=1e-9, abs=1e-12)
            assert cost.step_one(n) == pytest.approx(float(cost.step_seconds(np.array([n]))[0]))


def test_a_fresh_cost_model_prices_a_batchs_step_from_its_first_steps():
    """The calibration times forwards alone; a batch-8 step's scheduling, inputs,
    sampling and IPC double it (seen on the validation pair: 10-11 ms plain steps where
    T(8) said 5.5). A fresh model must price that step within a few steps, not after
    dozens at a 5% average, or its first speculative blocks look twice as cheap as they
    are; and, warm, it must still follow the machine by that average, not by a mean."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 8, 16]), np.array([0.005, 0.0055, 0.006]))
    for step in range(3):  # plain steps, each learned on its own (a speculative step between)
        cost.observe_plain(8, 0.011)
        cost.observe(12, 0.012, speculative=True)  # (flushes the plain sum; machinery unknown)
        if step == 0:
            assert cost.step_one(8) == pytest.approx(0.011, rel=0.02)
    assert cost.step_one(8) == pytest.approx(0.011, rel=0.02)
    for _ in range(400):
        cost.observe(8, 0.011)
    cost.observe(8, 0.016)  # one slow step of a warm model moves it by the average's weight
    assert cost.step_one(8) == pytest.approx(0.011 + 1.5 * 0.05 * 0.005, rel=0.02)


def test_forgetting_what_was_learned_returns_the_cost_model_to_its_calibration():
    """``specplugin bench`` warms an engine up before a cell and then makes the union
    forget what the warm-up taught, so that the cell starts as a user's fresh engine: the
    cost model included (taught by the warm-up, it priced a fresh engine's first steps as
    no user's engine can). Its calibrated forwards stay: they are timed at start."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 8, 16]), np.array([0.005, 0.0055, 0.006]))
    fresh = (cost.step_one(8), cost.step_one(12), cost.spec_overhead_s)
    cost.deferred_flush = True  # (the union's own setting survives)
    union = Union([Fixed("ngram", [], 0.5)], cost=cost)
    for _ in range(40):
        cost.observe_plain(8, 0.011)
        cost.observe(12, 0.016, speculative=True)
    cost.flush()
    assert cost.step_one(8) > 1.5 * fresh[0] and cost.spec_overhead_s > 0.002
    union.forget_learned()
    assert (cost.step_one(8), cost.step_one(12), cost.spec_overhead_s) == fresh
    assert cost.calibrated and cost.num_observed == 0 and cost.deferred_flush
    cost.observe_plain(8, 0.011)  # and it learns again as a fresh model does
    cost.observe(12, 0.016, speculative=True)
    assert cost.step_one(8) == pytest.approx(0.011, rel=0.02)


def test_cost_model_without_calibration_starts_from_the_first_step():
    cost = StepCostModel(max_tokens=16)
    cost.observe(2, 0.010)
    assert cost.step_seconds(2) == pytest.approx(0.010)
    cost.observe(2, 10.0)  # an idle gap, not a step
    assert cost.step_seconds(2) < 0.02


def test_plain_steps_summed_eight_at_a_time_teach_what_step_by_step_learning_does():
    """In an engine each cost-model update costs tens of microseconds, a percent of a
    plain step: plain steps are summed (StepSums) and learned as one mean weighted as
    their number, which lands where learning them one by one does."""
    def model():
        cost = StepCostModel(max_tokens=64)
        cost.calibrate(np.array([1, 4, 16]), np.array([0.005, 0.008, 0.020]))
        return cost

    one, summed = model(), model()
    rng = np.random.default_rng(0)
    for step, seconds in enumerate(0.009 + 0.001 * rng.standard_normal(400)):  # +4 ms
        one.observe(1, seconds)
        summed.observe_plain(1, seconds)
        if step == 47:  # as fast, not only to the same place
            assert summed.step_seconds(1) == pytest.approx(one.step_seconds(1), rel=0.02)
    assert summed.num_observed == one.num_observed == 400
    for _ in range(3):  # held back: less than a full sum
        summed.observe_plain(1, 0.009)
    assert summed.num_observed == 400
    summed.observe(2, 0.010)  # any other step is learned after the plain steps held back
    assert summed.num_observed == 404
    assert summed.step_seconds(1) == pytest.approx(one.step_seconds(1), rel=0.02)
    assert summed.step_seconds(1) == pytest.approx(0.009, rel=0.05)


def test_step_sums_hand_on_full_sums_and_changed_shapes_and_leave_out_idle_gaps():
    sums = StepSums(4)
    assert [sums.add(1, 0.010) for _ in range(3)] == [None] * 3
    assert sums.add(1, 0.010) == pytest.approx((1, 0.010, 4))
    assert sums.add(1, 0.020) is None
    assert sums.add(2, 0.030) == pytest.approx((1, 0.020, 1))  # a new shape: the old sum first
    assert sums.add(1, 0.5) == pytest.approx((2, 0.030, 1))  # 50x the last mean of shape 1
    assert sums.flush() is None  # the idle gap was left out
    with pytest.raises(ValueError, match="size >= 2"):
        StepSums(1)


def test_the_union_learns_plain_steps_in_sums():
    """Once the cost model was taught its first ``warmup`` steps (those it learns one by
    one: a fresh engine's fixed part), plain steps are learned 8 at a time."""
    union, _ = _plain_union()
    for step in range(1, 9):
        union.plain_step(0.01, 1, 1, False)
        assert union.cost.num_observed == step
    for step in range(1, 17):
        union.plain_step(0.01, 1, 1, False)
        assert union.cost.num_observed == 8 + 8 * (step // 8)


# ------------------------------------------------------------------ union


class Fixed:
    """A proposer that always guesses the same tokens with the same signal."""

    def __init__(self, name, tokens, signal, fail=False):
        self.name, self.tokens, self.signal, self.fail = name, tokens, signal, fail
        self.finished = []

    def propose(self, batch):
        if self.fail:
            raise RuntimeError("boom")
        return [Candidate(np.array(self.tokens[: batch.max_draft_lens[r]], dtype=np.int64),
                          np.full(min(len(self.tokens), batch.max_draft_lens[r]), self.signal))
                if r in batch.rows else None for r in range(batch.num_reqs)]

    def finish_requests(self, req_ids):
        self.finished += list(req_ids)


def _batch(req_ids, k=8, sampled=False):
    n = len(req_ids)
    return StepBatch(tuple(req_ids), np.zeros((n, 32), dtype=np.int32), np.full(n, 10),
                     np.full(n, 5), np.full(n, k), np.full(n, sampled), tuple(range(n)))


def flat_cost() -> StepCostModel:
    """A target forward that costs about the same for 1 to 64 query tokens (batch 1 on
    CPU): extra candidates are cheap to verify."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 2, 64]), np.array([0.010, 0.0101, 0.0102]))
    return cost


def _union(*proposers, explore=False, estimator=None):
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 2, 64]), np.array([0.010, 0.011, 0.073]))
    return Union(list(proposers), cost=cost, explore=explore, estimator=estimator)


def test_exploration_tries_again_a_proposer_rejected_by_bad_luck():
    """Two early rejections must not switch a proposer off: with posterior draws it is
    tried again and, being good, comes back; with posterior means it would stay off.
    (Over eight seeds: at batch 8 one row's draw must beat the whole batch's price, so a
    given seed may see the proposer back only late or not in 200 steps.)"""
    results = {False: 0, True: 0}
    for explore, seed in itertools.product((False, True), range(8)):
        union = _union(Fixed("p", [1, 2, 3, 4], 0.5), explore=explore,
                       estimator=AcceptanceEstimator(("p",), seed=seed))
        verified, accepted = None, 0
        for step in range(200):
            drafts = union.step(_batch([f"r{j}" for j in range(8)]), verified).drafts
            lucky = step >= 2  # the first two steps reject everything
            emitted = [len(d) + 1 if lucky else 1 for d in drafts]
            accepted += sum(e - 1 for e in emitted)
            verified = Verified(tuple(f"r{j}" for j in range(8)), np.array([len(d) for d in drafts]),
                                np.array(emitted), 0.012, 8 + sum(map(len, drafts)))
        results[explore] += accepted
    assert results[True] > 10 * max(1, results[False])


def test_exploration_at_large_batch_does_not_make_most_steps_speculative():
    """16 requests whose candidates are always rejected: exploration (posterior draws)
    must not keep the batch speculating, where every speculative step costs the whole
    batch the speculative machinery; once the rejections are learned, few steps speculate
    (over four seeds of the draws: 8-13 speculative steps of 300 each; 560 in all with
    the rejections not learned). It does not tell one exploring row from many: with draws
    kept per cell and the cells' shared parent learning every rejection, every row drawing
    read 9-13 a seed too, even with each row in a signal bucket of its own."""
    speculative = 0
    for seed in range(4):
        rng = np.random.default_rng(0)
        proposer = Fixed("p", [7, 7, 7], 0.5)
        cost = StepCostModel(max_tokens=64)  # CPU-like: a verified token costs ~0.13 ms
        cost.calibrate(np.array([1, 16, 64]), np.array([0.010, 0.012, 0.030]))
        union = Union([proposer], cost=cost, explore=True,
                      estimator=AcceptanceEstimator(("p",), seed=seed))
        req_ids = [f"r{j}" for j in range(16)]
        verified = None
        for _ in range(300):
            proposer.signal = rng.random(3)  # spread over the estimator's signal cells
            drafts = union.step(_batch(req_ids), verified).drafts
            speculative += any(drafts)
            verified = Verified(tuple(req_ids), np.array([len(d) for d in drafts]),
                                np.ones(16, int), 0.012, 16 + sum(map(len, drafts)))
    assert speculative <= 4 * 12, speculative

def test_union_learns_which_proposer_to_trust():
    good, bad = Fixed("good", [1, 2, 3, 4], 0.5), Fixed("bad", [9, 9, 9, 9], 0.5)
    union = _union(bad, good)
    verified = None
    for _ in range(60):
        drafts = union.step(_batch(["a"]), verified).drafts
        # the target always continues 1, 2, 3, 4: "good" is fully accepted, "bad" never
        num_accepted = 4 if drafts[0] == [1, 2, 3, 4][: len(drafts[0])] and drafts[0] else 0
        verified = Verified(("a",), np.array([len(drafts[0])]), np.array([num_accepted + 1]),
                            0.012, 1 + len(drafts[0]))
    assert drafts == [[1, 2, 3, 4]]
    assert union.stats.accepted_tokens["good"] > 0 and union.stats.accepted_tokens["bad"] == 0


def test_the_offers_not_sent_are_judged_against_the_emitted_tokens():
    """Two proposers offer for one request; the plan sends one. The target continues
    1, 2, 3, 4, 5: the offer not sent is judged too, against the sent draft's accepted
    tokens and the step's last token (``Verified.next_tokens``), so the proposer that
    lost learns what verification would have told it. Without the last token nothing
    is judged of it."""
    target = [1, 2, 3, 4, 5]
    for known in (True, False):
        union = _union(Fixed("copy", [1, 2, 3, 4], 0.9), Fixed("other", [1, 2, 7, 7], 0.9))
        plan = union.step(_batch(["a"]), None)
        sent, source = plan.drafts[0], plan.sources[0]
        assert sent and source is not None
        accepted = next((j for j, t in enumerate(sent) if t != target[j]), len(sent))
        verified = Verified(("a",), np.array([len(sent)]), np.array([accepted + 1]), 0.012,
                            1 + len(sent), next_tokens=[target[accepted]] if known else None)
        union.step(_batch(["a"]), verified)
        union.flush_learning()
        est, other = union.estimator, 1 - source
        assert est.judged_tokens(source) == pytest.approx(min(len(sent), accepted + 1))
        # "copy" sent: 1, 2, 3, 4 and then 5 emitted, "other" judged 1, 2 accepted and 7
        # rejected; "other" sent: 1, 2 and then 3 emitted, "copy" judged 1, 2, 3 accepted
        judged, right = (3, 2) if source == 0 else (3, 3)
        if not known:
            judged = right = 0
        assert est.judged_tokens(other) == pytest.approx(judged)
        assert float(est.accepted[other].sum()) == pytest.approx(right)
        assert union.stats.offers_judged_unsent == int(known)


def test_sampled_rows_learn_acceptance_probabilities_greedy_rows_their_verdicts():
    """Where the verifier tells each sampled token's acceptance probability, the union
    learns it instead of the verdict (the same average, less noise): a sampled row whose
    first token was rejected teaches 0.7, a greedy row's rejection teaches 0."""
    learned = {}
    for sampled in (True, False):
        union = _union(Fixed("p", [1, 2, 3], 0.9))
        drafts = union.step(_batch(["a"], sampled=sampled), None).drafts
        assert drafts[0], "the union sent no draft to learn from"
        k = len(drafts[0])
        verified = Verified(("a",), np.array([k]), np.array([1]), 0.012, 1 + k,
                            expected=[[0.7] * k])
        union.step(_batch(["a"], sampled=sampled), verified)
        union.flush_learning()
        est = union.estimator
        learned[sampled] = (float(est.accepted.sum()), float(est.judged.sum()))
    assert learned[True] == pytest.approx((0.7, 1.0), rel=1e-3)  # one judged token, 0.7
    assert learned[False] == pytest.approx((0.0, 1.0), rel=1e-3)


def test_expected_emitted_counts_sampled_drafts_at_their_acceptance_probabilities():
    from specplugin.adaptive.estimator import expected_emitted

    # sampled row: 1 + 0.5 + 0.25; greedy row: its 3 emitted tokens; no drafts: 1;
    # a sampled row the verifier gave no probabilities: its emitted tokens
    assert expected_emitted([2, 4, 0, 2], [1, 3, 1, 3], [[0.5, 0.5], [1.0, 1.0, 0.0, 0.0],
                                                       None, None],
                            [True, False, True, True]) == pytest.approx(1.75 + 3 + 1 + 3)
    assert expected_emitted([3], [4], None, [True]) == 4
    assert expected_emitted([], [], [], []) == 0.0


def test_the_step_arbiter_counts_a_sampled_steps_expected_tokens():
    """A sampled row's verified drafts count at their acceptance probabilities in the rate
    the arbiter measures (the verdict's luck averaged out); a greedy row's as emitted."""
    observed = {}
    for sampled in (True, False):
        union = _union(Fixed("p", [1, 2, 3], 0.9))
        union.arbiter = StepArbiter()
        seen = []
        union.arbiter.observe = lambda tokens, seconds: seen.append(tokens)
        drafts = union.step(_batch(["a"], sampled=sampled), None).drafts
        k = len(drafts[0])
        assert k >= 2, drafts
        verified = Verified(("a",), np.array([k]), np.array([1]), 0.012, 1 + k,
                            expected=[[0.5] * k])
        union.step(_batch(["a"], sampled=sampled), verified)
        observed[sampled] = seen[-1]
    assert observed[True] == pytest.approx(sum(0.5 ** j for j in range(k + 1)))
    assert observed[False] == 1


def test_union_never_drafts_what_is_always_rejected():
    union = _union(Fixed("ngram", [7, 7, 7], 0.9))
    verified, sent = None, 0
    for step in range(300):
        drafts = union.step(_batch(["a", "b"]), verified).drafts
        sent += sum(map(len, drafts)) if step >= 100 else 0
        verified = Verified(("a", "b"), np.array([len(d) for d in drafts]), np.ones(2, int),
                            0.012, 2 + sum(map(len, drafts)))
    assert sent == 0  # after learning: K = 0 for both
    assert union.stats.steps_without_drafts > 150


def test_a_failing_proposer_costs_its_candidates_only():
    union = _union(Fixed("broken", [1], 0.9, fail=True), Fixed("ok", [5, 6], 0.99))
    for _ in range(3):
        assert union.step(_batch(["a"]), None).drafts == [[5, 6]]
    assert union.failures[0].count == 3


def test_unverified_or_cut_drafts_are_not_learned_as_accepted():
    union = _union(Fixed("p", [1, 2, 3, 4], 0.9))
    union.step(_batch(["a"]), None)
    before = union.estimator.judged.sum()
    # the scheduler verified none of them (e.g. cut at max_model_len)
    union.step(_batch(["a"]), Verified(("a",), np.array([0]), np.array([1]), 0.01, 1))
    assert union.estimator.judged.sum() == pytest.approx(before * union.estimator.decay)
    # 4 sent, 2 scheduled, both accepted: 2 accepted tokens, not 4
    union.step(_batch(["a"]), Verified(("a",), np.array([2]), np.array([3]), 0.01, 3))
    assert union.stats.accepted_tokens["p"] == 2 and union.stats.draft_tokens["p"] == 2


def test_finished_requests_reach_every_proposer():
    p = Fixed("p", [1], 0.9)
    union = _union(p)
    union.step(_batch(["a"]), None)
    union.finish_requests(["a"])
    assert p.finished == ["a"] and union._pending == {}


def test_two_phase_begin_ask_then_choose_matches_one_step():
    """The draft path asks token-level proposers first, the draft model later: the union's
    two phases must choose what one step would."""
    good = Fixed("good", [1, 2, 3], 0.9)
    union = _union(good, Fixed("late", [4, 5], 0.9))
    batch = _batch(["a", "b"])
    assert union.begin(None, batch.num_reqs, sampled=False)
    offers = union.ask(batch, [0])
    plan = union.choose(batch, offers + union.ask(batch, [1]))
    assert plan.sources in ([0, 0], [1, 1])
    assert all(len(d) > 0 for d in plan.drafts)


def _teach(union, proposer, rate, num_tokens=400, sampled=False):
    """Evidence that ``proposer``'s tokens (at every position, signal 0.9) are accepted
    at ``rate``."""
    cells = union.estimator.cells(proposer, sampled, history_bucket(None),
                                  np.full(8, 0.9)) * (num_tokens // 8)
    union.estimator.update_cells(cells, np.random.default_rng(0).random(len(cells)) < rate)


def test_the_draft_plans_beside_a_row_with_no_candidate_at_all():
    """A row the draft may not draft for (its cap 0: a request in prefill, or at its
    max_tokens) and with no token-level candidate sits beside a row the draft runs for:
    the plan runs the draft for the one and nothing for the other (it had raised
    IndexError and cost the step its drafts; seen red without the skip of such rows)."""
    union = _union(Fixed("ngram", [1, 2, 3, 4], 0.9), Fixed("draft", [], 0.5))
    union._draft_trials = 0
    two = StepBatch(("a", "b"), np.zeros((2, 32), dtype=np.int32), np.full(2, 10),
                    np.full(2, 5), np.full(2, 8), np.zeros(2, bool), (0, 1))
    assert union.begin(None, 2, sampled=False)
    union.estimator.pooled_cells = lambda proposer, sampled, history, n, draw=False: [0.99] * n
    caps = union.plan_draft(two, [], 1, np.array([0, 8]), forward_seconds=0.0001)
    assert caps[0] == 0 and caps[1] > 0


def test_the_draft_runs_where_its_priced_forwards_pay():
    """Before any evidence the draft's tokens are coin flips: with cheap forwards the plan
    runs it for a few positions, not its whole cap; forwards that cost more than the
    tokens they may bring keep it off; a row with a candidate known to be good does not
    run it; a draft known to be good drafts further."""
    union = _union(Fixed("ngram", [1, 2, 3, 4, 5, 6, 7, 8], 0.9), Fixed("draft", [], 0.5))
    union._draft_trials = 0  # past its optimistic trials (see the next test)
    one = _batch(["a"])
    assert union.begin(None, 1, sampled=False)
    cold = np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001))
    assert 0 < cold[0] < 8
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.05))[0] == 0
    # the same cheap forwards behind a first pass that must first read a long prompt
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                            catch_up_seconds=[0.05]))[0] == 0
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                            catch_up_seconds=[0.0]))[0] > 0
    # ... or behind a first pass whose fixed part (timed: a cold draft) costs as much
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                                       catch_up_seconds=[0.0], run_seconds=0.05))[0] == 0
    # paid once, it serves the request's later steps: spread over the many a long
    # request has left it pays, over a short one's few it does not
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                            catch_up_seconds=[0.05], remaining_tokens=[2000]))[0] > 0
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                            catch_up_seconds=[0.05], remaining_tokens=[10]))[0] == 0
    # a cold first pass's excess over a warm one's is paid once too: the runs after it
    # are warm (without a warm price, or for a short request, it weighs whole)
    cold_run = dict(forward_seconds=0.001, catch_up_seconds=[0.0], run_seconds=0.05)
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), **cold_run,
                                       remaining_tokens=[2000]))[0] == 0
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), **cold_run,
                      warm_run_seconds=0.0005, remaining_tokens=[2000]))[0] > 0
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), **cold_run,
                      warm_run_seconds=0.0005, remaining_tokens=[10]))[0] == 0
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), **cold_run,
                      warm_run_seconds=0.0005))[0] == 0
    # ... but only for a row expected to keep drafting with it: one whose draft candidate
    # the plan also takes at the posterior means, not just on this step's draw
    explorer = _union(Fixed("ngram", [1], 0.9), Fixed("draft", [], 0.5), explore=True)
    explorer._draft_trials = 0
    assert explorer.begin(None, 1, sampled=False)
    explorer.estimator.pooled_cells = (
        lambda proposer, sampled, history, n, draw=False: [0.99 if draw else 0.05] * n)
    assert np.asarray(explorer.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                                          catch_up_seconds=[0.0]))[0] > 0  # the draw pays
    assert np.asarray(explorer.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                      catch_up_seconds=[0.2], remaining_tokens=[2000]))[0] == 0
    explorer.estimator.pooled_cells = lambda proposer, sampled, history, n, draw=False: [0.99] * n
    assert np.asarray(explorer.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                      catch_up_seconds=[0.2], remaining_tokens=[2000]))[0] > 0
    assert np.asarray(union.plan_draft(one, [], 1, np.array([0]), forward_seconds=0.0))[0] == 0
    _teach(union, 0, 0.95)
    two = StepBatch(("a", "b"), np.zeros((2, 32), dtype=np.int32), np.full(2, 10),
                    np.full(2, 5), np.full(2, 8), np.zeros(2, bool), (0,))
    union.cost = flat_cost()  # verifying is cheap: row 1 gains from the draft, row 0 cannot
    offers = union.ask(two, [0])  # row 0 only has an n-gram candidate
    k = np.asarray(union.plan_draft(two, offers, 1, np.array([8, 8]), forward_seconds=0.0002))
    assert k[0] == 0 and k[1] > 0
    union.cost = _union().cost
    _teach(union, 1, 0.95)
    assert np.asarray(union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001))[0] > cold[0]


def test_the_forwards_price_decides_whether_the_draft_runs_not_how_far():
    """Where the draft pays its forwards, each row may draft as far as the plan would
    verify its tokens; dearer forwards do not cut the run short before it starts (its stop
    rule cuts it, with the draft's confidence at each position, which the plan lacks);
    forwards dearer than anything the draft may bring keep it off."""
    lengths = {}
    for forward_seconds in (0.0005, 0.004, 0.05):
        union = _union(Fixed("ngram", [], 0.9), Fixed("draft", [], 0.5))
        union._draft_trials = 0  # past its optimistic trials
        _teach(union, 1, 0.9)
        assert union.begin(None, 1, sampled=False)
        lengths[forward_seconds] = int(np.asarray(union.plan_draft(
            _batch(["a"]), [], 1, np.array([8]), forward_seconds=forward_seconds))[0])
    assert lengths[0.0005] >= 4
    assert lengths[0.004] == lengths[0.0005]
    assert lengths[0.05] == 0


def test_the_arbiters_prediction_prices_the_draft_forwards_that_ran():
    """The step arbiter corrects the union's predicted rate by what speculative steps
    measure, every draft forward that ran included: the prediction prices the forwards
    the run made (its stop rule's count), not the number the plan priced before it ran."""

    class Recording(StepArbiter):
        def speculate(self, num_reqs, sampled=False):
            return True

        def predicted(self, tokens, seconds, *shape):
            self.rate = tokens / seconds

    def predicted_rate(forwards):
        union = _union(Fixed("ngram", [], 0.9), Fixed("draft", [1, 2, 3, 4, 5, 6, 7, 8], 0.9))
        union._draft_trials = 0  # past its optimistic trials
        _teach(union, 1, 0.9)
        union.arbiter = Recording()
        one = _batch(["a"])
        assert union.begin(None, 1, sampled=False)
        assert union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.004)[0] > 0
        union.choose(one, union.ask(one, [1]), draft_forwards=forwards)
        return union.arbiter.rate, union._draft_price[2]

    rates = {f: predicted_rate(f)[0] for f in (0, 2, 6)}
    at_plan, planned = predicted_rate(None)
    assert 0 < planned < 6  # the plan priced fewer forwards than this run makes
    assert at_plan == pytest.approx(predicted_rate(planned)[0])
    assert rates[0] > rates[2] > rates[6]
    # the same expected tokens E over seconds that grow by one forward's price a forward
    # (and the run's fixed part, 0 here): E/r6 - E/r2 = 2 (E/r2 - E/r0)
    assert 1 / rates[6] - 1 / rates[2] == pytest.approx(2 * (1 / rates[2] - 1 / rates[0]))


def test_a_cold_draft_runs_in_some_steps_for_every_row_though_its_prior_does_not_pay():
    """One draft forward serves every row, so whether it runs is decided on one draw
    from its posterior shared by the rows: with forwards priced so that a coin-flip
    draft does not pay on average, a cold draft still runs in some steps (and then for
    every row alike), where the posterior mean would never run it nor learn its worth."""
    rows = [f"r{j}" for j in range(8)]
    runs = {}
    for explore in (False, True):
        union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5), explore=explore)
        union._draft_trials = 0  # past its optimistic trials
        runs[explore] = []
        for _ in range(200):  # each step a new draw (a cold estimator updates every step)
            assert union.begin(None, 8, sampled=False)
            runs[explore].append(np.asarray(union.plan_draft(_batch(rows), [], 1, np.full(8, 8),
                                                  forward_seconds=0.002)))
    assert not any(k.any() for k in runs[False])
    drafted = [k for k in runs[True] if k.any()]
    assert len(drafted) > 20, len(drafted)
    assert all((k == k[0]).all() for k in drafted)  # all rows or none


def test_an_untried_draft_runs_in_its_first_steps_where_it_could_pay_at_all():
    """Its worth is learnt only by running it: a fresh union runs the draft model on an
    optimistic estimate (every token accepted) in its first DRAFT_TRIALS gated steps,
    then on its posterior (a coin flip that does not pay at this price: off); never
    where even a perfect draft would not pay; and not once its tokens were judged."""
    from specplugin.adaptive.union import DRAFT_TRIALS

    rows = [f"r{j}" for j in range(8)]
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    assert union.begin(None, 8, sampled=False)
    assert not np.asarray(union.plan_draft(_batch(rows), [], 1, np.full(8, 8), forward_seconds=0.5)).any()
    runs = [np.asarray(union.plan_draft(_batch(rows), [], 1, np.full(8, 8), forward_seconds=0.002))
            for _ in range(3 * DRAFT_TRIALS)]
    assert [k.any() for k in runs] == [True] * DRAFT_TRIALS + [False] * (2 * DRAFT_TRIALS)
    # (for the DRAFT_TRIAL_ROWS rows whose first pass reads least: here the first ones)
    assert all((k[:DRAFT_TRIAL_ROWS] > 0).all() and not k[DRAFT_TRIAL_ROWS:].any()
               for k in runs[:DRAFT_TRIALS])
    taught = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    _teach(taught, 1, 0.5, num_tokens=16)
    assert taught.begin(None, 8, sampled=False)
    assert not np.asarray(taught.plan_draft(_batch(rows), [], 1, np.full(8, 8), forward_seconds=0.002)).any()


def test_a_trial_of_the_draft_runs_it_for_the_rows_that_read_least():
    """An untried draft's optimistic trial is for DRAFT_TRIAL_ROWS rows, those whose
    first pass reads least; the other rows are planned on the posterior (here: tokens
    that do not pay), so a trial at batch 16 does not read 16 prompts."""
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    union.estimator.pooled_cells = lambda proposer, sampled, history, n, draw=False: [0.01] * n
    batch = _batch([f"r{i}" for i in range(16)])
    assert union.begin(None, 16, sampled=False)
    catch_up = [0.001 * (16 - r) for r in range(16)]  # the last rows read least
    k = np.asarray(union.plan_draft(batch, [], 1, np.full(16, 8), forward_seconds=0.0002,
                                    catch_up_seconds=catch_up, remaining_tokens=[100] * 16))
    assert sorted(np.flatnonzero(k).tolist()) == [16 - n for n in range(DRAFT_TRIAL_ROWS, 0, -1)]
    assert union._draft_trials == DRAFT_TRIALS - 1


def test_a_draft_trials_step_is_not_a_rate_the_step_arbiter_weighs():
    """A step that ran one of the draft's optimistic trials is the price of learning its
    worth, once per engine: its time is not in the speculative block's rate (it made a
    fresh engine's first blocks look slower than plain decoding); the steps after are."""
    arbiter = StepArbiter()
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    union.arbiter = arbiter
    assert union.begin(None, 1, sampled=False)
    assert np.asarray(union.plan_draft(_batch(["a"]), [], 1, np.array([8]),
                                       forward_seconds=0.002)).any()  # a trial
    assert union.begin(Verified(("a",), [8], [9], 0.05, 9), 1, sampled=False)
    assert arbiter._seconds == 0.0 and arbiter._steps == 1
    union.begin(Verified(("a",), [0], [1], 0.01, 1), 1, sampled=False)
    assert arbiter._seconds == pytest.approx(0.01)


def test_a_draft_runs_catch_up_right_after_plain_steps_is_not_a_rate_the_arbiter_weighs():
    """The draft run of a step that speculates right after plain steps first reads every
    token decoded plainly: the price of switching, paid once per switch, not the rate of
    speculating, so that step's time is not in the block's rate; a catch-up with no plain
    step before it (a skipped row's), and the steps after, are."""
    arbiter = StepArbiter()
    decisions = iter([False, True, True, True])
    arbiter.speculate = lambda num_reqs, sampled=False: next(decisions)
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    union.arbiter = arbiter
    union._draft_trials = 0  # past its optimistic trials
    _teach(union, 1, 0.95)  # a draft known to be good: it runs, catch-up and all
    one = _batch(["a"])

    def run_draft():
        k = union.plan_draft(one, [], 1, np.array([8]), forward_seconds=0.001,
                             catch_up_seconds=[0.004], remaining_tokens=[2000])
        assert k[0] > 0
        return k[0]

    assert not union.plain_step(0.01, 1, 1, sampled=False)  # a plain step
    assert union.plain_step(0.01, 1, 1, sampled=False)  # then one that speculates
    assert union.begin(None, 1, sampled=False)
    k = run_draft()  # right after the plain step: catches up on it
    counted = arbiter._seconds
    assert union.begin(Verified(("a",), [k], [k + 1], 0.05, k + 1), 1, sampled=False)
    assert arbiter._seconds == counted  # the switch's step: not counted
    k = run_draft()  # behind again (a skipped row), but no plain step before it
    assert union.begin(Verified(("a",), [k], [k + 1], 0.03, k + 1), 1, sampled=False)
    assert arbiter._seconds == pytest.approx(counted + 0.03)


def test_draft_always_runs_the_draft_wherever_a_row_could_use_it():
    """fault_injection.draft_always (the profile's tests): the draft runs in every
    speculative step for every row that may use it, however much evidence or price says
    it does not pay (a short test must see draft forwards); rows with no room still not."""
    rows = [f"r{j}" for j in range(8)]
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    union.draft_always = True
    _teach(union, 1, 0.05, num_tokens=16)
    assert union.begin(None, 8, sampled=False)
    caps = np.array([8, 8, 0, 3, 8, 8, 8, 8])
    for forward_seconds in (0.002, 0.5):
        assert union.plan_draft(_batch(rows), [], 1, caps, forward_seconds) == caps.tolist()
    union.draft_always = False  # priced, such a draft does not run
    assert not any(union.plan_draft(_batch(rows), [], 1, caps, forward_seconds=0.5))


def test_the_choice_weighs_the_gates_estimates_of_token_level_candidates():
    """One posterior draw per step: plan_draft (the draft's gate) estimated the token-level
    candidates, one row's drawn from the posterior; the choice weighs those same numbers
    (the same explorer row, the same draws) and the draft model's candidates, whose
    signals it did not know before, at their posterior means. A new step draws anew."""
    union = _union(Fixed("ngram", [1, 2, 3], 0.5), Fixed("draft", [4, 5], 0.5), explore=True)
    _teach(union, 0, 0.6, num_tokens=6)  # a little evidence: draws differ from the means
    batch = _batch(["r0", "r1"])
    estimates, plans = [], []
    estimate, plan_of = union._estimate, union._plan
    union._estimate = lambda *a, **kw: estimates.append(estimate(*a, **kw)) or estimates[-1]
    union._plan = lambda *a, **kw: plans.append(plan_of(*a, **kw)) or plans[-1]
    draws = []
    for _ in range(2):
        assert union.begin(None, 2, sampled=False)
        offers = union.ask(batch, [0])
        union.plan_draft(batch, offers, 1, np.full(2, 8), forward_seconds=0.0)
        gate = [row[0] for row in plans[-1].acceptance(plans[-1].values())]  # [row] ngram's
        explorer = union._step_explorer
        assert explorer in (0, 1) and len(plans) == 1 + 2 * len(draws)
        union.choose(batch, offers + union.ask(batch, [1]))
        chosen = plans[-1].acceptance()
        for r in range(2):
            assert chosen[r][0].tolist() == gate[r]  # the gate's, draw or mean
            mean = union.estimator.values(
                union.estimator.cells(1, False, union._histories(batch)[r], [0.5, 0.5]))
            assert chosen[r][1].tolist() == mean  # the draft's: its mean, explorer or not
        means = union._estimate(offers, batch, union._histories(batch), explorer=-1)
        assert gate[explorer] != means[explorer] and gate[1 - explorer] == means[1 - explorer]
        assert len(estimates) == len(draws) + 1  # (only the line above asked _estimate)
        draws.append(gate[explorer])
        union.flush_learning()  # the counts change: new draws
    assert draws[0] != draws[1]


def test_the_cost_model_learns_held_steps_as_it_would_have_learned_each():
    """Past its warm-up the cost model holds speculative steps and learns them four at a
    time: after a flush (or a plain step, which flushes first) it is the model that
    learned each step as it came, bit for bit; before, at most three steps late."""
    rng = np.random.default_rng(0)
    steps = [(int(rng.integers(1, 40)), float(rng.uniform(0.004, 0.02)), bool(rng.random() < 0.7))
             for _ in range(200)]
    held, each = (StepCostModel(max_tokens=64, warmup=4) for _ in range(2))
    for cost in (held, each):
        cost.calibrate(np.array([1, 8, 64]), np.array([0.004, 0.005, 0.012]))
    for j, (n, seconds, speculative) in enumerate(steps):
        if j % 9 == 8:  # now and then a plain step: learned after the held ones
            held.observe_plain(n, seconds)
            each.observe_plain(n, seconds)
            continue
        held.observe(n, seconds, speculative)
        each.observe(n, seconds, speculative)
        each.flush()
        assert len(held._held) < 4
    held.flush()
    assert held._f == each._f and held.overhead_s == each.overhead_s
    assert held.spec_overhead_s == each.spec_overhead_s > 0
    assert held.step_times(1, 40) == each.step_times(1, 40)


def test_the_forward_table_follows_the_knots_after_held_steps():
    """The table of F(n) that step_times reads is brought up to date once per flush of
    held steps (not once per step): wherever the steps moved the knots, over many
    flushes and shapes (below the first knot, between knots, past the last), it is the
    curve the knots give."""
    rng = np.random.default_rng(1)
    cost = StepCostModel(max_tokens=64, warmup=4)
    cost.calibrate(np.array([1, 8, 64]), np.array([0.004, 0.005, 0.012]))
    for j in range(400):
        n = int(rng.choice([1, 2, 3, 5, 7, 9, 15, 20, 33, 50, 63, 64, 70]))
        if j % 11 == 10:
            cost.observe_plain(n, float(rng.uniform(0.004, 0.02)))
        else:
            cost.observe(n, float(rng.uniform(0.004, 0.02)), bool(rng.random() < 0.7))
        table = cost.step_times(0, 80)  # (read every step, as the controller does)
        if not cost._held:
            expected = [cost.overhead_s + cost.forward_one(m) for m in range(80)]
            assert np.allclose(table, expected, rtol=1e-12, atol=0.0), j


def test_a_step_the_draft_skips_is_planned_once(monkeypatch):
    """When the draft's gate plans the draft model out for every row, the choice weighs
    exactly the candidates, estimates and costs the gate's plan without it did: that plan
    is the choice, not computed a second time; with the draft's candidates in, it is."""
    from specplugin.adaptive import kernels

    calls = []
    real = kernels.plan_offers
    monkeypatch.setattr(kernels, "plan_offers", lambda *a: calls.append(1) or real(*a))
    union = _union(Fixed("ngram", [1, 2, 3], 0.9), Fixed("draft", [4, 5], 0.9), explore=False)
    batch = _batch(["r0", "r1"])
    assert union.begin(None, 2, sampled=False)
    offers = union.ask(batch, [0])
    assert not any(union.plan_draft(batch, offers, 1, np.full(2, 8), forward_seconds=10.0))
    assert len(calls) == 1
    drafts = union.choose(batch, list(offers)).drafts  # the draft did not run: nothing new
    assert len(calls) == 1 and all(drafts)
    union._gate_plan = None  # planned afresh, the choice is the same
    assert union.choose(batch, list(offers)).drafts == drafts and len(calls) == 2
    assert union.begin(None, 2, sampled=False)
    offers = union.ask(batch, [0])
    union.plan_draft(batch, offers, 1, np.full(2, 8), forward_seconds=10.0)
    union.choose(batch, offers + union.ask(batch, [1]))  # the draft's candidates too
    assert len(calls) == 4


def test_the_draft_models_time_is_kept_out_of_the_target_step_cost():
    """A step's wall time holds the draft model's forwards, which plan_draft prices on
    their own: the cost model learns the step without them (else a plain step would
    look dearer after every draft run, and drafts be paid for twice); the arbiter gets
    the whole step."""
    def fed(seconds, draft_seconds):
        union = _union(Fixed("p", [1, 2], 0.9))
        for _ in range(10):  # plain steps first: the machinery's part is then known
            union.cost.observe(3, 0.012, speculative=False)
        for _ in range(50):
            union.begin(Verified(("a",), np.array([2]), np.array([3]), seconds, 3,
                                 draft_seconds=draft_seconds), 1, sampled=False)
        # what a speculative step of 3 tokens is priced at
        return float(union.cost.step_seconds(np.array([3]))[0]) + union.cost.spec_overhead_s

    assert fed(0.020, 0.008) == pytest.approx(fed(0.012, 0.0))
    assert fed(0.020, 0.0) > fed(0.012, 0.0) + 0.004


def test_the_speculative_machinery_is_charged_once_per_step():
    # 1 ms per token, 10 ms per step; drafting at all costs 4 ms more: one 0.3 token
    # does not pay for it, but a long confident draft does
    step = linear(0.010, 0.001)
    assert plan([[np.array([0.3])]], step, spec_overhead=0.004)[0] == Choice(NO_CANDIDATE, 0)
    assert plan([[np.array([0.3])]], step)[0] == Choice(0, 1)
    assert plan([[np.full(6, 0.95)]], step, spec_overhead=0.004)[0] == Choice(0, 6)


def test_cost_model_learns_the_speculative_overhead_from_the_two_kinds_of_steps():
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.005, 0.068]))
    assert cost.spec_overhead_s == 0.0
    for _ in range(300):
        cost.observe(8, 0.012 + 0.001, speculative=False)  # 8 tokens: F = 12 ms, +1 ms
        cost.observe(8, 0.012 + 0.004, speculative=True)  # +3 ms more when verifying
    assert cost.spec_overhead_s == pytest.approx(0.003, rel=0.1)


def test_a_fresh_cost_model_prices_the_speculative_machinery_within_a_few_steps():
    """A fresh engine's first steps must already pay for the machinery: an average
    started at 0 and moved 5% a step would say 40% of it after ten steps of each kind
    (measured in an engine: speculative steps at batch 8, temperature 1 cost ~8.5 ms
    against ~6 predicted, and lost to plain decoding for a whole cell)."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.005, 0.068]))
    for _ in range(10):
        cost.observe(8, 0.012 + 0.001, speculative=False)
        cost.observe(8, 0.012 + 0.004, speculative=True)
    assert cost.spec_overhead_s == pytest.approx(0.003, rel=0.1)


def test_speculative_steps_do_not_price_a_plain_step_before_the_machinery_is_known():
    """Before both kinds of steps were seen ``warmup`` times, a speculative step's
    residual (mostly the machinery's) must not become the fixed part of every step: a
    fresh engine that speculates every step would judge plain decoding by it."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.005, 0.068]))
    plain = cost.step_one(1)
    for _ in range(50):
        cost.observe(8, 0.012 + 0.004, speculative=True)
    assert cost.step_one(1) == pytest.approx(plain)


def test_a_fresh_engine_that_speculates_from_its_first_step_prices_its_speculative_steps():
    """Before any plain step, a speculative step must cost what speculative steps
    measured, not the target's forward alone (measured with no warm-up on the validation
    pair, server/b8/t1: first speculative steps of 13-16 ms predicted at 6.2), while a
    plain step keeps its own price; the engine's first speculative step (it compiles)
    is left out."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 8, 16]), np.array([0.005, 0.0055, 0.006]))
    plain = cost.step_one(8)
    cost.observe(12, 0.5, speculative=True)  # the first: compiles
    for _ in range(3):
        cost.observe(12, 0.014, speculative=True)
    assert cost.step_one(12) + cost.spec_overhead_s == pytest.approx(0.014, rel=0.02)
    assert cost.step_one(8) == pytest.approx(plain)
    for _ in range(3):  # then plain steps: the machinery is what speculative steps add
        for _ in range(8):
            cost.observe_plain(8, 0.009)
        cost.observe(12, 0.014, speculative=True)
    assert cost.step_one(8) == pytest.approx(0.009, rel=0.05)
    assert cost.step_one(12) + cost.spec_overhead_s == pytest.approx(0.014, rel=0.05)


def test_one_pathological_speculative_step_cannot_switch_speculation_off():
    """The first steps with drafts may compile new shapes (seconds): clipped, and the
    average is not trusted before both kinds of steps were seen often enough."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.005, 0.068]))
    cost.observe(8, 1.5, speculative=True)  # a compile
    assert cost.spec_overhead_s == 0.0
    for _ in range(100):
        cost.observe(8, 0.013, speculative=False)
        cost.observe(8, 0.014, speculative=True)
    assert cost.spec_overhead_s < 0.003


# ------------------------------------------------------------------ step arbiter


def _arbitrate(arbiter, steps, spec_rate, plain_rate, num_reqs=16, rng=None):
    """Run ``steps`` engine steps whose tokens per second depend on the arbiter's choice
    (with 10% noise); returns the choices."""
    rng = rng or np.random.default_rng(0)
    choices = []
    for _ in range(steps):
        choice = arbiter.speculate(num_reqs)
        rate = (spec_rate if choice else plain_rate) * rng.uniform(0.9, 1.1)
        arbiter.observe(num_reqs, num_reqs / rate)
        choices.append(choice)
    return np.array(choices)


def test_arbiter_decodes_plainly_where_speculation_measures_slower():
    arbiter = StepArbiter()
    choices = _arbitrate(arbiter, 2000, spec_rate=600.0, plain_rate=1000.0)
    late = choices[400:]
    assert late.mean() < 0.05  # nearly every step plain...
    assert late.any()  # ...but speculation is measured again now and then
    assert arbiter.rate(16, True) == pytest.approx(600, rel=0.1)
    assert arbiter.rate(16, False) == pytest.approx(1000, rel=0.1)


def test_plain_blocks_where_plain_leads_are_long_and_speculation_is_rechecked_as_often():
    """Past the warm-up, a plain block that runs because plain decoding leads is
    PLAIN_BLOCK_FACTOR blocks long (half as many decided steps, see "Long plain blocks"),
    and speculation is re-measured after as many steps as with short blocks; a plain
    re-check while speculation leads stays one block long."""
    def runs(choices):  # lengths of the runs of plain steps
        out, n = [], 0
        for c in choices:
            if not c:
                n += 1
            elif n:
                out.append(n)
                n = 0
        return out

    slow = StepArbiter()
    choices = _arbitrate(slow, 1200, spec_rate=600.0, plain_rate=1000.0)
    plain_runs = runs(choices[200:])[1:]  # (the first run started before step 200)
    assert plain_runs and all(n % (PLAIN_BLOCK_FACTOR * slow.block_steps) == 0
                              for n in plain_runs)
    short = StepArbiter()
    with patch("specplugin.adaptive.arbiter.PLAIN_BLOCK_FACTOR", 1):
        short_choices = _arbitrate(short, 1200, spec_rate=600.0, plain_rate=1000.0)
    # the same share of steps re-measures speculation (within one block's worth)
    assert abs(choices[200:].sum() - short_choices[200:].sum()) <= short.block_steps
    # the first step of a long plain block foretells the block's steps left
    while not slow.speculate(16):  # to a re-check of speculation...
        slow.observe(16, 16 / 1000.0)
    while slow.speculate(16):  # ...and past it
        slow.observe(16, 16 / 600.0)
    assert slow.plain_steps_ahead() == PLAIN_BLOCK_FACTOR * slow.block_steps - 1

    fast = StepArbiter()  # speculation leads: plain is re-measured one block at a time
    fast_runs = runs(_arbitrate(fast, 1200, spec_rate=1000.0, plain_rate=600.0)[200:])[1:]
    assert fast_runs and max(fast_runs) == fast.block_steps


def test_new_text_sends_a_plain_batch_back_to_speculating_at_once():
    """Plain decoding led on text nothing guessed; a new request's text copies. At batch
    1 the whole batch is new: the arbiter re-checks speculation at once, not after the
    ~32 blocks its gap asks for, and keeps speculating while the new text pays."""
    arbiter = StepArbiter()
    _arbitrate(arbiter, 400, spec_rate=60.0, plain_rate=100.0, num_reqs=1)
    while not arbiter.speculate(1):  # to the end of a re-check of speculation
        arbiter.observe(1, 1 / 100.0)
    while arbiter.speculate(1):
        arbiter.observe(1, 1 / 60.0)
    arbiter.observe(1, 1 / 100.0)
    arbiter.new_requests(1, 1)
    arbiter.observe(1, None)  # the step that read the new prompt: its time not counted
    choices = _arbitrate(arbiter, 60, spec_rate=250.0, plain_rate=100.0, num_reqs=1)
    first = int(np.argmax(choices))
    assert choices.any() and first == 0
    assert choices[first:].mean() > 0.9  # then it stays (a block may re-check plain)
    assert arbiter.rate(1, True) == pytest.approx(250, rel=0.1)


def test_a_recheck_of_speculation_that_plans_nothing_ends_at_once():
    """Plain decoding leads; the block that re-checks speculation plans no draft for any
    row (nothing offered paid): it ends at that step, unmeasured, and plain decoding
    resumes with the next step, instead of paying the union's asking for a whole block.
    While speculation leads, a step without drafts is part of speculating."""
    slow = StepArbiter()
    _arbitrate(slow, 400, spec_rate=600.0, plain_rate=1000.0)
    while not slow.speculate(16):  # to the first step of a re-check of speculation
        slow.observe(16, 16 / 1000.0)
    rate = slow.rate(16, True)
    assert slow.nothing_to_verify()
    slow.observe(16, 16 / 900.0)  # that step, which verified nothing, ran
    assert not slow.speculate(16)
    assert slow.plain_steps_ahead() == PLAIN_BLOCK_FACTOR * slow.block_steps - 2
    assert slow.rate(16, True) == rate  # nothing measured
    # ... and speculation is re-checked again after as many blocks as before
    steps = 0
    while not slow.speculate(16):
        slow.observe(16, 16 / 1000.0)
        steps += 1
    assert steps > 4 * PLAIN_BLOCK_FACTOR * slow.block_steps

    fast = StepArbiter()
    _arbitrate(fast, 400, spec_rate=1000.0, plain_rate=600.0)
    while not fast.speculate(16):
        fast.observe(16, 16 / 600.0)
    assert not fast.nothing_to_verify() and fast.speculate(16)
    fresh = StepArbiter()  # a bucket's warm-up measures speculation as it comes
    assert fresh.speculate(16) and not fresh.nothing_to_verify()


def test_the_union_ends_a_recheck_whose_plan_verifies_nothing():
    class Leading(StepArbiter):
        ended = 0

        def speculate(self, num_reqs, sampled=False):
            return True

        def nothing_to_verify(self):
            Leading.ended += 1
            return True

    union = _union(Fixed("p", [], 0.9))  # offers no token
    union.arbiter = Leading()
    assert union.step(_batch(["a", "b"]), None).drafts == [[], []]
    assert Leading.ended == 1
    union = _union(Fixed("p", [1, 2], 0.9))
    union.arbiter = Leading()
    assert union.step(_batch(["a", "b"]), None).drafts == [[1, 2], [1, 2]]
    assert Leading.ended == 1


def test_one_cold_block_of_a_new_request_does_not_end_speculation():
    """Speculation ran at 3x plain on the last request; the next request's first block
    is slow (nothing of its own to copy yet): that one block must not send the rest of
    the request to plain decoding."""
    arbiter = StepArbiter()
    _arbitrate(arbiter, 200, spec_rate=300.0, plain_rate=100.0, num_reqs=1)
    assert arbiter.speculate(1)  # a block starts; the new request arrives in its first step
    arbiter.new_requests(1, 1)
    arbiter.observe(1, None)  # the step that read the new prompt
    for _ in range(arbiter.block_steps - 1):  # the rest of the block: cold
        assert arbiter.speculate(1)
        arbiter.observe(1, 1 / 60.0)
    choices = _arbitrate(arbiter, 100, spec_rate=300.0, plain_rate=100.0, num_reqs=1)
    assert choices.mean() > 0.9


def test_a_block_runs_until_its_steps_were_counted():
    """Steps the rate does not hold (a trial of the draft, the step that read a prompt)
    do not fill a block: one counted step must not set a bucket's rate; a block of
    uncounted steps still ends, after MAX_BLOCK_FACTOR times its length."""
    from specplugin.adaptive.arbiter import ENGINE_WARMUP_BLOCKS, MAX_BLOCK_FACTOR

    arbiter = StepArbiter()
    _arbitrate(arbiter, ENGINE_WARMUP_BLOCKS * arbiter.block_steps, 100.0, 100.0, num_reqs=1)
    # the bucket's first measured block: a slow counted step, two uncounted ones, then
    # counted steps at 300 tok/s (1 token each)
    for seconds in [1 / 50.0, None, None] + [1 / 300.0] * (arbiter.block_steps - 1):
        assert arbiter.speculate(1) and arbiter.rate(1, True) is None
        arbiter.observe(1, seconds)
    arbiter.speculate(1)  # the block, now done, closes
    counted = 1 / 50.0 + (arbiter.block_steps - 1) / 300.0
    assert arbiter.rate(1, True) == pytest.approx(arbiter.block_steps / counted)

    capped = StepArbiter()
    _arbitrate(capped, ENGINE_WARMUP_BLOCKS * capped.block_steps, 100.0, 100.0, num_reqs=1)
    capped.speculate(1)  # closes the engine's second warm-up block, starts the next
    started = capped.num_spec_blocks
    for _ in range(MAX_BLOCK_FACTOR * capped.block_steps):
        assert capped.speculate(1) and capped.num_spec_blocks == started
        capped.observe(1, None)
    capped.speculate(1)
    assert capped.num_spec_blocks == started + 1  # it ended all the same


def test_speculation_judged_slower_on_its_first_blocks_is_measured_again_soon():
    """Speculation's rate is the text's: two slow blocks at a request's start (nothing to
    copy yet) send the bucket to plain decoding, but speculation is tried again within
    min_interval blocks per block it was measured on, not after the gap's long interval;
    once it measures faster it takes over."""
    arbiter = StepArbiter()
    start = _arbitrate(arbiter, 24, spec_rate=250.0, plain_rate=600.0, num_reqs=1)
    # the engine's first 2 speculative blocks (unmeasured), the bucket's warm-up 2 + 2
    assert start[:16].all() and not start[16:].any()
    later = _arbitrate(arbiter, 200, spec_rate=1500.0, plain_rate=600.0, num_reqs=1)
    first_retry = int(np.argmax(later))
    assert later.any() and first_retry <= 4 * arbiter.min_interval * 2
    assert later[first_retry + 40:].mean() > 0.8


def test_a_plain_rate_the_cost_model_predicts_spares_the_plain_warm_up():
    """Speculation measures twice the modelled plain rate: no plain block runs to prove
    it; at 1.1x the model is not trusted and plain blocks are measured."""
    arbiter = StepArbiter()
    arbiter.plain_rate_model = lambda num_reqs: 100.0 * num_reqs
    assert _arbitrate(arbiter, 200, spec_rate=200.0, plain_rate=100.0, num_reqs=1)[:100].all()
    close = StepArbiter()
    close.plain_rate_model = lambda num_reqs: 100.0 * num_reqs
    assert not _arbitrate(close, 200, spec_rate=110.0, plain_rate=100.0, num_reqs=1).all()


def test_a_new_batch_size_starts_from_its_neighbours_verdict():
    """Requests finish and the batch moves from 8 to 5 to 3: the new buckets start from
    the nearest bucket measured with both choices (rates scaled by the modelled plain
    rate), not from a warm-up that speculates first; a bucket of the other mode (sampled
    here) learns on its own; the loser is still measured again later. Where the neighbour
    found speculation faster, a new bucket speculates without plain warm-up blocks."""
    arbiter = StepArbiter()
    arbiter.plain_rate_model = lambda num_reqs: 100.0 * num_reqs
    _arbitrate(arbiter, 200, spec_rate=600.0, plain_rate=1000.0, num_reqs=8)
    for num_reqs in (5, 3):
        choices = _arbitrate(arbiter, 60, spec_rate=75.0 * num_reqs,
                             plain_rate=125.0 * num_reqs, num_reqs=num_reqs)
        assert not choices[:arbiter.block_steps * arbiter.min_interval].any()  # plain at once
        assert choices.any()  # speculation re-checked
        assert arbiter.rate(num_reqs, SPECULATE) == pytest.approx(75.0 * num_reqs, rel=0.15)
    assert arbiter.num_seeded_buckets == 2
    sampled = arbiter.speculate(5, sampled=True)
    assert sampled and arbiter.num_seeded_buckets == 2  # its own warm-up: speculation first
    fast = StepArbiter()
    fast.plain_rate_model = lambda num_reqs: 125.0 * num_reqs
    _arbitrate(fast, 200, spec_rate=1100.0, plain_rate=1000.0, num_reqs=8)
    choices = _arbitrate(fast, 40, spec_rate=137.5 * 6, plain_rate=125.0 * 6, num_reqs=6)
    assert choices[:6 * fast.block_steps].all() and fast.num_seeded_buckets == 1


def test_new_text_retries_speculation_at_most_once_per_min_interval():
    """A server whose requests keep arriving on text nothing guesses must not speculate
    at every arrival."""
    arbiter = StepArbiter()
    _arbitrate(arbiter, 400, spec_rate=600.0, plain_rate=1000.0, num_reqs=16)
    before = arbiter.num_spec_blocks
    for _ in range(100):  # a new request every 4 steps: the batch is new every 64
        arbiter.new_requests(1, 16)  # (its step is not counted: blocks run 5 steps)
        _arbitrate(arbiter, 4, spec_rate=600.0, plain_rate=1000.0, num_reqs=16)
    # one speculative block per min_interval + 1 blocks (of at least 4 steps) at most
    assert arbiter.num_spec_blocks - before <= 400 / (4 * (arbiter.min_interval + 1)) + 1


class _AlwaysPlain(StepArbiter):
    """The arbiter's measured rates say plain; records whether the union overruled it."""

    def __init__(self, pays=True):
        super().__init__()
        self.overruled, self.pays = 0, pays

    def speculate(self, num_reqs, sampled=False):
        return False

    def pays_now(self, num_reqs, predicted_rate, sampled=False):
        return self.pays

    def speculate_now(self, num_reqs, sampled=False):
        self.overruled += 1


def _peek(context):
    tokens = np.zeros((1, 64), dtype=np.int64)
    tokens[0, :len(context)] = context
    return lambda: StepBatch(("a",), tokens, np.array([len(context)]), np.array([2]),
                             np.array([8]), np.array([False]), (0,))


def test_a_plain_step_speculates_when_the_ngram_peek_sees_text_that_copies():
    """Plain decoding leads on the arbiter's rates, but the context now repeats itself:
    the n-gram proposer, asked on the plain step, finds a copy the controller would
    verify, so the next step speculates and the arbiter starts a speculative block."""
    from specplugin.proposers.ngram import NgramProposer

    union = _union(NgramProposer(), Fixed("draft", [], 0.5))
    union.arbiter = _AlwaysPlain()
    union.max_peek_gap = 1  # a peek on every plain step (the gap has its own test)
    fresh = [7, 3, 9, 1, 4, 8, 2, 6, 5, 11, 13]
    assert not union.plain_step(0.01, 1, 1, False, peek=_peek(fresh))
    copies = [7, 3, 9, 1, 4, 8, 2, 6, 5, 7, 3, 9, 1]
    assert union.plain_step(0.01, 1, 1, False, peek=_peek(copies))
    assert union.arbiter.overruled == 1 and union.stats.steps_peeked == 1
    union.arbiter.pays = False  # the measured plain rate beats the corrected prediction
    assert not union.plain_step(0.01, 1, 1, False, peek=_peek(copies))
    no_ngram = _union(Fixed("draft", [], 0.5))
    no_ngram.max_peek_gap = 1
    no_ngram.arbiter = _AlwaysPlain()
    assert not no_ngram.plain_step(0.01, 1, 1, False, peek=_peek(copies))


def test_a_union_without_ngram_peeks_with_its_suffix_proposer():
    """Without an n-gram proposer the peek asks the suffix proposer (the cheapest
    token-level one left): a union of suffix alone whose arbiter went plain speculates
    again once the context copies itself."""
    from specplugin.proposers.suffix import SuffixProposer

    for index in ("python", "auto"):  # (auto: arctic's C++ index where it is installed)
        union = _union(SuffixProposer(index=index), Fixed("draft", [], 0.5))
        union.arbiter = _AlwaysPlain()
        union.max_peek_gap = 1
        assert not union.plain_step(0.01, 1, 1, False, peek=_peek([7, 3, 9, 1, 4, 8, 2, 6]))
        assert union.plain_step(0.01, 1, 1, False,
                                peek=_peek([7, 3, 9, 1, 4, 8, 2, 6, 5, 7, 3, 9, 1]))
        assert union.arbiter.overruled == 1 and union.stats.steps_peeked == 1


def _plain_union():
    from specplugin.proposers.ngram import NgramProposer

    union = _union(NgramProposer(), Fixed("draft", [], 0.5))
    union.arbiter = _AlwaysPlain()
    return union, union.arbiter


def test_peeks_that_find_nothing_come_ever_less_often_until_new_text_arrives():
    """A peek costs a percent or more of a plain step: while peeks find nothing worth
    verifying, the gap to the next one doubles up to MAX_PEEK_GAP plain steps; a peek
    that finds a copy, or requests joining the batch, bring it back to every step."""
    from specplugin.proposers.ngram import NgramProposer
    from specplugin.adaptive.union import MAX_PEEK_GAP

    union = _union(NgramProposer(), Fixed("draft", [], 0.5))
    union.arbiter = _AlwaysPlain()
    fresh = [7, 3, 9, 1, 4, 8, 2, 6, 5, 11, 13]
    peeked = []

    def peek():
        peeked.append(step)
        return _peek(fresh)()

    for step in range(40):
        assert not union.plain_step(0.01, 1, 1, False, peek=peek)
    assert peeked[:5] == [0, 2, 6, 14, 22]  # gaps 2, 4, 8, 8
    assert all(b - a == MAX_PEEK_GAP for a, b in zip(peeked[3:], peeked[4:]))
    union.new_requests(1, 1)
    peeked.clear()
    step = 0
    union.plain_step(0.01, 1, 1, False, peek=peek)
    assert peeked == [0]  # at once, then the gap grows again (to 2)
    copies = [7, 3, 9, 1, 4, 8, 2, 6, 5, 7, 3, 9, 1]
    union.plain_step(0.01, 1, 1, False, peek=lambda: peeked.append("early") or _peek(copies)())
    assert peeked == [0]  # between two peeks, the copy waits for the next one
    assert union.plain_step(0.01, 1, 1, False, peek=_peek(copies))  # found: speculate
    assert union._peek.gap == 1


def test_plain_steps_teach_the_estimator_what_the_peeks_copies_would_have_brought():
    """A candidate the peek found on a plain step is judged against the tokens the target
    emits next: where they match it, its tokens count as accepted; from the first that
    differs, as rejected (what verification would have said), without verifying it."""
    from specplugin.proposers.ngram import NgramProposer

    union = _union(NgramProposer(), Fixed("draft", [], 0.5))
    union.arbiter = _AlwaysPlain(pays=False)
    copies = [7, 3, 9, 1, 4, 8, 2, 6, 5, 7, 3, 9, 1]  # the n-gram guesses 4 8 2 6 5 ...
    union.plain_step(0.01, 1, 1, False, peek=_peek(copies))
    assert union.estimator.judged.sum() == 0
    union.plain_step(0.01, 1, 1, False, peek=_peek(copies + [4, 8]))  # so far so good
    assert union.estimator.judged.sum() == 0
    union.plain_step(0.01, 1, 1, False, peek=_peek(copies + [4, 8, 2, 0]))  # 3 right, 1 wrong
    judged, accepted = union.estimator.judged[0].sum(), union.estimator.accepted[0].sum()
    assert (judged, accepted) == (4, 3)
    assert union.estimator.judged[1].sum() == 0  # the draft model was not guessed for


def test_a_step_that_read_new_prompts_teaches_the_cost_model_nothing():
    """The step in which requests joined the batch ran their prompts: its time is a
    prefill's (long contexts the forward curve does not price), so neither the cost
    model nor the arbiter learns from it; the plain steps after it teach both as they
    would have without it."""
    unions = []
    for prefill in (False, True):
        union = _union(Fixed("p", [1, 2, 3], 0.5))
        union.arbiter = StepArbiter()
        if prefill:
            union.new_requests(8, 8)
            union.plain_step(0.200, 8, 1348, False,  # 1,348 prompt tokens in 200 ms
                             read_prompts=True)
        for _ in range(24):  # plain decode steps of 8 requests, 5 ms each
            union.plain_step(0.005, 8, 8, False)
        union.cost.observe(8, 0.005)  # (hands on the plain steps still being summed)
        unions.append(union)
    without, with_prefill = (u.cost for u in unions)
    assert with_prefill.overhead_s == pytest.approx(without.overhead_s)
    assert with_prefill.forward_s == pytest.approx(without.forward_s)
    assert with_prefill.spec_overhead_s == pytest.approx(without.spec_overhead_s)
    assert with_prefill.step_one(8) == pytest.approx(without.step_one(8))


def test_an_engines_first_speculative_blocks_are_not_measured():
    """One-time costs (first draft forwards, first calls into verification) make an
    engine's first speculative blocks slow: they run, but the rate is that of the
    blocks after them."""
    arbiter = StepArbiter()
    rates = []
    for block in range(6):
        assert arbiter.speculate(1)  # warm-up: speculative blocks first
        for _ in range(arbiter.block_steps):
            arbiter.observe(1, 1 / (20.0 if block < 2 else 300.0))
            rates.append(arbiter.speculate(1))
        if block >= 3:
            break
    assert arbiter.rate(1, True) == pytest.approx(300.0)


def test_steps_slower_than_predicted_do_not_overrule_measured_plain_decoding():
    """Speculative steps took twice the seconds the union predicted for them (the
    speculative machinery's costs, which the cost model misses): a step predicted at 1.5x
    the plain rate is not worth it, one at 2.5x is."""
    arbiter = StepArbiter()
    assert not arbiter.pays_now(1, 1e9)  # no plain rate measured yet: the warm-up measures it
    for _ in range(200):
        choice = arbiter.speculate(1)
        if choice:
            arbiter.predicted(1.0, 1 / 240.0)
        arbiter.observe(1, 1 / (120.0 if choice else 100.0))
    assert arbiter.rate(1, False) == pytest.approx(100.0, rel=0.01)
    assert not arbiter.pays_now(1, 150.0)
    assert arbiter.pays_now(1, 250.0)


def test_tokens_predicted_on_a_cold_estimator_are_forgotten_once_it_learned():
    """A bucket's first speculative blocks emitted half the tokens predicted for them (a
    request's first steps, the estimator at its prior); later blocks emit what is
    predicted (the estimator learned from their verdicts). The correction reads the last
    blocks only: once they are the later ones it is 1, and a copy the peek predicts at
    1.1x the plain rate speculates (an average over every block would still hold it
    back)."""
    arbiter = StepArbiter()
    arbiter.step_seconds_model = lambda num_tokens, drafts: 1 / 120.0
    for step in range(400):
        choice = arbiter.speculate(1)
        if choice:
            arbiter.predicted(2.0 if step < 100 else 1.0, 1 / 120.0, num_tokens=3, drafts=True)
        arbiter.observe(1, 1 / (120.0 if choice else 100.0))
        if step == 99:
            assert arbiter.correction(1) == pytest.approx(0.5)
    assert arbiter.correction(1) == pytest.approx(1.0)
    assert arbiter.pays_now(1, 110.0)


def test_the_correction_re_predicts_with_what_the_cost_model_learned_since():
    """Speculative steps took twice what the cost model predicted for them (a fresh
    engine's model, timed at start on short contexts); the model then learns the steps'
    real cost (from plain steps too). The correction re-predicts the blocks' steps with
    the model as it is now instead of keeping the ratio of the time, which would halve
    the peek's (already learned) predictions a second time."""
    model = {"seconds": 1 / 240.0}  # what the cost model gives a step, as it learns
    arbiter = StepArbiter()
    arbiter.step_seconds_model = lambda num_tokens, drafts: model["seconds"]
    for _ in range(200):
        choice = arbiter.speculate(1)
        if choice:
            arbiter.predicted(1.0, model["seconds"], num_tokens=3, drafts=True)
        arbiter.observe(1, 1 / (120.0 if choice else 100.0))
    assert arbiter.correction(1) == pytest.approx(0.5)
    assert not arbiter.pays_now(1, 150.0)  # the model still says 1/240 s: correct it
    model["seconds"] = 1 / 120.0  # learned: predictions made now are right
    assert arbiter.correction(1) == pytest.approx(1.0)
    assert arbiter.pays_now(1, 150.0)


def test_arbiter_speculates_where_it_pays_and_rarely_pays_to_check():
    choices = _arbitrate(StepArbiter(), 2000, spec_rate=2000.0, plain_rate=1000.0)
    late = choices[400:]
    assert late.mean() > 0.97 and not late.all()


def test_arbiter_remeasures_often_when_the_choices_are_close():
    choices = _arbitrate(StepArbiter(), 2000, spec_rate=1020.0, plain_rate=1000.0)
    assert 0.1 < choices[400:].mean() < 0.95


def test_arbiter_keeps_rates_per_batch_size_and_ignores_idle_gaps():
    arbiter = StepArbiter()
    _arbitrate(arbiter, 400, spec_rate=600.0, plain_rate=1000.0, num_reqs=16)
    _arbitrate(arbiter, 400, spec_rate=300.0, plain_rate=100.0, num_reqs=1)
    assert arbiter.speculate(1) and arbiter.rate(1, True) == pytest.approx(300, rel=0.1)
    assert arbiter.rate(16, False) == pytest.approx(1000, rel=0.1)
    arbiter.observe(1, 60.0)  # a minute without requests is not a slow step
    assert arbiter.rate(1, True) == pytest.approx(300, rel=0.1)


def test_union_with_an_arbiter_asks_no_proposer_in_a_plain_step():
    class Counting(Fixed):
        asked = 0

        def propose(self, batch):
            Counting.asked += 1
            return super().propose(batch)

    class Plain(StepArbiter):
        def speculate(self, num_reqs, sampled=False):
            return False

    union = _union(Counting("p", [1, 2], 0.9))
    assert union.step(_batch(["a"]), None).drafts == [[1, 2]] and Counting.asked == 1
    union.arbiter = Plain()
    assert union.step(_batch(["a"]), None).drafts == [[]] and Counting.asked == 1
    assert not union.speculating and union.stats.steps_without_drafts == 1


def test_arbiter_keeps_greedy_and_sampled_batches_apart():
    arbiter = StepArbiter()
    rng = np.random.default_rng(0)
    for step in range(1200):  # greedy and sampled batches take turns, 40 steps each
        sampled = (step // 40) % 2 == 1
        choice = arbiter.speculate(8, sampled=sampled)
        rate = {(False, True): 2000.0, (False, False): 1000.0,
                (True, True): 500.0, (True, False): 1000.0}[(sampled, choice)]
        arbiter.observe(8, 8 / (rate * rng.uniform(0.9, 1.1)))
    assert arbiter.rate(8, True, sampled=False) > arbiter.rate(8, False, sampled=False)
    assert arbiter.rate(8, True, sampled=True) < arbiter.rate(8, False, sampled=True)


def test_union_sends_extra_candidates_beside_the_chosen_draft():
    cost = flat_cost()
    union = Union([Fixed("a", [1, 2, 3, 4], 0.9), Fixed("b", [1, 7, 8, 9], 0.9)], cost=cost,
                  explore=False, max_candidates=2)
    plan = union.step(_batch(["r"]), None)
    [draft], [alternates] = plan.drafts, plan.alternates
    assert draft and len(alternates) == 1 and alternates[0] != draft
    assert len(alternates[0]) <= len(draft) and union.stats.extra_candidates == 1
    # at temperature > 0 the draft model's candidates (samples) are never verified together
    with_model = Union([Fixed("draft", [1, 2, 3, 4], 0.9), Fixed("b", [1, 7, 8, 9], 0.9)],
                       cost=cost, explore=False, max_candidates=2)
    assert with_model.step(_batch(["r"]), None).alternates != [[]]
    assert with_model.step(_batch(["r"], sampled=True), None).alternates == [[]]
    # one chain when max_candidates is 1
    single = Union([Fixed("a", [1, 2, 3, 4], 0.9), Fixed("b", [1, 7, 8, 9], 0.9)], cost=cost,
                   explore=False)
    assert single.step(_batch(["r"]), None).alternates == [[]]


def test_decoy_primary_sends_the_real_draft_as_the_extra_candidate():
    union = _union(Fixed("a", [5, 6, 7], 0.95), Fixed("b", [5, 6, 7], 0.95))
    union.max_candidates, union.decoy_primary = 2, True
    plan = union.step(_batch(["r"]), None)
    [draft], [alternates] = plan.drafts, plan.alternates
    assert 0 < len(draft) == len(alternates[0]) and alternates[0] == [5, 6, 7][:len(draft)]
    assert draft == [t - 1 for t in alternates[0]]  # every token changed


class WithAlternative(Fixed):
    """A proposer whose weak guess comes with a strong alternative."""

    def propose(self, batch):
        return [None if c is None else Candidate(
            c.token_ids, np.full(len(c), 0.3),
            alternatives=(Candidate(c.token_ids + 1, np.full(len(c), 0.99)),))
            for c in super().propose(batch)]


def test_alternatives_are_extra_candidates_never_the_chosen_draft():
    cost = flat_cost()
    union = Union([WithAlternative("a", [1, 2, 3], 0.3)], cost=cost, explore=False,
                  max_candidates=2)
    plan = union.step(_batch(["r"]), None)
    [draft] = plan.drafts
    assert draft and draft[0] == 1  # the proposer's own guess, not its alternative
    assert plan.alternates[0] and plan.alternates[0][0][0] == 2
    plain = Union([WithAlternative("a", [1, 2, 3], 0.3)], cost=cost, explore=False)
    alone = plain.step(_batch(["r"]), None)
    assert alone.drafts == [draft] and alone.alternates == [[]]


def test_alternatives_that_lose_do_not_teach_the_estimator():
    from specplugin.adaptive.learning import Scored

    cost = flat_cost()
    union = Union([WithAlternative("a", [1, 2, 3], 0.3)], cost=cost, explore=False,
                  max_candidates=2)
    plan = union.step(_batch(["r"]), None)
    [draft], [[alternative]] = plan.drafts, plan.alternates
    before = np.array(union.estimator.values(_cells(union.estimator, 3, signal=0.99)))
    lost = Scored(own_accepted=len(draft), extra_accepted=(0,), extra_lengths=(len(alternative),),
                  winner=None)
    union.step(_batch(["r"]), Verified(("r",), np.array([len(draft)]),
                                       np.array([len(draft) + 1]), None, 4, {"r": lost}))
    after = np.array(union.estimator.values(_cells(union.estimator, 3, signal=0.99)))
    assert np.all(after >= before - 1e-9), (before, after)


def test_the_cost_models_table_of_step_times_follows_every_change():
    """step_times / step_one read a cached table of T(n): it must say what step_seconds
    says after calibration, after every observed step, and past its first size."""
    cost = StepCostModel(max_tokens=64)

    def agrees(first, count):
        table = cost.step_times(first, count)
        assert table == pytest.approx(cost.step_seconds(np.arange(first, first + count)).tolist())
        assert cost.step_one(first) == pytest.approx(table[0])

    cost.calibrate(np.array([1, 2, 64]), np.array([0.010, 0.011, 0.073]))
    agrees(3, 5)
    cost.observe(4, 0.05)  # a slow step: the overhead and the knots around 4 move
    agrees(3, 5)
    for _ in range(8):
        cost.observe_plain(1, 0.03)  # learned as one mean of 8
    agrees(1, 4)
    cost.calibrate(np.array([1, 64]), np.array([0.02, 0.1]))
    agrees(0, 3)
    agrees(100, 40)  # past the table's first size: it grows


def test_pooled_cells_are_what_the_estimator_says_of_tokens_not_drafted_yet():
    """The draft's gate reads pooled cells in Python: the posterior mean of each position
    group's cell summed over signal buckets, per mode and history."""
    est = AcceptanceEstimator(("ngram", "draft"))
    rng = np.random.default_rng(3)
    n = 40
    cells = _reference_cells(est, np.full(n, 1), rng.random(n) < 0.5, np.arange(n) % 10,
                             rng.random(n), rng.integers(0, 4, n))
    est.update_cells(cells.tolist(), rng.random(n) < 0.7)
    est.values(list(range(200)))  # cells read first: kept apart from pooled ones
    for sampled in (False, True):
        for history in range(4):
            asked = _reference_cells(est, 1, sampled, np.arange(12), 0.0, history)
            read = est.pooled_cells(1, sampled, history, 12)
            assert read == pytest.approx(_reference_means(est, asked, pooled=True))


def test_the_estimator_learns_every_step_when_cold_then_every_learn_every_steps():
    """Verdicts reach the estimator at once in an engine's first steps (COLD_TOKENS), then
    LEARN_EVERY steps at a time; what it holds after a flush is what learning every step
    gives (up to the order of decay and update: fresh verdicts are not decayed by the steps
    they waited, 1 / memory per step)."""
    from specplugin.adaptive.learning import COLD_TOKENS, LEARN_EVERY

    def run(learn_every, cold):
        cost = StepCostModel(max_tokens=64)  # GPU-like: verifying a token is nearly free
        cost.calibrate(np.array([1, 64]), np.array([0.010, 0.0101]))
        union = Union([Fixed("p", [1, 2, 3, 4], 0.5)], cost=cost, learn_every=learn_every)
        union.learner.learned_tokens = 0 if cold else COLD_TOKENS
        held, verified = [], None
        for _ in range(2 * LEARN_EVERY):
            drafts = union.step(_batch(["a"]), verified).drafts
            held.append(union.estimator.judged.sum())
            assert drafts == [[1, 2, 3, 4]]  # all accepted: the same choice either way
            verified = Verified(("a",), np.array([4]), np.array([5]), 0.012, 5)
        return held

    every = run(1, cold=False)
    assert every[1] > 0  # the first verdict, learned in the next step
    assert run(LEARN_EVERY, cold=True) == pytest.approx(every)
    batched = run(LEARN_EVERY, cold=False)
    assert batched[1] == 0 and batched[LEARN_EVERY - 2] == 0  # held back
    assert batched[LEARN_EVERY - 1] == pytest.approx(every[LEARN_EVERY - 1], rel=1e-3)
    assert batched[-1] == pytest.approx(every[-1], rel=1e-3)


def test_per_candidate_cells_are_the_axes_raveled():
    """The union's per-step index of its candidates' cells (cells, one candidate at a time)
    is the estimator's axes raveled: proposer, mode, position group, signal bucket,
    history."""
    est = AcceptanceEstimator(("ngram", "suffix", "draft"))
    rng = np.random.default_rng(5)
    lengths = [1, 3, 9, 12, 70]  # past the last position group, past the first table
    proposer = rng.integers(0, 3, len(lengths)).tolist()
    sampled = (rng.random(len(lengths)) < 0.5).tolist()
    history = rng.integers(0, 4, len(lengths)).tolist()
    signals = [np.r_[0.0, 1.0, rng.random(k)][:k] for k in lengths]  # the edges included
    reference = _reference_cells(est, np.repeat(proposer, lengths), np.repeat(sampled, lengths),
                                 np.concatenate([np.arange(k) for k in lengths]),
                                 np.concatenate(signals), np.repeat(history, lengths))
    each = [est.cells(p, m, h, x) for p, m, h, x in zip(proposer, sampled, history, signals)]
    assert sum(each, []) == reference.tolist()
    assert est.cells(0, False, 0, np.array([2.0, -1.0])) == _reference_cells(
        est, 0, False, np.arange(2), [2.0, -1.0], 0).tolist()  # out of [0, 1]: clipped
    assert est.cells(0, False, 0, [np.nan]) == est.cells(0, False, 0, [0.0])
    assert len(position_groups(70)) == 70


def test_the_per_step_estimates_are_the_estimators_and_its_draws_last_until_it_learns():
    """values (compiled, over draws kept until the counts change) says what the counts'
    posterior means say; a draw is one per cell, the same for every token of the cell and
    on every call until the estimator learns or decays, then drawn again."""
    est = AcceptanceEstimator(("ngram", "draft"))
    rng = np.random.default_rng(7)
    n = 60
    flat = _reference_cells(est, rng.integers(0, 2, n), rng.random(n) < 0.5,
                            np.arange(n) % 10, rng.random(n), rng.integers(0, 4, n)).tolist()
    est.update_cells(flat, rng.random(n) < 0.6)
    assert est.values(flat) == pytest.approx(_reference_means(est, flat))
    draws = [-c - 1 for c in flat]
    drawn = est.values(draws + draws)
    assert drawn[:n] == drawn[n:]  # one draw per cell
    assert est.values(draws) == drawn[:n]  # held
    assert drawn[:n] != pytest.approx(est.values(flat))  # draws, not means
    est.step()
    assert est.values(draws) != drawn[:n]  # the counts changed: new draws
    means = est.values(flat)
    est.update_cells(flat, np.ones(n, dtype=bool))
    assert all(a > b for a, b in zip(est.values(flat), means))


def test_the_trace_records_the_unions_steps_blocks_and_draft_plans(tmp_path, monkeypatch):
    """With a trace open (SPECPLUGIN_TRACE), the union writes every step it observes, the
    draft plans it makes and what it forgets, and the arbiter every block it closes; the
    summary reads them back per kind."""
    from specplugin import trace

    monkeypatch.setattr(trace, "TRACE", trace.Trace(tmp_path))
    arbiter = StepArbiter()
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    union.arbiter = arbiter
    union.forget_learned()
    assert union.begin(None, 1, sampled=False)
    assert np.asarray(union.plan_draft(_batch(["a"]), [], 1, np.array([8]),
                                       forward_seconds=0.002)).any()  # a trial
    union.choose(_batch(["a"]), [])
    union.begin(Verified(("a",), [8], [9], 0.05, 9, draft_seconds=0.02), 1, sampled=False)
    for _ in range(40):
        union.plain_step(0.01, 1, 1, False)
    records = trace.read(tmp_path)
    kinds = {r["kind"] for r in records}
    assert {"forget", "step", "draft_plan", "block"} <= kinds, kinds
    summary = trace.summarize(trace.after_last_forget(records))
    assert summary["spec_steps"] == 1 and summary["spec_ms"] == pytest.approx(50.0)
    assert summary["spec_draft_ms"] == pytest.approx(20.0)
    assert summary["spec_rest_ms"] == pytest.approx(30.0)
    assert summary["spec_emitted"] == pytest.approx(9.0)
    assert summary["plain_steps"] == 40 and summary["plain_ms"] == pytest.approx(10.0)
    assert summary["draft_run_steps"] == 1 and summary["draft_run_ms"] == pytest.approx(20.0)
    assert summary["blocks"].startswith("S") and summary["draft_runs_planned"] == 1
    assert trace.summarize(trace.after_last_forget(records), max_steps=5)["plain_steps"] == 4
    # (the plan had no candidate to send: every step's choice is plain)
    assert "plan" in kinds
    assert trace.step_choices(trace.after_last_forget(records)) == ["plain"] * 41
    assert (summary["steady_choice"], summary["steps_to_steady"]) == ("plain", 0)


def test_trace_summary_helpers():
    from specplugin import trace

    assert trace.run_lengths(["spec", "spec", "plain", "spec"]) == "S2 P1 S1"
    assert trace.run_lengths([]) == ""
    records = [{"kind": "step"}, {"kind": "forget"}, {"kind": "block"}]
    assert trace.after_last_forget(records) == [{"kind": "block"}]
    assert trace.summarize([])["spec_ms"] is None


def test_steps_to_steady_choice():
    """A run's steady choice is its second half's most frequent; it is reached where every
    window from then on holds it at least half of the time."""
    from specplugin import trace

    def plan(*names):
        return {"kind": "plan", "sources": list(names)}

    def step(speculative=True):
        return {"kind": "step", "speculative": speculative}

    records = [plan("ngram", None, "suffix", "suffix"), step(), step(False),
               plan("draft", "ngram"), step(), plan(None, None), step(False)]
    assert trace.step_choices(records) == ["suffix", "plain", "draft", "plain"]
    # a tie goes to the name first in alphabetical order, whatever the rows' order
    assert trace.step_choices([plan("suffix", "ngram"), step()]) == ["ngram"]
    # plain for 10 steps, suffix and draft by turns, then suffix for good
    choices = ["plain"] * 10 + ["suffix", "draft"] * 6 + ["suffix"] * 30
    steady, reached = trace.steps_to_steady(choices, window=8)
    assert steady == "suffix" and 9 <= reached <= 14
    assert all(2 * choices[s:s + 8].count("suffix") >= 8 for s in range(reached, len(choices) - 7))
    assert 2 * choices[reached - 1:reached + 7].count("suffix") < 8
    assert trace.steps_to_steady(["suffix"] * 20) == ("suffix", 0)
    # never settled: every step of the run; a short run: its first steady step
    assert trace.steps_to_steady(["plain"] * 12 + ["ngram"] * 7 + ["plain"] * 5,
                                 window=8) == ("ngram", 24)
    assert trace.steps_to_steady(["plain", "ngram", "ngram"], window=8) == ("ngram", 1)
    assert trace.steps_to_steady([]) == (None, 0)


def test_alternate_blocks_take_turns_from_an_engines_first_block():
    """``alternate_blocks`` (tests): speculative and plain blocks take turns from the first
    block on, the engine's unmeasured first speculative blocks included, and again from
    the start after forget (a profile's timed cell is short: two unmeasured speculative
    blocks in a row there left no plain block closed in it, a flaky test)."""
    from specplugin.adaptive.arbiter import ALTERNATE_PLAIN_FACTOR

    arbiter = StepArbiter(block_steps=2, alternate=True)
    choices = _arbitrate(arbiter, 2 * (2 + 2 * ALTERNATE_PLAIN_FACTOR), 100.0, 100.0, num_reqs=1)
    spec, plain = [True] * 2, [False] * 2 * ALTERNATE_PLAIN_FACTOR
    assert choices.tolist() == (spec + plain) * 2
    arbiter.forget()
    assert _arbitrate(arbiter, 3, 100.0, 100.0, num_reqs=1).tolist() == [True, True, False]


def test_the_draft_gate_is_asked_on_a_doubling_gap_while_it_keeps_the_draft_off():
    """Once the draft's trials are spent, a gate that keeps the draft off is asked in the
    next step once more (one closing may be a posterior draw's noise: GATE_PATIENCE),
    then again after 1, 3, 7, then every 7 skipped steps (the gap doubles to
    MAX_GATE_GAP); it is due at once when new requests join, and every step while it lets
    the draft run."""
    from specplugin.adaptive.union import MAX_GATE_GAP

    rows = [f"r{j}" for j in range(8)]
    union = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    _teach(union, 1, 0.5, num_tokens=16)  # tried: no optimistic trial left to run
    assert union.begin(None, 8, sampled=False)

    def asks(steps, forward_seconds):
        due = []
        for _ in range(steps):
            due.append(union.draft_gate_due())
            if due[-1]:
                union.plan_draft(_batch(rows), [], 1, np.full(8, 8), forward_seconds)
        return due

    gaps = [1, 2, 4] + [MAX_GATE_GAP] * 2
    expected = [flag for gap in gaps for flag in [True] + [False] * (gap - 1)]
    assert asks(len(expected), forward_seconds=0.5) == expected  # a forward that never pays
    assert asks(2, forward_seconds=0.5) == [True, False]  # (mid-gap)
    union.new_requests(1, 8)
    assert asks(3, forward_seconds=0.5) == [True, True, False]  # (patient again)
    # the first speculative step after plain ones (a re-check of speculation) asks it
    assert asks(2, forward_seconds=0.5) == [True, False]  # (mid-gap again)
    union._after_plain = True
    assert asks(1, forward_seconds=0.5) == [True]
    union._after_plain = False
    assert asks(1, forward_seconds=0.5) == [False]
    # a gate that opens (here an untried draft's optimistic trial) is asked every step
    fresh = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    assert fresh.begin(None, 8, sampled=False)
    assert fresh.draft_gate_due()
    assert np.asarray(fresh.plan_draft(_batch(rows), [], 1, np.full(8, 8), 0.002)).any()
    assert fresh.draft_gate_due() and fresh._gate.wait == 0
    # an untried draft whose optimistic trial does not pay either: the gap grows, and
    # the trial waits for the next step that asks
    untried = _union(Fixed("ngram", [], 0.5), Fixed("draft", [], 0.5))
    assert untried.begin(None, 8, sampled=False)
    union = untried  # (the union asks() reads from here on)
    assert asks(len(expected), forward_seconds=0.5) == expected
    assert untried._draft_trials == 4


def test_looks_are_spaced_out_while_every_row_keeps_choosing_the_draft():
    """A speculative step whose last looks (every proposer asked, the draft's gate priced)
    chose the draft model's candidate for every row is held: the draft runs as the last
    look planned, nothing else is asked, each row sends its run as the stop rule cut it
    (remembered to learn from). After HOLD_PATIENCE confirming looks the gap to
    the next look doubles up to MAX_HOLD_GAP where every row samples, MAX_HOLD_GAP_GREEDY
    where one is greedy; a plan without the draft for some row, new requests or a plain
    step end the hold (the next step looks)."""
    from specplugin.adaptive.union import HOLD_PATIENCE, MAX_HOLD_GAP, MAX_HOLD_GAP_GREEDY

    def union_with(sampled):
        union = _union(Fixed("ngram", [5, 6, 7, 8], 0.5), Fixed("draft", [1, 2, 3, 4], 0.9))
        _teach(union, 0, 0.05, sampled=sampled)
        _teach(union, 1, 0.95, sampled=sampled)
        union._draft_trials = 0
        return union

    def looks(union, batch, steps):
        out = []
        for _ in range(steps):
            assert union.begin(None, batch.num_reqs, sampled=bool(batch.sampled[0]))
            caps = np.full(batch.num_reqs, 8)
            held = union.held_draft(batch, caps) if union.holding else None
            offers = []
            if held is None:
                offers = union.ask(batch, [0])
                caps = np.asarray(union.plan_draft(batch, offers, 1, caps, 0.0001))
            else:
                caps = np.asarray(held)
            out.append(held is None)
            if held is None:
                plan = union.choose(batch, offers + union.ask(batch, [1]),
                                    draft_forwards=int(caps.max()))
                continue
            # a held step sends each row's run as its stop rule cut it (here 1 to 4 tokens)
            lengths = [1 + r % 4 for r in range(batch.num_reqs)]
            plan = union.choose_held(batch, lengths, [[0.9] * k for k in lengths],
                                     draft_forwards=4)
            assert plan.sources == [1] * batch.num_reqs and (caps > 0).all()
            assert {r: len(p.cells) for r, p in union._pending.items()} == dict(
                zip(batch.req_ids, lengths))  # remembered, to learn from
        return out

    def expected(limit, steps):
        flags, gap = [True] * HOLD_PATIENCE, 2
        while len(flags) < steps:
            flags += [False] * (gap - 1) + [True]
            gap = min(2 * gap, limit)
        return flags[:steps]

    rows = [f"r{j}" for j in range(4)]
    sampled = union_with(True)
    batch = _batch(rows, sampled=True)
    ngram, asked = sampled.proposers[0], []
    ngram.propose = lambda b, propose=ngram.propose: asked.append(1) or propose(b)
    assert looks(sampled, batch, 30) == expected(MAX_HOLD_GAP, 30)
    assert len(asked) == sum(expected(MAX_HOLD_GAP, 30))  # held steps ask no proposer
    # new requests: the next step looks; confirmed, the gap reached goes on
    sampled.new_requests(1, 4)
    assert looks(sampled, batch, MAX_HOLD_GAP + 1) == [True] + [False] * (MAX_HOLD_GAP - 1) + [True]
    # a held step whose plan sends no draft for a row ends the hold
    while not sampled.holding:
        looks(sampled, batch, 1)
    sampled.begin(None, 4, sampled=True)
    assert sampled.holding
    assert sampled.held_draft(batch, np.full(4, 8)) is not None
    plan = sampled.choose_held(batch, [0, 3, 3, 3], [[], [0.9] * 3, [0.9] * 3, [0.9] * 3],
                               draft_forwards=3)
    assert plan.sources == [None, 1, 1, 1] and not sampled.holding
    assert looks(sampled, batch, 5) == expected(MAX_HOLD_GAP, 5)
    # another batch than the look's: the step looks in full
    assert sampled.begin(None, 4, sampled=True) and sampled.holding
    assert sampled.held_draft(_batch(["x"] + rows[1:], sampled=True), np.full(4, 8)) is None
    assert not sampled.holding
    # a greedy row: looks at least every MAX_HOLD_GAP_GREEDY steps
    greedy = union_with(False)
    assert looks(greedy, _batch(rows), 20) == expected(MAX_HOLD_GAP_GREEDY, 20)
    # with the scorer's extra candidates (which a held step does not weigh): every step looks
    scorer = union_with(True)
    scorer.max_candidates = 2
    assert looks(scorer, batch, 12) == [True] * 12


def _worker_loop(union, steps: int, slow: range, factor: float) -> list[int]:
    """The worker's loop over ``union`` at batch 1 on copy-heavy text (every guess right):
    plain steps take 29 ms, speculative ones 41 ms + 0.6 ms a draft token, ``factor`` times
    that in the ``slow`` steps; plain steps decided by ``plain_step`` (and those it foretells,
    ``plain_steps_ran``) as the worker does. Returns 1 per speculative step, 0 per plain."""
    batch, verified, drafted, ahead, out = _batch(["a"]), None, 0, 0, []
    for step in range(steps):
        spec_factor = factor if step in slow else 1.0
        if ahead:
            union.plain_steps_ran([0.029], 1)
            ahead, verified = ahead - 1, None
            out.append(0)
            continue
        if verified is not None and not drafted and not union.plain_step(
                verified.seconds, 1, 1, False, peek=lambda: batch):
            ahead = union.plain_steps_ahead()
            verified = Verified(("a",), np.array([0]), np.array([1]), 0.029, 1)
            out.append(0)
            continue
        drafted = len(union.step(batch, verified).drafts[0])
        seconds = 0.029 if not drafted else (0.041 + 0.0006 * drafted) * spec_factor
        verified = Verified(("a",), np.array([drafted]), np.array([drafted + 1]), seconds,
                            1 + drafted, next_tokens=[drafted + 1])
        out.append(int(drafted > 0))
    return out


@pytest.mark.parametrize("burst", [300, 1000])
def test_a_burst_of_slow_speculative_steps_does_not_keep_the_union_plain_for_good(burst):
    """Speculative steps 8x slower for a while (a stalled host, a sampler stopping the
    worker) rightly send the union plain; once they are fast again it must speculate again.
    What only speculative steps teach (the machinery's price, F past one token) ages while
    plain steps go by (UNSEEN_MEMORY); seen red without it: the model priced speculation out
    and no plan drafted again (0 of the last 300 steps speculative)."""
    from specplugin.adaptive.arbiter import StepArbiter

    cost = StepCostModel(max_tokens=64)  # SmolLM2-135M, bf16, 2 cores: 8 tokens ~ 1.2x one
    cost.calibrate(np.array([1, 4, 8, 16, 64]), np.array([0.0212, 0.0212, 0.026, 0.036, 0.107]))
    union = Union([Fixed("ngram", list(range(1, 9)), 0.9)], cost=cost, arbiter=StepArbiter())
    out = np.array(_worker_loop(union, 300 + burst + 900, range(300, 300 + burst), 8.0))
    assert out[:300].mean() > 0.9  # copy-heavy text: speculating
    assert out[300:300 + burst].mean() < 0.5  # the slow steps: plain decoding pays
    assert out[-300:].mean() > 0.9, out[300 + burst:].reshape(-1, 100).mean(axis=1)


def test_a_cost_model_driven_low_by_outliers_still_learns_the_steps_it_then_sees():
    """A step over 20x the model's prediction is an idle gap and is ignored; judged against
    a model that outliers drove far below the start-up timings, every real step would look
    like one and the model would never learn again (seen red: judged against the prediction
    alone, T(1) stayed at 0.5 ms while every step took 30)."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.02, 0.1]))
    for _ in range(400):  # a run of absurdly fast steps
        cost.observe_plain(1, 0.0005)
    assert cost.step_one(1) < 0.002
    for _ in range(800):
        cost.observe_plain(1, 0.03)
    assert cost.step_one(1) == pytest.approx(0.03, rel=0.1)

"""The draft proposer's vLLM-free parts: stopping rule, per-row bookkeeping, settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specplugin.config import (
    DraftSettings,
    SpecPluginConfigError,
    check_shared_vocabulary,
    parse,
)
from specplugin.adaptive.draft_rule import (
    MAX_FORWARD_JUMP,
    WARMUP_FORWARDS,
    AcceptanceCalibration,
    CostModel,
    DraftRun,
    OutcomeTracker,
    StopRule,
)
from specplugin.proposers.draft import (
    DraftKVCursor,
    HostDraws,
    UniformPool,
    confidence_of,
    draft_uniforms,
    greedy_draft_tokens,
    inverse_cdf_draw,
    sample_draft_tokens,
    truncate_rows,
)
from specplugin.bench.verify_bench import greedy_sampling_metadata, spec_decode_metadata
from specplugin.stats import chi_square_gof


class Identity(AcceptanceCalibration):
    """A calibration that believes the draft: estimate = confidence, always warm."""

    def __init__(self):
        super().__init__(warmup=0)

    def estimate_rows(self, confidence, sampled, position):
        return list(confidence)


def run_rows(rule: StopRule, confidences: list[list[float]], caps=None,
             calibration=None) -> DraftRun:
    """Feed a [positions][num_reqs] grid of confidences until the run says stop."""
    num_reqs = len(confidences[0])
    run = DraftRun(rule, calibration or Identity(), np.zeros(num_reqs, dtype=bool),
                   caps=None if caps is None else np.array(caps))
    for j, conf in enumerate(confidences):
        if not run.add(torch.full((num_reqs,), j), np.array(conf, dtype=np.float64)):
            break
    return run


def test_rows_draft_while_the_chance_all_are_accepted_stays_above_the_row_threshold():
    rule = StopRule(k=2, k_max=5, row_threshold=0.5)
    # products: row 0 1.0 throughout -> 5; row 1 0.9, 0.81, 0.73, 0.66, 0.59 -> 5;
    # row 2 0.8, 0.64, 0.51, then 0.41 < 0.5 -> 4; row 3 0.9 then 0.36 -> 2
    run = run_rows(rule, [[1.0, 0.9, 0.8, 0.9],
                          [1.0, 0.9, 0.8, 0.4],
                          [1.0, 0.9, 0.8, 0.9],
                          [1.0, 0.9, 0.8, 0.9],
                          [1.0, 0.9, 0.8, 0.9]])
    assert run.lengths().tolist() == [5, 5, 4, 2]
    assert run.num_positions == 5


def test_an_unlikely_first_token_ends_the_draft_and_the_loop_stops_early():
    run = run_rows(StopRule(k=4, k_max=8, row_threshold=0.3), [[0.1, 0.2]] + [[1.0, 1.0]] * 7)
    assert run.lengths().tolist() == [1, 1]
    assert run.num_positions == 1  # no forward pass wasted on rows that stopped


def test_zero_thresholds_always_draft_k_max():
    run = run_rows(StopRule(k=2, k_max=6), [[0.01, 0.5]] * 6)
    assert run.lengths().tolist() == [6, 6]


def test_caps_bound_each_row_and_a_zero_cap_drafts_nothing():
    run = run_rows(StopRule(k=4, k_max=8), [[1.0, 1.0, 1.0]] * 8, caps=[0, 3, 8])
    assert run.lengths().tolist() == [0, 3, 8]


def test_until_the_calibration_is_warm_every_row_drafts_the_default_length():
    cold = AcceptanceCalibration(warmup=10)
    run = run_rows(StopRule(k=3, k_max=8, row_threshold=0.9), [[0.01, 1.0]] * 8,
                   calibration=cold)
    assert run.lengths().tolist() == [3, 3]


def test_the_batch_stops_when_the_few_rows_left_do_not_pay_for_a_forward():
    # four rows; after position 0 only row 0 is likely (0.9), the rest are not drafting
    rule = StopRule(k=1, k_max=8, row_threshold=0.5, pass_threshold=0.5)
    run = run_rows(rule, [[0.9, 0.1, 0.1, 0.1]] + [[1.0] * 4] * 7)
    assert run.num_positions == 1  # surplus 0.9 - 0.5 = 0.4 < 0.5: no second forward
    assert run.lengths().tolist() == [1, 1, 1, 1]
    cheap = StopRule(k=1, k_max=8, row_threshold=0.5, pass_threshold=0.3)
    assert run_rows(cheap, [[0.9, 0.1, 0.1, 0.1]] + [[1.0] * 4] * 7).lengths()[0] > 1


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 6), extra=st.integers(0, 4), tau=st.floats(0, 1),
       confs=st.lists(st.lists(st.floats(0, 1), min_size=3, max_size=3), min_size=10, max_size=10))
def test_lengths_match_the_formula_row_by_row(k, extra, tau, confs):
    """Oracle: walk each row alone with the docstring's formula (pass_threshold 0)."""
    rule = StopRule(k=k, k_max=k + extra, row_threshold=tau)
    run = run_rows(rule, confs[: rule.k_max])
    for r in range(3):
        length, product = 0, 1.0
        for j in range(rule.k_max):
            length += 1
            product *= confs[j][r]
            if j + 1 >= rule.k_max or product < tau:
                break
        assert run.lengths()[r] == length
    assert run.num_positions == max(run.lengths().tolist())


def test_stacked_outputs_have_one_column_per_position():
    run = DraftRun(StopRule(k=2, k_max=3), Identity(), np.zeros(2, dtype=bool))
    probs = torch.softmax(torch.randn(2, 5), dim=-1)
    for j in range(3):
        run.add(torch.tensor([j, 10 + j]), confidence_of(probs), probs)
    assert run.stacked_token_ids().tolist() == [[0, 1, 2], [10, 11, 12]]
    assert run.stacked_draft_probs().shape == (2, 3, 5)
    assert run.stacked_confidences().shape == (2, 3)


def test_a_runs_host_draws_are_the_per_position_draws_in_one_block():
    """``HostDraws`` (a run's float32 draws into blocks made once; :func:`sample_draft_tokens`
    on the host is one position of it) draws, position by position, from
    ``softmax(logits / temperature)`` (greedy rows: the argmax) what :func:`inverse_cdf_draw`
    draws from its probabilities at the same uniforms, writes the int32 copy, takes logits
    that are a view of wider rows, and the run reads its probabilities back from the block as
    the per-position list would stack them."""
    generator = torch.Generator().manual_seed(5)
    sampled, temperature = [True, False, True], np.array([0.8, 0.0, 1.0], dtype=np.float32)
    uniforms = draft_uniforms((4, 3), "cpu", generator).numpy()
    next_ids = np.zeros(3, dtype=np.int32)
    draws = HostDraws(uniforms, temperature, sampled, next_ids)
    blocked = DraftRun(StopRule(k=4, k_max=4), Identity(), sampled)
    listed = DraftRun(StopRule(k=4, k_max=4), Identity(), sampled)
    scale = torch.tensor([0.8, 1.0, 1.0])[:, None]
    for position in range(4):
        logits = torch.randn(3, 300, generator=generator) * 3
        if position % 2:  # (a view of wider rows, as an LM head may hand back)
            logits = torch.cat([logits, torch.zeros(3, 20)], dim=1)[:, :300]
        tokens, confidence, _ = draws.draw(position, logits)
        probs = draws.probs[position]
        assert torch.allclose(probs, (logits / scale).softmax(dim=-1), rtol=1e-5, atol=1e-7)
        drawn = inverse_cdf_draw(probs, torch.from_numpy(uniforms[position])[:, None])
        want = torch.where(torch.tensor(sampled), drawn, logits.argmax(dim=-1))
        assert tokens.tolist() == want.tolist() == next_ids.tolist()
        assert confidence == probs.amax(dim=-1).tolist()
        blocked.add(tokens, confidence)
        blocked.probs_block = draws.probs
        listed.add(torch.from_numpy(tokens.copy()), confidence, probs.clone())
    assert torch.equal(blocked.stacked_draft_probs(), listed.stacked_draft_probs())
    assert torch.equal(blocked.stacked_token_ids(), listed.stacked_token_ids())
    assert blocked.token_lists([4, 2, 3]) == listed.token_lists([4, 2, 3])


def test_calibration_learns_acceptance_per_table_and_position():
    cal = AcceptanceCalibration(num_buckets=10, warmup=4)
    greedy, sampled = np.zeros(200, dtype=bool), np.ones(200, dtype=bool)
    conf = np.full(200, 0.05)  # a draft that says 5% ...
    cal.update(conf, np.arange(200) % 10 < 9, greedy, np.zeros(200, dtype=int))  # ... is right 90%
    cal.update(conf, np.arange(200) % 10 < 3, sampled, np.zeros(200, dtype=int))  # ... or 30%
    assert cal.estimate_rows([0.05], [0], 0)[0] == pytest.approx(0.9, abs=0.01)
    assert cal.estimate_rows([0.05], [1], 0)[0] == pytest.approx(0.3, abs=0.01)
    # an unseen position starts from the prior: the bucket's own confidence
    assert cal.estimate_rows([0.05], [0], 3)[0] == pytest.approx(0.05)
    assert cal.warm_tables() == [True, True]


def test_a_forgotten_calibration_is_a_fresh_one_for_every_holder():
    """``specplugin bench`` makes the drafter forget what its warm-up taught: the
    calibration must then read as a fresh engine's, in the tracker that feeds it too."""
    cal, fresh = AcceptanceCalibration(warmup=4), AcceptanceCalibration(warmup=4)
    tracker = OutcomeTracker(cal)
    conf = np.full(50, 0.95)
    cal.update(conf, np.zeros(50, dtype=bool), np.ones(50, dtype=bool), np.zeros(50, dtype=int))
    assert cal.estimate_rows([0.95], [1], 0) != fresh.estimate_rows([0.95], [1], 0)
    assert cal.warm_tables() == [False, True], "the lesson did not take: the test tests nothing"
    cal.forget()
    for position in range(6):
        for mode in (0, 1):
            confidences = [c / 20 for c in range(21)]
            assert (cal.estimate_rows(confidences, [mode] * 21, position)
                    == fresh.estimate_rows(confidences, [mode] * 21, position))
    assert cal.warm_tables() == [False, False]
    # the tracker built before the forgetting teaches the tables that are read after it
    run = DraftRun(StopRule(k=2, k_max=2), Identity(), np.array([True]))
    for _ in range(2):
        run.add(torch.tensor([1]), np.array([0.95]))
    tracker.record(["a"], run)
    assert tracker.resolve(["a"], [2], [0]) == 2
    assert cal.num_observed.tolist() == [0, 2]


def _recorded(req_ids: list[str], sampled: list[bool]):
    """A calibration and a tracker that recorded one 3-token draft per row (confidence 0.9)."""
    cal = AcceptanceCalibration(num_buckets=2, num_position_groups=8, warmup=0)
    tracker = OutcomeTracker(cal)
    run = DraftRun(StopRule(k=3, k_max=3), Identity(), np.array(sampled))
    for _ in range(3):
        run.add(torch.tensor([1, 2]), np.array([0.9, 0.9]))
    tracker.record(req_ids, run)
    return cal, tracker


def test_outcomes_attribute_accepted_and_first_rejected_positions_by_request_id():
    cal, tracker = _recorded(["a", "b"], [False, False])
    # next step the rows come back swapped; "a" had 1 of 3 rejected, "b" all 3 rejected
    assert tracker.resolve(["b", "a"], [3, 3], [3, 1]) == 2
    seen = cal.seen[0, :, 1] - 1  # minus the prior pseudo-observation
    accepted = cal.accepted[0, :, 1] - 0.75
    assert seen[:3].tolist() == [2, 1, 1]  # a: positions 0, 1, 2 judged; b: position 0 only
    assert accepted[:3].tolist() == [1, 1, 0]
    assert tracker.resolve(["a"], [0], None) == 0  # nothing pending any more


def _tracker_with_pending(num_drafts: int = 4):
    cal = AcceptanceCalibration(num_buckets=2, num_position_groups=8, warmup=0)
    tracker = OutcomeTracker(cal)
    run = DraftRun(StopRule(k=num_drafts, k_max=num_drafts), Identity(), np.array([False]))
    for _ in range(num_drafts):
        run.add(torch.tensor([1]), np.array([0.9]))
    tracker.record(["a"], run)
    return tracker, cal


def test_sampled_drafts_teach_the_calibration_their_acceptance_probabilities():
    """Given the verifier's per-token acceptance probabilities, a sampled row's judged
    positions teach those (the rejected one too); a greedy row's still teach verdicts."""
    cal, tracker = _recorded(["s", "g"], [True, False])
    before = cal.accepted.copy()
    # both rows: 3 verified, 2 rejected (position 0 accepted, position 1 rejected)
    tracker.resolve(["s", "g"], [3, 3], [2, 2], expected=[[0.8, 0.3, 0.5], [0.8, 0.3, 0.5]])
    gained = cal.accepted - before  # [table, position, bucket]
    assert gained[1, 0].sum() == pytest.approx(0.8) and gained[1, 1].sum() == pytest.approx(0.3)
    assert gained[0, 0].sum() == pytest.approx(1.0) and gained[0, 1].sum() == pytest.approx(0.0)
    assert gained[:, 2:].sum() == 0.0  # never judged


def test_outcomes_of_a_step_the_drafter_skipped_are_forgotten_not_counted_as_accepted():
    """vLLM skips the drafter (e.g. near max_model_len): the drafts recorded before were
    verified in that step, whose result the tracker never sees. The next verification
    (no drafts: 0 rejected) must not be read as 'all 4 accepted'."""
    tracker, cal = _tracker_with_pending()
    before = cal.seen.sum()
    tracker.forget()  # what the runner does when vLLM skips drafting
    assert tracker.resolve(["a"], [0], [0]) == 0
    assert cal.seen.sum() == before


def test_outcomes_count_only_the_drafts_the_scheduler_verified():
    """The scheduler cut the 4 recorded drafts to 2, both accepted: 2 accepted, not 4,
    and positions 2 and 3 are not judged."""
    tracker, cal = _tracker_with_pending()
    assert tracker.resolve(["a"], [2], [0]) == 2
    seen = cal.seen[0, :, 1] - 1
    assert seen[:4].tolist() == [1, 1, 0, 0]
    tracker, _ = _tracker_with_pending()
    assert tracker.resolve(["a"], [0], [0]) == 0  # nothing scheduled: nothing accepted


def test_cost_model_measures_thresholds_from_its_own_timings():
    costs = CostModel(fallback=(0.2, 0.0), warmup=4)
    assert costs.thresholds() == (0.2, 0.0)
    rng = np.random.default_rng(0)
    for _ in range(200):  # step = 10 ms + 1 ms per forward + 0.5 ms per draft token
        forwards = int(rng.integers(0, 6))
        draft_tokens = forwards + 1 + int(rng.integers(0, 3))
        costs.observe_forward(0.001)
        costs.observe_step(0.010 + 0.001 * forwards + 0.0005 * draft_tokens, num_tokens=4,
                           num_forwards=forwards, num_draft_tokens=draft_tokens)
    assert costs.verify_s == pytest.approx(0.0005, rel=0.05)
    row, per_pass = costs.thresholds()
    assert row == pytest.approx(0.0005 / costs.token_s, rel=0.05)
    assert per_pass == pytest.approx(0.001 / costs.token_s, rel=0.05)
    costs.observe_step(10.0, num_tokens=4, num_forwards=0, num_draft_tokens=0)  # idle gap
    assert costs.thresholds()[1] == pytest.approx(per_pass)


def test_the_draft_cost_model_learns_summed_plain_steps_as_that_many_steps():
    """Plain steps reach the draft's cost model eight at a time (StepSums): the mean of
    eight equal steps, counted as eight, moves it exactly as the eight steps would."""
    one, summed = CostModel(warmup=4), CostModel(warmup=4)
    for costs in (one, summed):
        for _ in range(WARMUP_FORWARDS + 1):
            costs.observe_forward(0.001)
        for forwards in (1, 2, 3):
            costs.observe_step(0.012 + 0.001 * forwards, 4, forwards, forwards + 1)
    for _ in range(8):
        one.observe_step(0.010, 4, 0, 0)
    for _ in range(8):
        summed.observe_plain_step(0.010, 4)
    one.flush()  # (past its warm-up it holds steps four at a time: see observe_step)
    assert summed.token_s == pytest.approx(one.token_s)
    assert summed.thresholds() == pytest.approx(one.thresholds(), rel=0.15)
    assert summed._num_steps == one._num_steps


def test_the_draft_cost_model_learns_held_steps_as_it_would_have_learned_each():
    """Past its warm-up the draft's cost model holds steps and learns them four at a time,
    each with the forward price of its own step: after a flush (or a plain step, which
    flushes first) it is the model that learned each step as it came, bit for bit."""
    rng = np.random.default_rng(0)
    held, each = CostModel(warmup=4), CostModel(warmup=4)
    for j in range(300):
        seconds, forwards = float(rng.uniform(0.005, 0.02)), int(rng.integers(0, 4))
        forward = float(rng.uniform(0.0005, 0.002))
        for costs in (held, each):
            if j % 7 == 3:  # a forward timed between steps: its price moves
                costs.observe_forward(forward)
            if j % 11 == 10:
                costs.observe_plain_step(seconds, 4)
            else:
                costs.observe_step(seconds, 4 + forwards, forwards, 2 * forwards)
        each.flush()
        assert len(held._held) < 4
    held.flush()
    assert held._moments == each._moments and held.token_s == each.token_s
    assert held.thresholds() == each.thresholds()


def test_the_draft_forward_price_leaves_out_an_engines_first_forwards_and_stalls():
    """An engine's first draft forwards pay one-time costs: not priced (None: the caller
    models the price). Then a plain mean over the first timed ones, an exponential average
    after; a stall counts at most MAX_FORWARD_JUMP times the running price, so that one
    slow forward cannot price the draft out of the steps that would correct it."""
    costs = CostModel()
    for _ in range(WARMUP_FORWARDS):
        costs.observe_forward(0.05)  # compiling, allocating
    assert costs.draft_forward_s is None
    costs.observe_forward(0.002)
    costs.observe_forward(0.001)
    assert costs.draft_forward_s == pytest.approx(0.0015)
    for _ in range(200):
        costs.observe_forward(0.001)
    assert costs.draft_forward_s == pytest.approx(0.001, rel=1e-3)
    price = costs.draft_forward_s
    costs.observe_forward(1.0)  # one stall
    assert costs.draft_forward_s == pytest.approx(
        price + costs.smoothing * (MAX_FORWARD_JUMP - 1) * price)


def test_truncate_rows_cuts_to_lengths():
    assert truncate_rows([[1, 2, 3], [4, 5, 6], [7]], [2, 0, 1]) == [[1, 2], [], [7]]


def test_confidence_is_the_top_probability():
    probs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]])
    assert confidence_of(probs) == pytest.approx([0.7, 0.5])


def test_greedy_draft_tokens_are_the_argmax_with_its_softmax_probability():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 4
    logits[3, 7] = 40.0  # a confident row
    token_ids, confidence = greedy_draft_tokens(logits)
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert confidence == pytest.approx(confidence_of(logits.softmax(dim=-1)), rel=1e-6)
    assert confidence[3] == pytest.approx(1.0, abs=1e-6)


def test_the_draft_rereads_only_what_its_kv_cache_misses():
    cursor = DraftKVCursor()
    # new requests read their whole context (prompt, newest token included)
    assert cursor.starts(["a", "b"], np.array([10, 7]), budget=100) == [0, 0]
    cursor.advance(["a", "b"], np.array([10, 7]))
    # "a" drafted every step (2 new tokens), "b" was skipped for 5 steps: a longer re-read
    assert cursor.starts(["a", "b"], np.array([12, 13]), budget=100) == [10, 7]
    # what would overflow the draft's input buffers waits for a later step
    assert cursor.starts(["a", "b"], np.array([12, 13]), budget=4) == [10, -1]
    # a context that shrank (preempted and restarted elsewhere) is read again from 0
    assert cursor.starts(["a"], np.array([5]), budget=100) == [0]
    cursor.forget(["a"])
    assert cursor.starts(["a"], np.array([12]), budget=100) == [0]
    # the catch-up a run would price: tokens read beyond the newest one
    assert cursor.behind(["a", "b", "c"], np.array([12, 13, 4])) == [11, 5, 3]


def test_accepted_draft_tokens_that_a_decode_pass_read_are_not_read_again():
    """Decode pass j wrote the draft KV of draft token j's position: once the target
    accepts the token, the next first pass starts after it (the newest token, plus any
    accepted beyond the passes run); a row that verified another proposer's tokens
    (ahead 0), a step whose drafts went unverified, or a restarted request, re-read."""
    cursor = DraftKVCursor()
    cursor.advance(["a", "b", "c", "d"], np.array([10, 20, 30, 40]))  # the first pass
    # 3 decode passes ran; "a" sent 4 tokens (3 read by a pass), "b" 2, "c" another's 3
    cursor.drafted(["a", "b", "c", "d"], [3, 2, 0, 3])
    # verified: "a" accepted all 4 (+1 bonus), "b" 1 of 2, "c" 3 (not the draft's), "d" 0
    cursor.accepted(["a", "b", "c", "d"], [4, 1, 3, 0])
    now = np.array([15, 22, 34, 41])  # context lengths, newest token included
    assert cursor.starts(["a", "b", "c", "d"], now, budget=100) == [13, 21, 30, 40]
    assert cursor.behind(["a", "b", "c", "d"], now) == [1, 0, 3, 0]
    # the same run's passes are not counted twice
    cursor.accepted(["a"], [4])
    assert cursor.starts(["a"], np.array([15]), budget=100) == [13]
    # drafts that were never verified teach nothing
    cursor.advance(["a"], np.array([15]))
    cursor.drafted(["a"], [3])
    cursor.forget_pending()
    cursor.accepted(["a"], [3])
    assert cursor.starts(["a"], np.array([19]), budget=100) == [15]
    # a restarted request's KV is gone, passes and all
    cursor.drafted(["a"], [3])
    cursor.forget(["a"])
    cursor.accepted(["a"], [3])
    assert cursor.starts(["a"], np.array([19]), budget=100) == [0]


def test_draft_tokens_follow_the_draft_probabilities_they_return():
    """Lossless verification needs the token drawn from exactly the returned distribution:
    chi-square over 40,000 draws, at two temperatures, with a token of probability 0."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, -float("inf"), 0.0, -1.0, 3.0, -3.0])
    for temp, all_sampled, unit in ((1.0, False, False), (0.7, False, False),
                                    (0.7, True, False), (1.0, True, True)):
        num_rows = 40_000
        token_ids, confidence, draft_probs = sample_draft_tokens(
            logits.expand(num_rows, -1), torch.full((num_rows,), temp),
            torch.ones(num_rows, dtype=torch.bool), generator, all_sampled=all_sampled,
            unit_temperature=unit)
        expected = (logits / temp).softmax(-1)
        torch.testing.assert_close(draft_probs[0], expected)
        counts = torch.bincount(token_ids, minlength=logits.numel())
        assert counts[3] == 0  # probability 0: never drawn
        assert chi_square_gof(counts, expected).p_value > 1e-3
        assert confidence[:3] == pytest.approx([float(expected.max())] * 3)


def test_the_compiled_draw_is_the_inverse_cdf_draw():
    """On CPU the draw, the greedy rows' argmax and the confidence come from one compiled
    pass (``host_kernels.draw_rows``): the same tokens as :func:`inverse_cdf_draw` and
    torch's argmax from the same uniforms, each row's top probability, and the tokens
    again as int32 where the next forward's input ids are asked for."""
    generator = torch.Generator().manual_seed(4)
    for vocab_size in (5, 300, 6144):
        logits = torch.randn(64, vocab_size, generator=generator) * 3
        logits[::5, :vocab_size // 2] = -float("inf")  # leading tokens of probability 0
        sampled = torch.rand(64, generator=generator) < 0.7
        uniform = draft_uniforms((64, 1), "cpu", generator)
        uniform[::7] = 1.0
        next_ids = np.full(64, -1, dtype=np.int32)
        token_ids, confidence, probs = sample_draft_tokens(
            logits, torch.ones(64), sampled, uniform=uniform.numpy(), next_ids=next_ids)
        want = torch.where(sampled, inverse_cdf_draw(probs, uniform), probs.argmax(dim=-1))
        assert token_ids.tolist() == want.tolist()
        assert next_ids.tolist() == want.tolist()
        assert confidence == probs.amax(dim=-1).tolist()


def test_the_host_draws_softmax_is_torchs_within_float_rounding():
    """With float32 logits on the host the softmax is in the draw's compiled pass
    (``host_kernels.softmax_draw_rows``, its exponential a polynomial): each row's
    probabilities are ``softmax(logits / temperature)`` (greedy rows' at temperature 1)
    within 1e-5 of each entry, a ``-inf`` logit's exactly 0, each row sums to 1, and the
    confidence is the row's top probability."""
    generator = torch.Generator().manual_seed(11)
    for vocab_size in (3, 64, 65, 6144):
        logits = torch.randn(6, vocab_size, generator=generator) * 6
        logits[1, : vocab_size // 2] = -float("inf")
        logits[2] += 90.0  # (large logits: the top is taken out first)
        temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.5])
        sampled = temperature > 0
        _, confidence, probs = sample_draft_tokens(logits, temperature, sampled,
                                                   uniform=np.full(6, 0.5))
        scale = torch.where(sampled, temperature, torch.ones_like(temperature))
        want = (logits / scale[:, None]).softmax(dim=-1)
        assert torch.allclose(probs, want, rtol=1e-5, atol=1e-7)
        assert bool((probs[1, : vocab_size // 2] == 0).all())
        assert torch.allclose(probs.sum(dim=-1), torch.ones(6), atol=1e-5)
        assert confidence == probs.amax(dim=-1).tolist()


def test_a_blocked_draw_at_a_blocks_edge_never_lands_on_a_token_of_no_mass():
    """The host draw sums its weights block by block (``host_kernels._blocked_draw``):
    where a target falls on a block's edge, the rounding of the block sums must not hand
    the draw to the zero-weight tokens that open the next block."""
    from specplugin import host_kernels

    rng = np.random.default_rng(0)
    for _ in range(300):
        vocab_size = int(rng.integers(65, 600))
        weights = (rng.random(vocab_size) ** 8).astype(np.float32)
        weights[rng.random(vocab_size) < 0.5] = 0
        edges = range(64, vocab_size, 64)
        for edge in edges:
            weights[edge:edge + 3] = 0
        total = weights.astype(np.float64).sum()
        for edge in edges:
            u = weights[:edge].astype(np.float64).sum() / total
            for point in (u, np.nextafter(u, 0), np.nextafter(u, 2)):
                if 0 < point <= 1:
                    assert weights[host_kernels._blocked_draw(weights, float(point))] > 0


def test_a_draw_at_either_end_of_its_uniforms_lands_on_a_token_that_can_be_drawn():
    """The uniforms are in (0, 1]: at 1 the draw is the last token of nonzero probability
    (never past the vocabulary, never a trailing token of probability 0), near 0 the
    first one (never a leading token of probability 0)."""
    inf = float("inf")
    logits = torch.tensor([[-inf, 1.0, 0.0, -inf, 2.0, -inf, -inf]]).expand(3, -1)
    uniform = torch.tensor([[1.0], [1e-300], [0.5]], dtype=torch.float64)
    token_ids, _, draft_probs = sample_draft_tokens(
        logits, torch.ones(3), None, all_sampled=True, unit_temperature=True, uniform=uniform)
    assert token_ids.tolist()[:2] == [4, 1]
    assert draft_probs[torch.arange(3), token_ids].gt(0).all()
    # the run's uniforms are 1 - U[0, 1): never 0
    uniforms = draft_uniforms((1000, 1), "cpu", torch.Generator().manual_seed(3))
    torch.testing.assert_close(uniforms, 1 - torch.rand(
        (1000, 1), dtype=torch.float64, generator=torch.Generator().manual_seed(3)))


def test_the_uniform_pool_hands_out_each_value_once_and_draws_again_when_it_runs_out():
    """A draft run's uniforms are slices of a block drawn ahead: no value is handed out
    twice (draws that shared a uniform would not be independent), in the block's order,
    and a block that runs out is replaced by a fresh one."""
    pool = UniformPool("cpu", size=10, generator=torch.Generator().manual_seed(5))
    want = 1 - torch.rand((10,), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    first, second = pool.take((2, 3, 1)), pool.take((4,))
    assert first.shape == (2, 3, 1) and second.shape == (4,)
    torch.testing.assert_close(torch.cat([first.flatten(), second]), want)
    third = pool.take((3,))  # 3 more than the block has left: a new block
    assert not any(v in want.tolist() for v in third.tolist())
    big = pool.take((25,))  # more than a block: a block of that size
    assert big.shape == (25,) and bool(((big > 0) & (big <= 1)).all())
    assert len(set(big.tolist()) | set(third.tolist())) == 28
    # numpy views of the same stream (the CPU's compiled draws read them)
    pool = UniformPool("cpu", size=10, generator=torch.Generator().manual_seed(5))
    first, second = pool.take_host((2, 3, 1)), pool.take((4,))
    assert isinstance(first, np.ndarray) and first.shape == (2, 3, 1)
    assert np.concatenate([first.ravel(), second.numpy()]).tolist() == want.tolist()
    assert not set(pool.take_host((3,)).tolist()) & set(want.tolist())  # a new block


def test_greedy_rows_draft_the_argmax_beside_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    sampled = torch.tensor([False, True])
    draws = {int(sample_draft_tokens(logits, torch.tensor([0.0, 50.0]), sampled)[0][1])
             for _ in range(50)}
    assert len(draws) > 1  # temperature 50 is nearly uniform
    for _ in range(20):
        assert int(sample_draft_tokens(logits, torch.tensor([0.0, 50.0]), sampled)[0][0]) == 1


# ------------------------------------------------------------------ settings


def test_draft_settings_parse_and_default():
    from specplugin.zoo import zoo_path

    draft = str(zoo_path("draft"))
    config = parse({"proposers": ["draft"], "draft_model": draft,
                    "draft": {"k": 3, "min_acceptance": 0.5}}, 8)
    assert config.draft == DraftSettings(k=3, min_acceptance=0.5)
    assert parse({"proposers": ["draft"], "draft_model": draft}, 8).draft == DraftSettings()


@pytest.mark.parametrize("options, fragment", [
    ({"proposers": ["draft"]}, 'lists \'draft\' but additional_config["specplugin"]["draft_model"] is not set'),
    ({"proposers": ["draft"], "DRAFT": {}}, "unknown key 'DRAFT'"),
    ({"draft": {"k": 0}}, '["draft"]["k"] must be an integer from 1 to 32'),
    ({"draft": {"min_acceptance": 1.5}}, '["draft"]["min_acceptance"] must be a number from 0 to 1'),
    ({"draft": {"kk": 2}}, "unknown key(s) ['kk']"),
])
def test_bad_draft_settings_name_the_key(options, fragment):
    with pytest.raises(SpecPluginConfigError) as err:
        parse(options, 8)
    assert fragment in str(err.value)


def _tokenizer_folder(path, vocab: dict[str, int]):
    from tokenizers import Tokenizer, models

    path.mkdir()
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(path)


def test_shared_vocabulary_passes_for_equal_tokenizers_and_names_a_mismatch(tmp_path):
    vocab = {"<unk>": 0, "a": 1, "b": 2}
    target = _tokenizer_folder(tmp_path / "target", vocab)
    same = _tokenizer_folder(tmp_path / "same", vocab)
    swapped = _tokenizer_folder(tmp_path / "swapped", {"<unk>": 0, "a": 2, "b": 1})
    check_shared_vocabulary(target, same, 3, 3)
    with pytest.raises(SpecPluginConfigError, match="numbers tokens differently"):
        check_shared_vocabulary(target, swapped, 3, 3)
    with pytest.raises(SpecPluginConfigError, match="vocabulary of 5 tokens but the target has 3"):
        check_shared_vocabulary(target, same, 3, 5)


def test_the_draft_runs_catch_up_is_priced_by_the_rows_it_reads():
    """``draft_prices``: before anything was timed, a forward at the parameter ratio of
    the target's, nothing fixed, and each row's catch-up in proportion to the tokens it
    reads, at the target's forward curve scaled by what one draft forward costs against
    the target's for as many rows. Once timed, the measured prices: a cold pass's fixed
    part and price per token, or a warm one's (the draft ran in the step before), and
    the warm run's fixed part beside a cold one's."""
    from specplugin.adaptive.cost import StepCostModel
    from specplugin.adaptive.draft_rule import draft_prices

    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 64]), np.array([0.005, 0.068]))  # 1 ms per extra token
    costs = CostModel()
    behind = [1, 20]  # rows read 1 and 20 tokens beyond their newest
    price = draft_prices(costs, cost, 2, behind, False, lambda: 0.5)  # the draft: half
    assert price.forward_s == pytest.approx(0.5 * cost.forward_one(2))
    assert price.run_s == 0.0 and price.catch_up_s == pytest.approx([0.0005, 0.010])
    assert price.warm_run_s is None
    assert draft_prices(costs, StepCostModel(), 2, behind, False, lambda: 0.5).catch_up_s == [
        0.0, 0.0]  # no curve timed: nothing priced
    # timed cold passes: 2.3 ms + 10 us per catch-up token; warm ones: 0.7 ms (after the
    # engine's first forwards, which pay one-time costs)
    costs.observe_first_pass(0.05, 200, warm=False)
    assert costs.first_pass_price(False, 0.0) is None
    for _ in range(WARMUP_FORWARDS + 1):
        costs.observe_forward(0.0005)
    for tokens in (4, 40, 210, 20):
        costs.observe_first_pass(0.0023 + 1e-5 * tokens, tokens, warm=False)
    costs.observe_first_pass(0.0007, 2, warm=True)
    price = draft_prices(costs, cost, 2, behind, False, lambda: 0.5)
    assert price.forward_s == pytest.approx(0.0005)
    assert price.run_s == pytest.approx(0.0018) and price.catch_up_s == pytest.approx([1e-5, 2e-4])
    assert price.warm_run_s == pytest.approx(0.0002)
    price = draft_prices(costs, cost, 2, behind, True, lambda: 0.5)
    assert price.run_s == pytest.approx(0.0002) and price.catch_up_s == pytest.approx([1e-5, 2e-4])
    assert price.warm_run_s is None


def test_a_cold_runs_first_decode_pass_is_priced_with_its_run_not_as_a_forward():
    """The first decode pass after steps without the draft runs on swept caches: its time
    is not the forward's price (one such pass in a fresh engine priced the draft out for
    good); its excess over that price joins the cold run's first pass. Warm runs' passes,
    and a cold run's later ones, teach the forward's price."""
    from types import SimpleNamespace

    from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

    drafter = object.__new__(PluginDraftProposer)
    drafter.clock, drafter.costs = SimpleNamespace(shared=False), CostModel()
    for _ in range(WARMUP_FORWARDS + 1):
        drafter.costs.observe_forward(0.002)
    assert drafter.costs.draft_forward_s == pytest.approx(0.002)
    drafter._observe_decode_pass(0.006, cold_first_pass=(0.003, 0))  # a cold run's first
    assert drafter.costs.draft_forward_s == pytest.approx(0.002)
    # the first pass (3 ms) plus the pass's excess (4 ms), as the cold price
    assert drafter.costs.first_pass_price(False, 0.0) == pytest.approx((0.007, 0.0))
    drafter._observe_decode_pass(0.004, cold_first_pass=None)  # its later pass, or a warm run's
    assert drafter.costs.draft_forward_s > 0.002


def test_first_passes_of_alike_sizes_are_priced_through_their_mean():
    """Timed cold first passes that all read about as many tokens give no slope: the
    price per token is the prior's, and the fixed part what the mean leaves over."""
    costs = CostModel()
    for _ in range(WARMUP_FORWARDS + 1):
        costs.observe_forward(0.0005)
    assert costs.first_pass_price(False, 1e-4) is None
    assert costs.first_pass_price(True, 1e-4) is None
    for _ in range(5):
        costs.observe_first_pass(0.003, 10, warm=False)
    assert costs.first_pass_price(False, 1e-4) == pytest.approx((0.002, 1e-4))
    assert costs.first_pass_price(False, 1e-3) == pytest.approx((0.0, 1e-3))  # never below 0
    assert costs.first_pass_price(True, 1e-4) is None  # warm passes learned apart
    costs.observe_first_pass(1.0, 10, warm=False)  # a stall counts 4x the running price
    assert costs.first_pass_price(False, 0.0)[0] == pytest.approx(0.003 + 0.009 / 6)


@pytest.mark.parametrize("max_model_len", [40, 400])
def test_the_decode_passes_inputs_are_vllms_update_pass_after_pass(max_model_len):
    """The run's decode passes take their positions, slots and sequence lengths from one
    computation (``decode_passes``) in place of vLLM's update per pass: the same values,
    pass after pass; a row that runs past ``max_model_len`` reads position 0 into the
    padding slot with a sequence of 1 from then on (vLLM's update, which restarts such a
    row from position 1, is compared only before that). With a long ``max_model_len``
    no row reaches it (the usual case, computed without the limit's masks)."""
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode.llm_base_proposer import PADDING_SLOT_ID
    from vllm.v1.spec_decode.utils import eagle_step_update_slot_mapping_and_metadata

    current_platform.register_triton_kernel_overrides()  # as an engine does (CPU: C++)

    from specplugin.vllm_layer.draft_inputs import DecodePassBuffers, decode_passes

    block_size, num_passes = 4, 6
    rng = np.random.default_rng(0)
    max_blocks = max_model_len // block_size  # (vLLM's: enough for max_model_len)
    block_table = torch.from_numpy(
        rng.permutation(2000)[:3 * max_blocks].reshape(3, max_blocks).astype(np.int32))
    ends = np.array([5, 17, 37])  # the last row passes max_model_len at its 4th pass
    passes = decode_passes(block_table, ends, num_passes, block_size, max_model_len)
    positions = torch.from_numpy(ends - 1)
    seq_lens = torch.from_numpy(ends.astype(np.int32))
    for j in range(num_passes):
        out_positions = torch.empty(3, dtype=torch.int64)
        out_slots = torch.empty(3, dtype=torch.int64)
        eagle_step_update_slot_mapping_and_metadata(
            positions, block_table, seq_lens, block_size, max_model_len, out_positions,
            out_slots)
        positions = out_positions
        live = slice(0, 3) if ends[2] + j < max_model_len else slice(0, 2)
        assert passes.positions[j, live].tolist() == out_positions[live].tolist(), j
        assert passes.slots[j, live].tolist() == out_slots[live].tolist(), j
        assert passes.seq_lens[j, live].tolist() == seq_lens[live].tolist(), j
        assert passes.seq_lens_cpu[j].tolist() == passes.seq_lens[j].tolist()
    # a padded forward's dummy rows read position 0 into the padding slot, every pass
    padded = decode_passes(block_table, ends, num_passes, block_size, max_model_len, 5)
    assert torch.equal(padded.positions[:, :3], passes.positions)
    assert torch.equal(padded.slots[:, :3], passes.slots)
    assert padded.positions[:, 3:].eq(0).all() and padded.slots[:, 3:].eq(PADDING_SLOT_ID).all()
    # kept from run to run (DecodePassBuffers): the same values, after another run of
    # the same shape wrote other ones; each pass's views are its rows
    kept = DecodePassBuffers(["layer.0", "layer.1"])
    decode_passes(block_table, ends + 1, num_passes, block_size, max_model_len, 5, kept)
    again = decode_passes(block_table, ends, num_passes, block_size, max_model_len, 5, kept)
    for field in ("positions", "slots", "seq_lens", "seq_lens_cpu"):
        assert torch.equal(getattr(again, field), getattr(padded, field)), field
    for j, views in enumerate(again.views):
        assert torch.equal(views.positions, padded.positions[j])
        assert torch.equal(views.slots, padded.slots[j, :3])
        assert torch.equal(views.seq_lens, padded.seq_lens[j])
        assert list(views.slot_mapping) == ["layer.0", "layer.1"]
        assert all(torch.equal(s, padded.slots[j]) for s in views.slot_mapping.values())
    past = ends[2] - 1 + np.arange(1, num_passes + 1) >= max_model_len
    if max_model_len > 100:
        assert not past.any()
        return
    assert past.any() and not past.all()
    assert passes.slots[past, 2].eq(PADDING_SLOT_ID).all()
    assert passes.positions[past, 2].eq(0).all() and passes.seq_lens[past, 2].eq(1).all()


def _vllms_rejection_sample(draft_ids, draft_probs, target_logits, bonus_id: int):
    """vLLM's ``rejection_sample`` on its CPU kernels, with the plugin's wrapper installed
    and its runner sampling (``verification.recovering``): one draft token per request,
    every request at temperature 1, no seeds. [num_reqs, 2] output token ids."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from specplugin.vllm_layer import verification

    current_platform.register_triton_kernel_overrides()  # as an engine does (CPU: C++)
    verification.install()
    num_reqs = draft_ids.shape[0]
    metadata = SimpleNamespace(all_greedy=False, all_random=True, generators={},
                               temperature=torch.ones(num_reqs))
    with verification.recovering():
        return rejection_sampler.rejection_sample(
            draft_ids, [1] * num_reqs, 1, torch.arange(1, num_reqs + 1, dtype=torch.int32),
            draft_probs, target_logits.expand(num_reqs, -1).contiguous(),
            torch.full((num_reqs, 1), bonus_id, dtype=torch.int32), metadata)


@pytest.mark.parametrize("one_hot", [False, True])
def test_vllms_rejection_sampler_with_the_plugins_recovered_draw_follows_the_target(
        one_hot, monkeypatch):
    """vLLM's ``rejection_sample`` (its CPU kernels), with the plugin's runner sampling
    (``verification.recovering``): the recovered tokens come from the plugin's draw, and
    the emitted token follows the target's distribution (chi-square over 20,000 requests
    of one draft token each, drawn from a draft distribution far from the target's, or a
    fixed guess). Red if a recovered token came from the target itself or from the draft
    token's own residual with the wrong sign."""
    from specplugin.vllm_layer import verification

    generator = torch.Generator().manual_seed(5)
    target = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    draft = torch.tensor([0.5, 0.1, 0.0, 0.1, 0.3])
    num_reqs = 20_000
    if one_hot:  # every request guesses token 1 (half of its draws are rejected)
        draft_ids, draft_probs = torch.full((num_reqs,), 1, dtype=torch.int32), None
    else:
        draft_ids = torch.multinomial(draft, num_reqs, replacement=True,
                                      generator=generator).int()
        draft_probs = draft.expand(num_reqs, -1).contiguous()
    torch.manual_seed(6)
    called = []
    original = verification.draw_recovered
    monkeypatch.setattr(verification, "draw_recovered",
                        lambda *a: called.append(1) or original(*a))
    output = _vllms_rejection_sample(draft_ids, draft_probs, target.log(), bonus_id=4)
    assert called
    first = output[:, 0].long()
    counts = torch.bincount(first, minlength=target.numel())
    assert counts[2] == 0  # probability 0: never emitted
    assert chi_square_gof(counts, target).p_value > 1e-3


def test_a_failing_recovered_draw_falls_back_to_vllms(monkeypatch):
    """A bug in the plugin's recovered-token draw costs vLLM's slower draw, never the
    step: ``rejection_sample`` still returns every request's tokens; the failure is
    counted (this process's counter, replaced here so that no other test sees it)."""
    import logging

    from specplugin.metrics import FailureCounter
    from specplugin.vllm_layer import verification

    def broken(*args):
        raise RuntimeError("broken draw")

    monkeypatch.setattr(verification, "draw_recovered", broken)
    monkeypatch.setattr(verification, "DRAW_FAILURES",
                        FailureCounter("recovered draw", logging.getLogger("specplugin.test"),
                                       fallback="vLLM's own draw"))
    num_reqs = 4
    output = _vllms_rejection_sample(torch.zeros(num_reqs, dtype=torch.int32), None,
                                     torch.tensor([0.0, 1.0, 2.0]), bonus_id=2)
    assert output.shape == (num_reqs, 2)
    assert output[:, 0].ge(0).all() and output[:, 0].lt(3).all()
    assert verification.failures() == {"recovered draw": 1}


def test_sampled_rows_read_the_batchs_host_temperatures():
    """Greedy rows hold temperature 0 in vLLM's input batch (-1 never occurs, but reads as
    greedy too); rows past ``num_reqs`` are not read."""
    from types import SimpleNamespace

    import numpy as np

    from specplugin.vllm_layer.draft_inputs import sampled_rows

    batch = SimpleNamespace(temperature_cpu=np.array([0.0, 1.0, 0.7, -1.0, 1.0], np.float32))
    assert sampled_rows(batch, 4).tolist() == [False, True, True, False]


def _idle_processor(cls, state: str, value):
    processor = object.__new__(cls)  # (no engine config: only its state is read)
    setattr(processor, state, value)
    return processor


def test_the_greedy_shortcut_emits_what_vllms_rejection_sampler_does():
    """An all-greedy speculative step verified by the plugin (``verify_greedy``) emits
    exactly vLLM's rejection sampler's tokens (its CPU kernels), placeholders included:
    random batches with rows of 0 to 6 draft tokens, drafts half of them the argmax,
    integer logits for ties; vLLM's idle built-in processors (logit bias, minimum tokens)
    do not stop it."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinTokensLogitsProcessor)
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from specplugin.vllm_layer import verification

    current_platform.register_triton_kernel_overrides()  # as an engine does (CPU: C++)
    vllms = RejectionSampler(Sampler())
    idle = LogitsProcessors([_idle_processor(LogitBiasLogitsProcessor, "biases", {}),
                             _idle_processor(MinTokensLogitsProcessor, "min_toks", {})])
    generator = torch.Generator().manual_seed(3)
    before = verification.greedy_steps()
    for trial in range(60):
        num_reqs = int(torch.randint(1, 6, (1,), generator=generator))
        counts = torch.randint(0, 7, (num_reqs,), generator=generator).tolist()
        counts[0] = max(counts[0], 1)  # (a speculative step: some row has drafts)
        vocab = int(torch.randint(3, 40, (1,), generator=generator))
        logits = (torch.randint(0, 3, (sum(counts) + num_reqs, vocab), generator=generator).float()
                  if trial % 2 else torch.randn(sum(counts) + num_reqs, vocab, generator=generator))
        best, drafts, row = logits.argmax(-1).tolist(), [], 0
        for k in counts:
            drafts.append([best[row + j] if torch.rand(1, generator=generator) < 0.6
                           else int(torch.randint(vocab, (1,), generator=generator))
                           for j in range(k)])
            row += k + 1
        metadata = spec_decode_metadata(drafts)
        sampling = greedy_sampling_metadata(num_reqs, logitsprocs=idle)
        want = vllms(metadata, None, logits.clone(), sampling).sampled_token_ids
        got = verification.verify_greedy(logits, metadata, sampling, vllms)
        assert got is not None and got.logprobs_tensors is None
        assert got.sampled_token_ids.dtype == want.dtype
        assert got.sampled_token_ids.tolist() == want.tolist(), (counts, drafts)
    assert verification.greedy_steps() == before + 60


def test_the_greedy_shortcut_leaves_to_vllm_every_batch_it_does_not_cover():
    """Anything vLLM's samplers apply before the argmax or return beside it sends the
    step to vLLM's rejection sampler: a sampled request, logprobs, penalties, allowed or
    bad words, a logit bias or minimum tokens in use, a logits processor the plugin does
    not know, synthetic acceptance."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    from specplugin.vllm_layer import verification

    metadata = spec_decode_metadata([[1, 2], [3]])
    logits = torch.randn(5, 8)
    sampler = SimpleNamespace(synthetic_mode=False)
    assert verification.verify_greedy(logits, metadata, greedy_sampling_metadata(2),
                                      sampler) is not None

    class Custom:
        pass

    for changes in (
            {"all_greedy": False, "temperature": torch.ones(2)},
            {"max_num_logprobs": 0},
            {"logprob_token_ids": {0: [1]}},
            {"no_penalties": False},
            {"allowed_token_ids_mask": torch.zeros(2, 8, dtype=torch.bool)},
            {"bad_words_token_ids": {0: [[1]]}},
            {"logitsprocs": LogitsProcessors(
                [_idle_processor(LogitBiasLogitsProcessor, "biases", {0: {1: 5.0}})])},
            {"logitsprocs": LogitsProcessors([_idle_processor(
                MinTokensLogitsProcessor, "min_toks", {0: (4, [], set(), False)})])},
    ):
        assert verification.verify_greedy(
            logits, metadata, greedy_sampling_metadata(2, **changes), sampler) is None, changes
    unknown = LogitsProcessors()
    unknown.non_argmax_invariant.append(Custom())
    assert verification.verify_greedy(
        logits, metadata, greedy_sampling_metadata(2, logitsprocs=unknown), sampler) is None
    assert verification.verify_greedy(logits, metadata, greedy_sampling_metadata(2),
                                      SimpleNamespace(synthetic_mode=True)) is None


def _sampled_metadata(temperature: torch.Tensor, **changes):
    """vLLM's ``SamplingMetadata`` of a batch that samples at ``temperature`` ([num_reqs],
    0 for a greedy request), asking for nothing else."""
    num_reqs = temperature.shape[0]
    return greedy_sampling_metadata(num_reqs, all_greedy=False,
                                    all_random=bool((temperature > 0).all()),
                                    temperature=temperature, **changes)


@pytest.mark.parametrize("one_hot", [False, True])
def test_the_sampled_shortcut_follows_the_target_through_vllms_metadata(one_hot):
    """A sampled speculative step verified by the plugin (``verify_sampled``, from vLLM's
    ``SpecDecodeMetadata`` and ``SamplingMetadata``): 20,000 requests of one draft token
    each (drawn from a draft distribution far from the target's, or a fixed guess), at
    temperature 0.5 on logits that make the target's distribution known there, a greedy
    request among them: the sampled requests' first token follows the target (chi-square),
    a token of probability 0 never comes, the greedy request emits the argmax, and the
    learners hear each draft token's expected acceptance."""
    from specplugin.vllm_layer import verification

    generator = torch.Generator().manual_seed(5)
    target = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    draft = torch.tensor([0.5, 0.1, 0.0, 0.1, 0.3])
    num_reqs, temperature = 20_000, 0.5
    if one_hot:  # every request guesses token 1 (half of its draws are rejected)
        draft_ids, draft_probs = torch.full((num_reqs,), 1, dtype=torch.long), None
    else:
        draft_ids = torch.multinomial(draft, num_reqs, replacement=True, generator=generator)
        draft_probs = draft.expand(num_reqs, -1).contiguous()
    metadata = spec_decode_metadata([[t] for t in draft_ids.tolist()])
    temperatures = torch.full((num_reqs,), temperature)
    temperatures[7] = 0.0  # a greedy request: the argmax (token 1), whatever its draft
    logits = (temperature * target.log()).expand(2 * num_reqs, -1).contiguous()
    heard = verification.Heard()
    before = verification.sampled_steps()
    output = verification.verify_sampled(logits, metadata, _sampled_metadata(temperatures),
                                         draft_probs, heard)
    assert output is not None and verification.sampled_steps() == before + 1
    tokens = output.sampled_token_ids
    assert tokens.dtype == torch.int32 and tokens.shape == (num_reqs, 2)
    assert tokens[7].tolist() == ([1, 1] if draft_ids[7] == 1 else [1, -1])
    first = torch.cat([tokens[:7, 0], tokens[8:, 0]]).long()
    counts = torch.bincount(first, minlength=target.numel())
    assert counts[2] == 0  # probability 0: never emitted
    assert chi_square_gof(counts, target).p_value > 1e-3
    want = (torch.minimum(target, draft).sum() if draft_probs is not None else target[1])
    assert heard.values.shape == (num_reqs,) and torch.allclose(heard.values[:7], want)


def test_the_sampled_shortcut_leaves_to_vllm_every_batch_it_does_not_cover():
    """Anything that changes a sampled request's distribution beyond its temperature, or
    that vLLM returns beside the tokens, sends the step to vLLM's rejection sampler: an
    all-greedy batch (the greedy shortcut's), top-k, top-p, a seeded request, logprobs,
    penalties, bad words, min-p or a logit bias in use, a processor the plugin does not
    know, synthetic acceptance."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor)

    from specplugin.vllm_layer import verification

    logits, sampler = torch.randn(5, 8), SimpleNamespace(synthetic_mode=False)
    temperatures = torch.tensor([1.0, 0.0])
    idle = LogitsProcessors([_idle_processor(MinPLogitsProcessor, "min_p_count", 0),
                             _idle_processor(LogitBiasLogitsProcessor, "biases", {})])
    assert verification.plainly_sampled(
        logits, _sampled_metadata(temperatures, logitsprocs=idle), sampler)

    class Custom:
        pass

    unknown = LogitsProcessors()
    unknown.argmax_invariant.append(Custom())
    for changes in (
            {"top_k": torch.tensor([5, 5])}, {"top_p": torch.tensor([0.9, 1.0])},
            {"generators": {0: torch.Generator()}}, {"max_num_logprobs": 0},
            {"no_penalties": False}, {"bad_words_token_ids": {0: [[1]]}},
            {"logitsprocs": LogitsProcessors(
                [_idle_processor(MinPLogitsProcessor, "min_p_count", 1)])},
            {"logitsprocs": LogitsProcessors(
                [_idle_processor(LogitBiasLogitsProcessor, "biases", {0: {1: 5.0}})])},
            {"logitsprocs": unknown},
    ):
        assert not verification.plainly_sampled(
            logits, _sampled_metadata(temperatures, **changes), sampler), changes
    assert not verification.plainly_sampled(logits, greedy_sampling_metadata(2), sampler)
    assert not verification.plainly_sampled(logits, _sampled_metadata(temperatures),
                                            SimpleNamespace(synthetic_mode=True))


def test_a_failing_sampled_shortcut_falls_back_to_vllms_sampler(monkeypatch):
    """A failing host-side verification costs the step the shortcut (``verify_sampled``
    returns None: the runner calls vLLM's rejection sampler), counted."""
    import logging

    from specplugin.metrics import FailureCounter
    from specplugin.vllm_layer import verification

    counter = FailureCounter("sampled verification", logging.getLogger("specplugin.test"),
                             fallback="vLLM's rejection sampler")
    monkeypatch.setattr(verification, "SAMPLED_FAILURES", counter)
    monkeypatch.setattr(verification, "sampled_verify", lambda *a: 1 / 0)
    metadata, logits = spec_decode_metadata([[1, 2], [3]]), torch.randn(5, 8)
    assert verification.verify_sampled(logits, metadata, _sampled_metadata(torch.ones(2)),
                                       None, verification.Heard()) is None
    assert counter.count == 1


def test_a_failing_greedy_shortcut_falls_back_to_vllms_sampler(monkeypatch):
    """Metadata the shortcut cannot read (a field vLLM renamed) or a failing verification
    costs the step the shortcut, never the request: ``verify_greedy`` returns None (the
    runner then calls vLLM's rejection sampler) and the failure is counted."""
    import logging
    from types import SimpleNamespace

    from specplugin.metrics import FailureCounter
    from specplugin.vllm_layer import verification

    counter = FailureCounter("greedy verification", logging.getLogger("specplugin.test"),
                             fallback="vLLM's rejection sampler")
    monkeypatch.setattr(verification, "GREEDY_FAILURES", counter)
    metadata, logits = spec_decode_metadata([[1, 2], [3]]), torch.randn(5, 8)
    sampler = SimpleNamespace(synthetic_mode=False)
    renamed = SimpleNamespace(all_greedy=True)  # none of the other fields
    assert verification.verify_greedy(logits, metadata, renamed, sampler) is None
    monkeypatch.setattr(verification, "greedy_verify", lambda *a: 1 / 0)
    assert verification.verify_greedy(logits, metadata, greedy_sampling_metadata(2),
                                      sampler) is None
    assert counter.count == 2


def test_vllms_padding_is_kept_per_token_count_only_without_data_parallelism():
    """``_padding``: vLLM's padding of a draft forward is a function of the token count
    when one data-parallel rank runs (asked once per count); with several, the ranks
    agree on it every time, so it is asked every time."""
    from types import SimpleNamespace

    from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

    for data_parallel_size, expected_calls in ((1, [8, 3]), (2, [8, 8, 3])):
        calls = []

        def determine(num_tokens):
            calls.append(num_tokens)
            return ("none", num_tokens + 1, None)

        drafter = SimpleNamespace(
            vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
                data_parallel_size=data_parallel_size)),
            _paddings={}, _determine_batch_execution_and_padding=determine)
        assert PluginDraftProposer._padding(drafter, 8) == ("none", 9, None)
        assert PluginDraftProposer._padding(drafter, 8) == ("none", 9, None)
        assert PluginDraftProposer._padding(drafter, 3) == ("none", 4, None)
        assert calls == expected_calls, data_parallel_size


def test_the_draft_models_arbiter_learns_foretold_plain_steps_as_if_it_had_decided_each():
    """The draft model alone (a union of one) with its step arbiter: steps its arbiter
    foretells plain run as vLLM's own, and the drafter learns their times before its next
    decision (``learn_plain_steps``): its arbiter, cost model and counters end where
    deciding every step would have left them, and most plain steps were foretold."""
    from types import SimpleNamespace

    from specplugin.adaptive.arbiter import StepArbiter
    from specplugin.adaptive.cost import StepCostModel
    from specplugin.adaptive.union import Union
    from specplugin.metrics import FailureCounter
    from specplugin.proposers.draft import DraftCandidates
    from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

    class Laps:  # the drafter's clock: a speculative step takes 4x a plain one (noisy)
        def __init__(self):
            self.noise = iter(np.random.default_rng(0).uniform(0.9, 1.1, 700))
            self.speculating = True

        def lap(self):
            return (0.04 if self.speculating else 0.01) * next(self.noise)

    def drafter():
        d = object.__new__(PluginDraftProposer)
        d.clock, d.timer = SimpleNamespace(shared=False), Laps()
        d.union = Union([DraftCandidates()], cost=StepCostModel(max_tokens=64),
                        arbiter=StepArbiter())
        d.costs, d.proposer_stats = d.union.draft_costs, d.union.stats
        d.failures = FailureCounter("draft", None)
        d._last_forwards = d._last_draft_tokens = 0
        d._last_draft_seconds, d._steps_since_run = 0.0, 2
        d.outcomes, d.cursor = SimpleNamespace(forget=lambda: None), SimpleNamespace(
            forget_pending=lambda: None)
        d.background, d._held_jobs = d.union.background, []
        d.plugin_runner = SimpleNamespace(peek_batch=None)  # (no token-level proposer peeks)
        return d

    each, ahead = drafter(), drafter()
    for _ in range(600):
        each.timer.speculating = not each.skip_drafting(4, 4, False)
    foretold, left, times = 0, 0, []  # (times: what the runner keeps of those steps)
    for _ in range(600):
        if left:
            times.append(ahead.timer.lap())
            left -= 1
            foretold += 1
            continue
        ahead.learn_plain_steps(times, 4)
        times = []
        plain = ahead.skip_drafting(4, 4, False)
        ahead.timer.speculating = not plain
        left = ahead.plain_steps_ahead() if plain else 0
    ahead.learn_plain_steps(times, 4)
    models = {"plain_rate_model": None, "step_seconds_model": None}
    assert vars(each.union.arbiter) | models == vars(ahead.union.arbiter) | models
    assert each.proposer_stats.as_dict() == ahead.proposer_stats.as_dict()
    assert each._steps_since_run == ahead._steps_since_run
    assert each.costs.thresholds() == ahead.costs.thresholds()
    assert vars(each.costs._plain_sums) == vars(ahead.costs._plain_sums)
    assert foretold > 0.6 * ahead.proposer_stats.steps_skipped > 200


def test_the_first_pass_copied_off_the_host_gives_padding_tokens_valid_ids_and_positions():
    """Where the first pass's inputs are copied into the forward's buffers
    (``FirstPassBuffers.host_arrays``, another device than the host), the padding tokens'
    ids and positions are 0, not what the allocator left there: all ``num_padded`` are
    copied, and a stray id or position would index out of range on the device."""
    from specplugin import host_kernels
    from specplugin.vllm_layer.draft_inputs import FirstPassBuffers

    num_padded, num_rows = 24, 1
    for _ in range(8):  # (memory the allocator will hand out again, full of stray values)
        np.full(num_padded, -(1 << 40), dtype=np.int64)
        np.full(num_padded, -(1 << 30), dtype=np.int32)
    host = FirstPassBuffers.host_arrays(num_padded, num_rows)
    token_ids = np.arange(40, dtype=np.int32).reshape(1, 40)
    block_table = np.arange(10, dtype=np.int32).reshape(1, 10)
    assert host_kernels.first_pass_inputs(np.array([0]), np.array([5]), np.array([9]),
                                          token_ids, block_table, 4, *host, num_padded,
                                          -1) == 4
    _, _, positions, input_ids, slots = host
    assert positions.tolist() == [5, 6, 7, 8] + [0] * 20
    assert input_ids.tolist() == [5, 6, 7, 8] + [0] * 20
    assert slots.tolist() == [5, 6, 7, 8] + [-1] * 20


def test_the_first_pass_reads_each_rows_positions_through_its_own_block_table():
    """The first pass's host inputs (``host_kernels.first_pass_inputs``): row ``rows[i]``
    reads positions ``[starts[i], ends[i])``, in turn; each token's id from its row of the
    token buffer and its KV slot through its row of the block table; the query lengths'
    running sums from 0 and each row's sequence length; the padding tokens' slots are the
    padding slot, and nothing past them is written."""
    from specplugin import host_kernels

    rng = np.random.default_rng(2)
    block_size, max_blocks, num_padded, pad = 4, 10, 12, -1
    token_ids = rng.integers(0, 5000, (6, 40)).astype(np.int32)
    block_table = rng.permutation(500)[:6 * max_blocks].reshape(6, max_blocks).astype(np.int32)
    rows, starts, ends = np.array([0, 2, 5]), np.array([3, 0, 38]), np.array([9, 1, 40])
    cu_query_lens, seq_lens = np.empty(4, dtype=np.int32), np.empty(3, dtype=np.int32)
    positions, slots = np.full(16, 7, dtype=np.int64), np.full(16, 7, dtype=np.int64)
    input_ids = np.full(16, 7, dtype=np.int32)
    assert host_kernels.first_pass_inputs(rows, starts, ends, token_ids, block_table,
                                          block_size, cu_query_lens, seq_lens, positions,
                                          input_ids, slots, num_padded, pad) == 9
    assert cu_query_lens.tolist() == [0, 6, 7, 9]
    assert seq_lens.tolist() == [9, 1, 40]
    want = [(r, p) for r, a, b in zip(rows, starts, ends) for p in range(a, b)]
    assert positions[:9].tolist() == [p for _, p in want]
    assert input_ids[:9].tolist() == [token_ids[r, p] for r, p in want]
    assert slots[:9].tolist() == [block_table[r, p // block_size] * block_size
                                  + p % block_size for r, p in want]
    assert slots[9:].tolist() == [pad] * 3 + [7] * 4
    assert positions[9:].tolist() == [7] * 7 and input_ids[9:].tolist() == [7] * 7

"""A plain step is a plain step: the union's cheap path for steps that verified no draft."""

import numpy as np
import pytest

from specplugin.adaptive.arbiter import PLAIN, SPECULATE, StepArbiter
from specplugin.adaptive.cost import StepTimer
from specplugin.adaptive.union import Union, Verified
from tests.test_adaptive import Fixed, _batch, flat_cost


class Scripted(StepArbiter):
    """An arbiter whose choices are given; it records what it was told."""

    def __init__(self, choices):
        super().__init__()
        self.choices, self.observed, self.asked = list(choices), [], 0

    def observe(self, num_tokens, seconds):
        self.observed.append((num_tokens, seconds))

    def speculate(self, num_reqs, sampled=False):
        self.asked += 1
        return self.choices.pop(0)


class Counting(Fixed):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        return super().propose(batch)


def _union(choices, proposer=None):
    proposer = proposer or Counting("p", [1, 2, 3], 0.9)
    return Union([proposer], cost=flat_cost(), explore=False, arbiter=Scripted(choices)), proposer


def _none_verified(n=2, seconds=0.01):
    return Verified(tuple(f"r{i}" for i in range(n)), np.zeros(n, dtype=int), np.ones(n, dtype=int),
                    seconds, n)


def test_a_plain_step_asks_no_proposer_and_counts_as_plain():
    union, proposer = _union([PLAIN, PLAIN])
    assert union.plain_step(0.01, 2, 2, False) is False
    assert union.plain_step(0.01, 2, 2, False) is False
    assert proposer.calls == 0
    assert union.arbiter.observed == [(2, 0.01), (2, 0.01)]
    assert union.stats.steps == 2 and union.stats.steps_without_drafts == 2
    assert union.stats.k_histogram[0] == 4


def test_a_step_observed_by_plain_step_is_not_observed_again_by_begin():
    union, proposer = _union([SPECULATE])
    assert union.plain_step(0.01, 2, 2, False) is True
    drafts = union.step(_batch(["r0", "r1"]), _none_verified(seconds=1e-6)).drafts
    assert union.arbiter.asked == 1 and len(union.arbiter.observed) == 1  # once, not twice
    assert proposer.calls == 1 and all(drafts)
    # the next begin observes and asks as usual again
    union.arbiter.choices.append(PLAIN)
    union.step(_batch(["r0", "r1"]), _none_verified())
    assert union.arbiter.asked == 2 and len(union.arbiter.observed) == 2


def test_drafts_waiting_for_their_verdict_always_take_the_full_path():
    union, _ = _union([SPECULATE])
    union.step(_batch(["r0"]), None)  # drafts sent: their verdict comes in the next step
    assert union._pending
    observed = len(union.arbiter.observed)
    assert union.plain_step(0.01, 1, 1, False) is True
    assert len(union.arbiter.observed) == observed  # the full path learns it, once


def test_without_an_arbiter_every_step_is_planned():
    union = Union([Counting("p", [1], 0.9)], cost=flat_cost(), explore=False)
    assert union.plain_step(0.01, 1, 1, False) is True


def test_skipped_steps_still_age_the_estimators_evidence():
    union, _ = _union([PLAIN, PLAIN, PLAIN, SPECULATE])
    union.estimator.set_counts(1.0, 0.0)
    for _ in range(3):
        union.plain_step(0.01, 1, 1, False)
    union.step(_batch(["r0"]), _none_verified(1))
    assert np.allclose(union.estimator.judged, union.estimator.decay ** 4)


def _speculator(union):
    """specplugin.Speculator around ``union``, without an engine (its step timing only)."""
    from specplugin.vllm_layer.speculator import Speculator

    spec = Speculator.__new__(Speculator)
    spec.union, spec.runner, spec.timer = union, None, StepTimer()
    spec._step_seconds, spec._step_timed = None, False
    return spec


def _context(n):
    from types import SimpleNamespace

    return SimpleNamespace(req_ids=[f"r{i}" for i in range(n)],
                           num_scheduled_drafts=np.zeros(n, dtype=int), num_query_tokens=n,
                           scored=None, expected_acceptance=None, read_prompts=False)


def test_the_speculator_reads_each_steps_time_once(monkeypatch):
    """The plain-step check reads the step's time; when it lets the full path run (no
    arbiter, or drafts waiting), that path must learn the same time, not the few
    microseconds since the check (the cost model then thought steps cost nothing and
    a suffix proposer alone drafted 2 times in 130 steps)."""
    from specplugin.adaptive import cost

    clock = iter([1.0, 1.010, 1.020, 1.030, 1.0301])
    monkeypatch.setattr(cost.time, "perf_counter", lambda: next(clock))
    union = Union([Counting("p", [1], 0.9)], cost=flat_cost(), explore=False)  # no arbiter
    spec = _speculator(union)
    spec.timer.lap()  # the first step's drafting call (t = 1.0)
    assert spec.skip_drafting(2, 2, False) is False  # t = 1.010: no arbiter, plan it
    assert spec._verified(_context(2), [[1], [1]]).seconds == pytest.approx(0.010)
    # a step without the check (it verified drafts) reads the clock itself
    assert spec._verified(_context(2), [[1], [1]]).seconds == pytest.approx(0.010)  # t = 1.020
    # a check whose step then failed leaves nothing behind for the next step
    assert spec.skip_drafting(2, 2, False) is False  # t = 1.030
    spec.forget_pending()
    assert spec._verified(_context(2), [[1], [1]]).seconds == pytest.approx(0.0001)


@pytest.mark.parametrize("new, per_request, drafts, expected", [
    ([], {"a": 1, "b": 1}, {}, False),  # plain decode
    ([], {"a": 4, "b": 1}, {"a": [7, 8, 9]}, False),  # decode verifying three drafts
    (["c"], {"a": 1, "c": 40}, {}, True),  # a new request's prompt
    ([], {"a": 1, "c": 512}, {}, True),  # the next chunk of a long prompt
    ([], {"a": 2, "b": 1}, {"a": []}, True),  # a preempted request re-reading its context
])
def test_a_step_reads_prompts_when_a_row_reads_more_than_a_decode_step(new, per_request,
                                                                       drafts, expected):
    """Every observer of a step's time leaves a prefill's out: a new request's, the next
    chunk of a long prompt under chunked prefill, a resumed request's re-read."""
    from types import SimpleNamespace

    from specplugin.vllm_layer.worker import _read_prompts

    so = SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=per_request,
                         scheduled_spec_decode_tokens=drafts,
                         total_num_scheduled_tokens=sum(per_request.values()))
    assert _read_prompts(so) is expected
    assert _read_prompts(None) is False

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


# ---------------------------------------------------------------- steps foretold plain


def _state(union):
    """What a union learned and counted, comparable between two unions."""
    def plain(obj):
        return {k: (v.tolist() if isinstance(v, np.ndarray) else
                    plain(v) if hasattr(v, "__dict__") and not callable(v) else v)
                for k, v in vars(obj).items() if not callable(v)}
    arbiter = plain(union.arbiter)
    arbiter["_buckets"] = {k: vars(b) for k, b in union.arbiter._buckets.items()}
    return (arbiter, plain(union.cost), union.stats.as_dict(), union._skipped_steps,
            union.speculating)


def _drive(union, steps, foretold: bool, seed: int = 0):
    """``steps`` engine steps at batch 2: plain steps mostly (speculation measures slower),
    idle gaps and requests joining now and then. ``foretold``: the steps that
    :meth:`Union.plain_steps_ahead` foretells are not decided, only their times kept and
    handed to :meth:`Union.plain_steps_ran` before the next decision, as the runner does.
    Returns each step's choice (True: speculative) and how many were foretold."""
    from tests.test_adaptive import _peek

    rng = np.random.default_rng(seed)
    fresh = _peek([7, 3, 9, 1, 4, 8, 2, 6, 5, 11, 13])
    choices, ahead, ran, num_foretold = [], 0, [], 0
    speculating = True
    for _ in range(steps):
        joins = rng.random() < 0.01
        seconds = (0.5 if rng.random() < 0.01 else
                   (0.030 if speculating else 0.010) * rng.uniform(0.9, 1.1))
        if foretold and ahead and not joins and not speculating:
            ran.append(seconds)  # the step ran as the engine's own; only its time is kept
            ahead -= 1
            num_foretold += 1
            choices.append(False)
            continue
        if ran:
            union.plain_steps_ran(ran, 2)
            ran, ahead = [], 0
        if joins:
            union.new_requests(1, 2)
        if speculating:
            verified = Verified(("r0", "r1"), np.zeros(2, dtype=int), np.full(2, 2), seconds, 2)
            union.step(_batch(["r0", "r1"]), verified)
            speculating = union.speculating
        else:
            speculating = union.plain_step(seconds, 2, 2, False, peek=fresh)
            if not speculating and foretold:
                ahead = union.plain_steps_ahead()
        choices.append(speculating)
    if ran:
        union.plain_steps_ran(ran, 2)
    return choices, num_foretold


def test_steps_foretold_plain_teach_the_union_what_deciding_each_would_have():
    """Steps the union foretells as plain (its arbiter's plain block runs on) may run as
    the engine's own plain steps: learning their times afterwards, in one call, leaves
    the union exactly where deciding each step would have (same choices, same arbiter
    and cost model, same counters). Only its peeks come later (on text that copies
    nothing here, so they change no choice; see the next test)."""
    from specplugin.proposers.ngram import NgramProposer

    unions = [Union([NgramProposer(), Counting("p", [1, 2, 3], 0.3)], cost=flat_cost(),
                    explore=False, arbiter=StepArbiter()) for _ in range(2)]
    each, _ = _drive(unions[0], 1500, foretold=False)
    ahead, num_foretold = _drive(unions[1], 1500, foretold=True)
    assert each == ahead
    assert _state(unions[0]) == _state(unions[1])
    assert num_foretold > 0.6 * each.count(False)  # most plain steps need no decision


def test_a_peek_due_in_a_foretold_run_waits_for_the_step_that_ends_it():
    """A peek does not cut a foretold run short (every decided step costs the plugin's
    whole plain path): it comes due meanwhile and runs at the next decision, which
    then finds the copy in sight and speculates."""
    from tests.test_adaptive import _AlwaysPlain, _peek

    class Block(_AlwaysPlain):  # plain blocks of 4 steps: 3 foretold after each decision
        def plain_steps_ahead(self):
            return 3

    from specplugin.proposers.ngram import NgramProposer

    union = Union([NgramProposer(), Counting("p", [], 0.5)], cost=flat_cost(), explore=False,
                  arbiter=Block())
    union.max_peek_gap = 1  # a peek due on every plain step
    assert not union.plain_step(0.01, 1, 1, False, peek=_peek([7, 3, 9, 1, 4, 8, 2, 6, 5, 11]))
    assert union.plain_steps_ahead() == 3
    union.plain_steps_ran([0.01] * 3, 1)
    copies = [7, 3, 9, 1, 4, 8, 2, 6, 5, 7, 3, 9, 1]
    assert union.plain_step(0.01, 1, 1, False, peek=_peek(copies))  # peeked: speculate
    assert union.stats.steps_peeked == 1 and union.stats.steps_skipped == 4


def test_no_step_is_foretold_while_speculating_or_past_a_blocks_end():
    arbiter = StepArbiter(block_steps=4)
    arbiter.speculate(1)
    assert arbiter.plain_steps_ahead() == 0  # an engine's first blocks speculate
    union = Union([Counting("p", [1], 0.9)], cost=flat_cost(), explore=False,
                  arbiter=Scripted([PLAIN]))
    union.plain_step(0.01, 1, 1, False)
    assert union.plain_steps_ahead() == 0  # (a scripted arbiter's blocks are never known)


def test_the_steps_of_a_foretold_run_count_down_to_the_next_peek():
    """The plain steps that ran as vLLM's own count toward the gap between two peeks: the
    decision after the run peeks if the peek came due during it."""
    from tests.test_adaptive import _AlwaysPlain, _peek

    class Block(_AlwaysPlain):
        def plain_steps_ahead(self):
            return 3

    from specplugin.proposers.ngram import NgramProposer

    union = Union([NgramProposer(), Counting("p", [], 0.5)], cost=flat_cost(), explore=False,
                  arbiter=Block())
    peeked = []
    fresh = _peek([7, 3, 9, 1, 4, 8, 2, 6, 5, 11])
    assert not union.plain_step(0.01, 1, 1, False, peek=lambda: peeked.append(1) or fresh())
    assert peeked == [1] and union._peek.gap == 2  # nothing found: the next peek in 2 steps
    union.plain_steps_ran([0.01] * 3, 1)
    union.plain_step(0.01, 1, 1, False, peek=lambda: peeked.append(2) or fresh())
    assert peeked == [1, 2]

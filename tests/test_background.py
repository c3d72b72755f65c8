"""The union's learning off the step (specplugin.adaptive.background): the same state and
plans deferred as inline, nothing read before it is learned, failures counted."""

import numpy as np

from specplugin.adaptive.background import Background
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.estimator import AcceptanceEstimator
from specplugin.adaptive.learning import COLD_TOKENS, Verified
from specplugin.adaptive.union import Union

from tests.test_adaptive import Fixed, _batch


def _calibrated_cost() -> StepCostModel:
    """A cost model timed as an engine's start-up would: without it nothing pays to draft."""
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 2, 64]), np.array([0.010, 0.011, 0.073]))
    return cost


def _run(background: Background, steps: int = 120, seed: int = 3):
    """A union of two proposers over ``steps`` steps of 4 requests, one of them swapped
    for a new one every 10 steps; each row's drafts accepted by a seeded coin per token.
    A deferred background's pending jobs run after two steps in three (the worker's wait;
    the third step settles them itself). Returns every step's drafts and the state left
    behind."""
    cost = _calibrated_cost()
    union = Union([Fixed("a", [1, 2, 3, 4, 5], 0.9), Fixed("b", [7, 8, 9], 0.4)], cost=cost,
                  estimator=AcceptanceEstimator(("a", "b"), seed=seed), background=background)
    rng = np.random.default_rng(seed)
    verified, plans = None, []
    for step in range(steps):
        req_ids = [f"r{step // 10}-{j}" if j == 0 else f"r{j}" for j in range(4)]
        if step and step % 10 == 0:
            union.finish_requests([f"r{step // 10 - 1}-0"])
        drafts = union.step(_batch(req_ids), verified).drafts
        plans.append(drafts)
        if step % 3:
            background.run_pending()
        emitted = [1 + int(np.argmin(np.append(rng.random(len(d)) < 0.7, False))) if d else 1
                   for d in drafts]
        verified = Verified(tuple(req_ids), np.array([len(d) for d in drafts]), np.array(emitted),
                            0.010 + 0.001 * sum(map(len, drafts)), 4 + sum(map(len, drafts)))
    union.settle()
    state = (union.estimator.judged.copy(), union.estimator.accepted.copy(),
             {s.req_id: s.recent_acceptance for s in union.requests},
             union.stats.as_dict(), cost.step_one(4), union.learner.learned_tokens)
    return plans, state, union


def test_deferred_learning_plans_and_leaves_what_inline_learning_does():
    """When the wait comes decides nothing: every plan, the estimator's counts, the
    counters and the cost model are those of the inline run (seen red with the settle at
    the start of Union.begin removed: plans made before the held verdicts were learned)."""
    inline_plans, inline_state, _ = _run(Background(deferred=False))
    deferred = Background(deferred=True)
    plans, state, _ = _run(deferred)
    assert deferred.failures.count == 0
    assert 0 < deferred.num_off_step < deferred.num_jobs  # both paths ran
    assert plans == inline_plans
    assert np.array_equal(state[0], inline_state[0]) and np.array_equal(state[1], inline_state[1])
    assert state[2:] == inline_state[2:]
    assert state[5] >= COLD_TOKENS  # past the cold start: the verdicts were learned late


def test_a_warm_union_plans_on_the_verdicts_up_to_the_step_before():
    """Once warm, a step's verdicts are learned after its plan (on the worker's wait), so
    the plan rests on the steps before; while cold they are learned before it."""
    plans, _, union = _run(Background(deferred=False), steps=60)
    union.settle()
    judged = union.estimator.judged.sum()
    batch = _batch(["x0", "x1", "x2", "x3"])
    drafts = union.step(batch, None).drafts
    verified = Verified(("x0", "x1", "x2", "x3"), np.array([len(d) for d in drafts]),
                        np.ones(4, dtype=int), 0.012, 4 + sum(map(len, drafts)))
    assert union.learner.learned_tokens >= COLD_TOKENS
    union.begin(verified, 4, False)
    assert union.estimator.judged.sum() == judged  # held: not learned before the plan
    union.release()
    union.settle()
    union.flush_learning()
    assert union.estimator.judged.sum() > judged  # the rejected first tokens, learned


def test_a_finished_requests_held_verdicts_do_not_outlive_it():
    """finish_requests waits for the learning first: a request's history is not written
    back after it was forgotten (seen red without the settle in finish_requests)."""
    union = Union([Fixed("a", [1, 2, 3], 0.9)], cost=_calibrated_cost(),
                  background=Background(deferred=True))
    union.learner.learned_tokens = COLD_TOKENS  # warm: verdicts held, learned in the wait
    verified = None
    for _ in range(20):  # until a step verified a draft (the first ones may not draft)
        drafts = union.step(_batch(["r0"]), verified).drafts
        if verified is not None and verified.num_scheduled_drafts[0]:
            break
        verified = Verified(("r0",), np.array([len(drafts[0])]), np.array([2]), 0.01, 4)
        union.background.run_pending()
    assert union.background._jobs  # the verdicts of a verified draft, pending
    union.finish_requests(["r0"])
    union.background.run_pending()
    assert union.idle


def test_a_failing_job_is_counted_and_the_next_ones_run():
    background = Background(deferred=True)
    ran = []

    def boom():
        raise RuntimeError("learning went wrong")

    background.submit(boom)
    background.submit(lambda: ran.append(1))
    background.run_pending()
    assert background.failures.count == 1 and ran == [1] and background.num_off_step == 2


def test_the_suffix_index_extends_its_tree_of_all_outputs_in_the_background():
    """The union hands a proposer's deferrable work (the C++ suffix index's tree of all
    outputs) to its background: a deferred background holds it after the step's plan and
    the index has it once the wait ran (seen red with the union's assignment of the
    proposer's ``defer`` removed: the extension ran on the step)."""
    from specplugin.proposers.suffix import SuffixProposer

    suffix = SuffixProposer(index="arctic")
    background = Background(deferred=True)
    union = Union([suffix], cost=_calibrated_cost(), background=background)
    batch = _batch(["r0"])
    for _ in range(3):
        union.ask(batch, range(1))
    assert suffix.cache.outputs_behind and background._jobs
    background.run_pending()
    assert not suffix.cache.outputs_behind

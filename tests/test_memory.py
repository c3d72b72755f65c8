"""``state_dir``: the union's learned state across engine restarts (vLLM-free)."""

import json

import numpy as np
import pytest

from specplugin.adaptive.arbiter import PLAIN, SPECULATE, StepArbiter
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.memory import REMEASURE_BLOCKS, UnionMemory, open_memory, state_path
from specplugin.config import SpecPluginConfigError, parse
from specplugin.adaptive.union import Union
from tests.test_adaptive import Fixed, _teach


def _union(names=("ngram", "draft")):
    cost = StepCostModel(max_tokens=64)
    cost.calibrate(np.array([1, 2, 64]), np.array([0.010, 0.011, 0.073]))
    return Union([Fixed(n, [1, 2], 0.5) for n in names], cost=cost, arbiter=StepArbiter())


def _measure_plain_faster(arbiter: StepArbiter, blocks: int = 40) -> None:
    """Plain decoding measured at twice speculation's rate, batch 1."""
    for _ in range(blocks * arbiter.block_steps):
        choice = arbiter.speculate(1)
        arbiter.observe(1, 1 / (100.0 if choice == SPECULATE else 200.0))


def _open(union, tmp_path, **kwargs):
    return open_memory(union, str(tmp_path), "/models/target", "/models/draft", 8, **kwargs)


def test_a_second_engine_starts_where_the_first_one_stopped(tmp_path):
    first = _union()
    memory = _open(first, tmp_path)
    _teach(first, 1, 0.9)
    _measure_plain_faster(first.arbiter)
    memory.save(first)

    second = _union()
    _open(second, tmp_path)
    np.testing.assert_allclose(second.estimator.judged, first.estimator.judged)
    np.testing.assert_allclose(second.estimator.accepted, first.estimator.accepted)
    assert second.arbiter.rate(1, PLAIN) == pytest.approx(first.arbiter.rate(1, PLAIN))
    # warm: no warm-up blocks, the measured rates decide from the first step; the old
    # block counts are capped so that this engine's own blocks soon outweigh them
    assert second.arbiter.speculate(1) == PLAIN
    assert max(second.arbiter.buckets()[(0, False)].blocks.values()) <= REMEASURE_BLOCKS
    cold = _union()
    _open(cold, tmp_path / "elsewhere")
    assert cold.arbiter.speculate(1) == SPECULATE  # a fresh engine's warm-up
    assert cold.estimator.judged.sum() == 0


def test_a_restored_bucket_seeds_its_neighbours(tmp_path):
    """A warm engine whose batch shrinks to a size the first engine never ran starts that
    bucket from the restored neighbour's verdict (plain here), not from a warm-up."""
    first = _union()
    memory = _open(first, tmp_path)
    for _ in range(40 * first.arbiter.block_steps):  # batch 8: plain twice as fast
        choice = first.arbiter.speculate(8)
        first.arbiter.observe(8, 8 / (400.0 if choice == SPECULATE else 800.0))
    memory.save(first)
    second = _union()
    _open(second, tmp_path)
    assert second.arbiter.speculate(5) == PLAIN and second.arbiter.num_seeded_buckets == 1


def test_forgetting_what_was_learned_gives_a_fresh_engines_choices():
    """``specplugin bench`` warms an engine up on reversed text, then has the union forget
    (Union.forget_learned): a union taught that a proposer fails and that plain decoding
    pays must then choose what an untaught union chooses, from the same evidence on."""
    from tests.test_adaptive import _batch

    taught, fresh = _union(), _union()
    taught.explore = fresh.explore = False  # posterior means: the same evidence, the same choice
    _teach(taught, 0, 0.0)  # every n-gram token rejected
    _teach(taught, 1, 0.0)
    _measure_plain_faster(taught.arbiter)
    batch = _batch(["a", "b"])

    def drafts(union):
        union.begin(None, 2, sampled=False)
        return union.choose(batch, union.ask(batch, range(len(union.proposers)))).drafts

    assert not any(drafts(taught)), "the lesson did not take: the test tests nothing"
    taught.forget_learned()
    assert taught.estimator.judged.sum() == 0 and taught.arbiter.rate(1, PLAIN) is None
    assert taught.arbiter.speculate(2) == SPECULATE
    fresh.arbiter.speculate(2)
    assert drafts(taught) == drafts(fresh) != [[], []]


def test_a_restored_state_is_what_the_estimates_read(tmp_path):
    """The estimator keeps its counts' sums between changes: a state restored after it
    estimated must be what it estimates from next, not the sums of its old counts."""
    first = _union()
    memory = _open(first, tmp_path)
    _teach(first, 1, 0.9)
    memory.save(first)
    second = _union()
    # proposer 1's first token, greedy, history 0, its signal not known (pooled)
    before = second.estimator.pooled_cells(1, False, 0, 1)  # sums of empty counts
    _open(second, tmp_path)
    after = second.estimator.pooled_cells(1, False, 0, 1)
    assert after == pytest.approx(first.estimator.pooled_cells(1, False, 0, 1))
    assert abs(after[0] - before[0]) > 0.05


def test_the_file_is_keyed_by_models_proposers_k_and_machine(tmp_path):
    base = state_path(tmp_path, "/t", "/d", ("ngram", "draft"), 8, machine="m")
    assert base == state_path(tmp_path, "/t", "/d", ("ngram", "draft"), 8, machine="m")
    for other in (state_path(tmp_path, "/t2", "/d", ("ngram", "draft"), 8, machine="m"),
                  state_path(tmp_path, "/t", None, ("ngram", "draft"), 8, machine="m"),
                  state_path(tmp_path, "/t", "/d", ("suffix", "draft"), 8, machine="m"),
                  state_path(tmp_path, "/t", "/d", ("ngram", "draft"), 4, machine="m"),
                  state_path(tmp_path, "/t", "/d", ("ngram", "draft"), 8, machine="other")):
        assert other != base


def test_a_file_that_does_not_match_costs_the_warm_start_never_the_engine(tmp_path, caplog):
    union = _union()
    memory = _open(union, tmp_path)
    _teach(union, 0, 0.9)
    memory.save(union)
    payload = json.loads(memory.path.read_text())
    for broken in ("{not json", json.dumps({**payload, "version": 99}),
                   json.dumps({**payload, "proposers": ["suffix", "draft"]}),
                   json.dumps({**payload, "judged": [1, 2, 3]}),
                   json.dumps({**payload, "accepted": (np.asarray(payload["judged"]) + 1).tolist()})):
        memory.path.write_text(broken)
        fresh = _union()
        assert not UnionMemory(memory.path).restore(fresh)
        assert fresh.estimator.judged.sum() == 0 and not fresh.arbiter.buckets()
    assert "starting cold" in caplog.text


def test_written_when_idle_or_every_interval_and_by_one_rank_only(tmp_path, monkeypatch):
    from specplugin.adaptive import memory as memory_module

    union = _union()
    reader = _open(union, tmp_path, writer=False)
    reader.maybe_save(union, idle=True)
    assert not reader.path.exists()
    writer = _open(union, tmp_path)
    writer.maybe_save(union, idle=False)  # just opened: not yet
    assert not writer.path.exists()
    writer.maybe_save(union, idle=True)
    assert writer.path.exists()
    writer.path.unlink()
    now = memory_module.time.monotonic()
    monkeypatch.setattr(memory_module.time, "monotonic",
                        lambda: now + memory_module.SAVE_INTERVAL_S + 1)
    writer.maybe_save(union, idle=False)
    assert writer.path.exists()
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind


def test_state_dir_must_be_a_directory_this_user_can_write(tmp_path):
    made = tmp_path / "new" / "state"
    assert parse({"state_dir": str(made)}, 8).state_dir == str(made)
    assert made.is_dir()
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(SpecPluginConfigError, match=r'\["state_dir"\].*not a directory'):
        parse({"state_dir": str(a_file)}, 8)
    with pytest.raises(SpecPluginConfigError, match=r'\["state_dir"\] must be a str'):
        parse({"state_dir": 3}, 8)


def test_verdicts_the_estimator_holds_back_are_written_too(tmp_path):
    """The union learns LEARN_EVERY steps at a time (warm): the file written between two
    flushes has every verdict judged so far."""
    from specplugin.adaptive.learning import COLD_TOKENS, Verified
    from tests.test_adaptive import _batch

    union = _union()
    union.learner.learned_tokens = COLD_TOKENS  # warm: verdicts wait for the next flush
    memory = _open(union, tmp_path)
    drafts = union.step(_batch(["a"]), None).drafts
    assert drafts[0]
    union.step(_batch(["a"]), Verified(("a",), np.array([len(drafts[0])]), np.array([2]),
                                       0.012, 1 + len(drafts[0])))
    assert union.estimator.judged.sum() == 0  # held back
    memory.save(union)
    written = json.loads(memory.path.read_text())
    assert np.sum(written["judged"]) > 0

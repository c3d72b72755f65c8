"""The plugin's own counters: a failing proposer is counted and reported, not silent."""

import logging
from types import SimpleNamespace

from specplugin.metrics import FailureCounter


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _fail(counter: FailureCounter) -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        counter.record()


def test_failures_are_counted_logged_in_full_once_then_summarised_periodically(caplog):
    clock = Clock()
    counter = FailureCounter("ngram", logging.getLogger("specplugin.test"), log_every_s=60,
                             clock=clock)
    with caplog.at_level(logging.WARNING, logger="specplugin.test"):
        _fail(counter)
        assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None
        for _ in range(5):  # within the minute: counted, not logged
            clock.now += 1
            _fail(counter)
        assert len(caplog.records) == 1
        clock.now += 60
        _fail(counter)
    assert counter.count == 7
    assert counter.snapshot() == {"ngram": 7}
    assert len(caplog.records) == 2
    assert "6 more time(s) (7 in all)" in caplog.records[1].getMessage()


def test_speculator_counts_a_drafting_failure_and_returns_empty_drafts():
    import numpy as np

    from specplugin.vllm_layer.speculator import Speculator

    class BrokenRunner:
        def step_context(self):
            raise ValueError("runner state went wrong")

    spec = object.__new__(Speculator)  # no vLLM config needed for the guard
    spec.union = __import__("specplugin.adaptive.union", fromlist=["Union"]).Union([])
    spec.failures = FailureCounter("union", logging.getLogger("specplugin.test"))
    spec.runner = BrokenRunner()
    tokens = np.zeros((2, 64), dtype=np.int32)
    for _ in range(3):
        assert spec.propose([[1], [2]], np.array([5, 5]), tokens) == [[], []]
    assert spec.stats()["proposer_failures"] == {"union": 3}


def test_drafts_and_acceptances_are_attributed_per_proposer_and_position():
    from specplugin.metrics import ProposerStats

    stats = ProposerStats()
    stats.verified("suffix", 4, 2)
    stats.verified("suffix", 2, 2)
    stats.verified("draft", 3, 0)
    stats.chosen.update({"suffix": 2, "draft": 1})
    stats.k_histogram.update([4, 2, 3, 0, 0])
    snap = stats.as_dict()
    assert snap["proposers"]["suffix"] == {
        "chosen": 2, "drafts": 2, "won": 0, "draft_tokens": 6, "accepted_tokens": 4,
        "draft_tokens_per_pos": [2, 2, 1, 1], "accepted_tokens_per_pos": [2, 2, 0, 0]}
    assert snap["proposers"]["draft"]["accepted_tokens_per_pos"] == [0, 0, 0]
    assert snap["k_histogram"] == {"0": 2, "2": 1, "3": 1, "4": 1}


def _snapshot(accepted_per_pos, failures):
    return {"steps": 10, "steps_without_drafts": 3, "steps_skipped": 2, "steps_peeked": 6,
            "steps_without_draft_model": 4, "steps_verified_greedy": 5,
            "steps_verified_sampled": 1, "steps_foretold_plain": 3, "offers_judged_unsent": 9,
            "k_histogram": {"0": 3, "4": 7},
            "proposers": {"ngram": {"chosen": 7, "drafts": 7, "draft_tokens": 28,
                                    "accepted_tokens": sum(accepted_per_pos),
                                    "draft_tokens_per_pos": [7, 7, 7, 7],
                                    "accepted_tokens_per_pos": accepted_per_pos}},
            "proposer_failures": failures, "arbiter": {"speculative_blocks": 2,
                                                       "plain_blocks": 1}}


def test_published_snapshots_become_vllm_specplugin_counters(tmp_path, monkeypatch):
    """Two workers publish (data-parallel engines); the front end's collector sums them
    into Prometheus families named vllm:specplugin_* with a proposer label."""
    from prometheus_client import CollectorRegistry, generate_latest

    from specplugin.vllm_layer import metrics_export

    monkeypatch.setattr(metrics_export, "metrics_root", lambda: tmp_path)
    clock = Clock()
    one = metrics_export.StatsPublisher("engine-a", every_s=0.5, clock=clock)
    two = metrics_export.StatsPublisher("engine-a", every_s=0.5, clock=clock)
    two.path = two.folder / "other-worker.json"
    one.maybe_publish(lambda: _snapshot([5, 3, 1, 0], {"ngram": 1, "union": 0}))
    two.maybe_publish(lambda: _snapshot([6, 2], {"ngram": 2}))
    one.maybe_publish(lambda: _snapshot([7, 7, 7, 7], {}))  # throttled: within 0.5 s
    collector = metrics_export._Collector()
    collector.instance_ids.append("engine-a")
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'vllm:specplugin_accepted_tokens_total{proposer="ngram"} 17.0' in text
    assert 'vllm:specplugin_accepted_tokens_per_pos_total{position="0",proposer="ngram"} 11.0' in text
    assert 'vllm:specplugin_accepted_tokens_per_pos_total{position="3",proposer="ngram"} 0.0' in text
    assert 'vllm:specplugin_draft_tokens_total{proposer="ngram"} 56.0' in text
    assert 'vllm:specplugin_k_total{k="0"} 6.0' in text
    assert "vllm:specplugin_steps_without_drafts_total 6.0" in text
    assert "vllm:specplugin_steps_skipped_total 4.0" in text  # (was not exported)
    assert "vllm:specplugin_steps_without_draft_model_total 8.0" in text
    assert "vllm:specplugin_steps_verified_greedy_total 10.0" in text
    assert "vllm:specplugin_steps_verified_sampled_total 2.0" in text
    # every step counter of the one table, summed over the two workers
    from specplugin.metrics import STEP_COUNTERS

    for key in STEP_COUNTERS:
        assert f"vllm:specplugin_{key}_total {2.0 * _snapshot([], {})[key]}" in text, key
    assert 'vllm:specplugin_proposer_failures_total{proposer="ngram"} 3.0' in text
    assert 'vllm:specplugin_arbiter_blocks_total{mode="plain"} 2.0' in text
    clock.now += 0.6  # the period is over: the next step publishes
    one.maybe_publish(lambda: _snapshot([7, 7, 7, 7], {}))
    text = generate_latest(registry).decode()
    assert 'vllm:specplugin_accepted_tokens_total{proposer="ngram"} 36.0' in text


def test_an_extra_candidate_that_won_is_credited_to_its_proposer():
    """The scorer verified suffix's candidate beside ngram's draft and suffix's won: the
    draft tokens stay ngram's (as in vLLM's counters), the emitted ones are suffix's."""
    import numpy as np

    from specplugin.adaptive.learning import Scored, Verified
    from specplugin.adaptive.union import Union
    from tests.test_adaptive import Fixed, _batch, flat_cost

    union = Union([Fixed("ngram", [1, 2, 3, 4], 0.9), Fixed("suffix", [1, 7, 8, 9], 0.9)],
                  cost=flat_cost(), explore=False, max_candidates=2)
    plan = union.step(_batch(["r"]), None)
    [draft], [[extra]] = plan.drafts, plan.alternates
    k = len(draft)
    outcome = Scored(own_accepted=1, extra_accepted=(min(3, len(extra)),),
                     extra_lengths=(len(extra),), winner=0)
    emitted = min(3, len(extra))
    union.step(_batch(["r"]), Verified(("r",), np.array([k]), np.array([emitted + 1]), None, 2,
                                       {"r": outcome}))
    snap = union.stats.as_dict()["proposers"]
    chosen = "ngram" if draft[1] == 2 else "suffix"
    other = "suffix" if chosen == "ngram" else "ngram"
    assert snap[chosen]["draft_tokens"] == k and snap[chosen]["accepted_tokens"] == 0
    assert snap[other]["won"] == 1 and snap[other]["accepted_tokens"] == emitted


def test_a_failing_shortcut_in_the_rejection_sampler_is_counted_and_logged_once(monkeypatch,
                                                                                 caplog):
    """The plugin's recovered-token draw and expected acceptance inside vLLM's rejection
    sampler: a failure costs the step the shortcut (vLLM's draw, the verdicts alone),
    is counted with the proposers' failures, and is logged once, not every step."""
    import torch

    from specplugin.vllm_layer import verification

    log = logging.getLogger("specplugin.test")
    monkeypatch.setattr(verification, "DRAW_FAILURES",
                        FailureCounter("recovered draw", log, fallback="vLLM's own draw"))
    monkeypatch.setattr(verification, "EXPECTATION_FAILURES",
                        FailureCounter("expected acceptance", log, fallback="the verdicts"))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(verification, "draw_recovered", broken)
    monkeypatch.setattr(verification, "expected_acceptance", broken)
    vllms = verification._listened(lambda *args, **kwargs: "vLLM's draw")
    target = torch.softmax(torch.randn(3, 16), dim=-1)  # [num_tokens, vocab_size]
    with caplog.at_level(logging.WARNING, logger="specplugin.test"):
        for _ in range(5):
            with verification.listening() as heard:
                out = vllms(3, [3], torch.tensor([3]), torch.tensor([1, 2, 3]), target,
                            target, SimpleNamespace(generators={}), "cpu")
            assert out == "vLLM's draw" and heard.values is None
    assert verification.failures() == {"recovered draw": 5, "expected acceptance": 5}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert any("vLLM's own draw takes over" in m for m in messages), messages

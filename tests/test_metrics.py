"""The plugin's own counters: a failing proposer is counted and reported, not silent."""

import logging

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
    spec.union = __import__("specplugin.proposers.union", fromlist=["Union"]).Union([])
    spec.failures = FailureCounter("union", logging.getLogger("specplugin.test"))
    spec.runner = BrokenRunner()
    tokens = np.zeros((2, 64), dtype=np.int32)
    for _ in range(3):
        assert spec.propose([[1], [2]], np.array([5, 5]), tokens) == [[], []]
    assert spec.stats()["proposer_failures"] == {"union": 3}

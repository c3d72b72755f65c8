"""Learning work a step need not wait for, run once the worker has sent the step's output.

What the union learns from a verified step (verdicts, counters, the estimator's update)
only shapes later plans, so it need not sit on the step's critical path. With
``deferred=True`` jobs wait for :meth:`Background.run_pending`, which the plugin's worker
calls while it waits for the engine core's next call
(:mod:`specplugin.vllm_layer.worker_wait`). Not a helper thread: on a 2-core machine its
wake-ups compete with the step for a core and the GIL.

Both modes leave the same state: a job is submitted once the step's plan is made, and
every reader of what jobs write calls :meth:`settle` first. With ``deferred=False`` (the
default, the unit tests') a job runs at once. A job that raises is counted and logged
once, never fails a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specplugin.metrics import FailureCounter

logger = logging.getLogger("specplugin")


class Background:
    """Jobs run in the order submitted, each after the step that submitted it: at once
    (``deferred=False``), or at :meth:`run_pending` / the next :meth:`settle`."""

    def __init__(self, deferred: bool = False, name: str = "learning"):
        self.deferred = deferred
        self.failures = FailureCounter(name, logger, fallback="what was learned before")
        self.busy_s = 0.0  # seconds jobs ran off the step (run_pending)
        self.waited_s = 0.0  # seconds jobs ran on the step (settle, or submit when inline)
        self.num_jobs = 0
        self.num_off_step = 0  # of them, run by run_pending
        self._jobs: list[Callable[[], None]] = []  # submitted, not yet run (deferred)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` now (inline) or keep it for :meth:`run_pending`; either way it has
        run before the next :meth:`settle` returns."""
        self.num_jobs += 1
        if self.deferred:
            self._jobs.append(job)
        else:
            self.waited_s += self._run(job)

    def run_pending(self) -> None:
        """The caller's idle moment: every job submitted so far runs now."""
        while self._jobs:
            self.busy_s += self._run(self._jobs.pop(0))
            self.num_off_step += 1

    def settle(self) -> None:
        """Run every job still pending (usually none: run_pending ran them)."""
        while self._jobs:
            self.waited_s += self._run(self._jobs.pop(0))

    def _run(self, job: Callable[[], None]) -> float:
        """Run ``job``; the seconds it took."""
        start = time.perf_counter()
        try:
            job()
        except Exception:  # a learning bug never fails a request
            self.failures.record()
        return time.perf_counter() - start

"""Work a step need not wait for, run while the worker waits for its next step.

What the union learns from a verified step (each row's verdicts into the request's
history, the counters, the difficulty estimator's update) decides nothing in the step
that learns it: it shapes later plans. Done inline it sits on the step's critical path,
between the target's sampling and the drafts' hand-back. vLLM's worker, once it has
handed its output back, waits for the engine core to schedule the next step (the
scheduler, the output processing, the messages both ways: on this project's CPU
machines about 0.3-0.5 ms a step at batch 1, in which the worker's core only spins on
the message queue). A :class:`Background` with ``threaded=True`` runs the learning there,
on a helper thread of the worker's process: the spinning worker yields the core and the
GIL (``sched_yield``) and the helper takes them.

The order of events is the same in both modes, so both leave the same state behind: a
job is handed over (:meth:`submit`) once the step's plan is made, and every reader of
what jobs write waits for them first (:meth:`settle`), so that nothing the union
decides depends on the thread's timing. With ``threaded=False`` (the core's default, the
unit tests') a job runs at once, at the same point.

A job that raises costs what it would have taught, never a request: it is counted
(:attr:`failures`) and logged once, as the proposers' failures are.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from specplugin.metrics import FailureCounter

logger = logging.getLogger("specplugin")


class Background:
    """Jobs run in the order submitted, each after the step that submitted it; one helper
    thread, started with the first job (in the process that runs the jobs)."""

    def __init__(self, threaded: bool = False, name: str = "learning"):
        self.threaded = threaded
        self.failures = FailureCounter(name, logger, fallback="what was learned before")
        self.busy_s = 0.0  # seconds the jobs ran (where they ran, threaded or not)
        self.waited_s = 0.0  # seconds settle() waited for unfinished jobs (threaded)
        self.num_jobs = 0
        self._unfinished = 0  # jobs submitted and not yet seen done (the submitter's count)
        self._jobs: queue.SimpleQueue | None = None
        self._done: queue.SimpleQueue | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` now (inline) or on the helper thread (threaded); either way before
        the next :meth:`settle` returns."""
        self.num_jobs += 1
        if not self.threaded:
            self._run(job)
            return
        if self._jobs is None:
            self._start()
        self._unfinished += 1
        self._jobs.put(job)

    def settle(self) -> None:
        """Wait until every job submitted so far has run (one integer read when none is
        outstanding, as on almost every call: the helper finishes in the worker's wait)."""
        if not self._unfinished:
            return
        start = time.perf_counter()
        while self._unfinished:
            self._done.get()
            self._unfinished -= 1
        self.waited_s += time.perf_counter() - start

    def _start(self) -> None:
        self._jobs, self._done = queue.SimpleQueue(), queue.SimpleQueue()
        threading.Thread(target=self._loop, name="specplugin-learning", daemon=True).start()

    def _loop(self) -> None:
        jobs, done = self._jobs, self._done
        while True:
            job = jobs.get()
            try:
                self._run(job)
            finally:
                done.put(None)

    def _run(self, job: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            job()
        except Exception:  # a learning bug costs what it would have taught, never a request
            self.failures.record()
        finally:
            self.busy_s += time.perf_counter() - start

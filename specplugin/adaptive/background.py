"""Work a step need not wait for, run once the worker has sent the step's output.

What the union learns from a verified step (each row's verdicts into the request's
history, the counters, the difficulty estimator's update) decides nothing in the step
that learns it: it shapes later plans. Done inline it sits on the step's critical path,
between the target's sampling and the drafts' hand-back. vLLM's worker, once it has
handed its output back, waits for the engine core to schedule the next step (the
scheduler, the output processing, the messages both ways: on this project's CPU
machines about 0.3-0.5 ms a step at batch 1, in which the worker's core only spins on
the message queue). A :class:`Background` with ``deferred=True`` keeps the jobs until
the caller's idle moment, :meth:`run_pending`: the plugin's worker calls it right after
its reply to each of the engine core's calls is on its way
(:mod:`specplugin.vllm_layer.worker_wait`).

Why not a helper thread (an earlier design): handing a job to a
sleeping thread wakes it, and on a machine of two cores, both busy with the target's
threads, the wake-up competes with the step for a core and the GIL. Seen under ``py-spy``
(which itself took some of the two cores; validation pair, complete, batch 1, greedy, 40 s
an engine): the drafting call sat at the hand-over (``queue.SimpleQueue.put``) in 86 of
its 366 samples, against 8 for running the same jobs inline. Without the sampler the
profile's own-work figures of the thread and of this design stayed within the engines'
spread (measured 2026-12-02): what this design removes is the thread, its
timing and that risk, at no measured cost.

The order of events is the same in both modes, so both leave the same state behind: a
job is handed over (:meth:`submit`) once the step's plan is made, and every reader of
what jobs write runs what is still pending first (:meth:`settle`), so that nothing the
union decides depends on when the idle moment came. With ``deferred=False`` (the core's
default, the unit tests') a job runs at once, at the same point.

A job that raises costs what it would have taught, never a request: it is counted
(:attr:`failures`) and logged once, as the proposers' failures are.
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
        """Every job submitted so far has run (a list's length read when none is pending,
        as on almost every call: :meth:`run_pending` ran them in the worker's wait)."""
        while self._jobs:
            self.waited_s += self._run(self._jobs.pop(0))

    def _run(self, job: Callable[[], None]) -> float:
        """Run ``job``; the seconds it took."""
        start = time.perf_counter()
        try:
            job()
        except Exception:  # a learning bug costs what it would have taught, never a request
            self.failures.record()
        return time.perf_counter() - start

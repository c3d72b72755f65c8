"""Counters the plugin keeps about itself (vLLM-free).

A proposer that raises must cost speed, never a request: the vLLM layer catches the
exception and that step decodes without drafts. Caught silently, though, a proposer
that fails every step would turn the plugin into a slow no-op nobody notices, so
every failure is counted here and reported: the first one with its traceback, then
a one-line summary at most every ``log_every_s`` seconds while failures go on.

The counts are exposed through :meth:`FailureCounter.snapshot` (and the owners'
``stats()``), the place the metrics exporters read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class FailureCounter:
    """Failures of one proposer: counted, logged once in full, then periodically."""

    def __init__(self, name: str, logger: logging.Logger, log_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.logger = logger
        self.log_every_s = log_every_s
        self.clock = clock
        self.count = 0
        self._logged_count = 0
        self._last_log: float | None = None

    def record(self) -> None:
        """Call from inside an ``except`` block: counts the failure and maybe logs it."""
        self.count += 1
        now = self.clock()
        if self.count == 1:
            self.logger.exception(
                "specplugin: proposer %r failed; this step decodes without its drafts (output "
                "is unchanged). Further failures are counted and summarised every %.0f s.",
                self.name, self.log_every_s)
        elif now - self._last_log >= self.log_every_s:
            self.logger.warning(
                "specplugin: proposer %r failed %d more time(s) (%d in all); those steps "
                "decoded without its drafts.", self.name, self.count - self._logged_count,
                self.count)
        else:
            return
        self._last_log, self._logged_count = now, self.count

    def snapshot(self) -> dict[str, int]:
        return {self.name: self.count}

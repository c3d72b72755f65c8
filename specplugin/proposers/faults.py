"""Test-only fault injection: proposers and draft forwards that fail on purpose.

Off unless ``additional_config["specplugin"]["fault_injection"]`` is set. Proves a
proposer failure costs speed, never a request: injected faults take the same ``except``
path as a real bug.
"""

from __future__ import annotations

from collections.abc import Iterable

from specplugin.proposers.base import Candidate, Proposer, StepBatch


class InjectedFault(RuntimeError):
    """Raised on purpose by fault injection."""


class EveryNth:
    """Counts calls; :meth:`tick` raises :class:`InjectedFault` at every ``every``-th."""

    def __init__(self, what: str, every: int):
        self.what = what
        self.every = every
        self.calls = 0

    def tick(self) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            raise InjectedFault(f"fault injection: {self.what} call {self.calls} fails "
                                f"(every {self.every}; additional_config fault_injection)")


class FaultyProposer:
    """``inner`` behind the same interface, raising at every ``every``-th ``propose``."""

    def __init__(self, inner: Proposer, every: int):
        self.inner = inner
        self.name = inner.name
        self.fault = EveryNth(f"proposer {inner.name!r}", every)

    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        self.fault.tick()
        return self.inner.propose(batch)

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        self.inner.finish_requests(req_ids)


def with_faults(proposer: Proposer, faults: dict[str, int]) -> Proposer:
    """``proposer``, failing every N-th call if ``faults`` names it."""
    every = faults.get(proposer.name)
    return proposer if every is None else FaultyProposer(proposer, every)

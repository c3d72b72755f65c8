"""One record per running request: everything the plugin keeps about it between steps.

A request's :class:`RequestState` is made the first time a step reads it
(``requests[req_id]``) and dropped in one place, :meth:`Requests.finish` (finished or
aborted); a preempted request keeps it, less its draft KV (:meth:`Requests.restart`).
What one step sends and learns from the next (drafts awaiting their verdict) belongs to
that step, not here. vLLM-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestState:
    req_id: str
    options: Any = None  # its RequestOptions, parsed at its first step (request_options)
    recent_acceptance: float | None = None  # average of its judged tokens (None: none yet)
    shadow: Any = None  # the peek's unsent guess, judged later (adaptive.learning.Shadow)
    suffix_fed: int | None = None  # context tokens the suffix index has seen (None: not started)
    draft_kv_end: int = 0  # context positions with draft KV (proposers.draft.DraftKVCursor)

    def average_in(self, judged: int, accepted: int, alpha: float = 0.3) -> None:
        """``judged`` tokens of one draft, the first ``accepted`` accepted, into
        :attr:`recent_acceptance` (an exponential average of weight ``alpha`` per token)."""
        value = self.recent_acceptance
        for j in range(judged):
            a = 1.0 if j < accepted else 0.0
            value = a if value is None else value + alpha * (a - value)
        self.recent_acceptance = value


class Requests:
    """The running requests' records, by request id."""

    def __init__(self):
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())

    def __getitem__(self, req_id: str) -> RequestState:
        """The request's record, made at its first read."""
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = RequestState(req_id)
        return state

    def get(self, req_id: str) -> RequestState | None:
        """The request's record if it has one (a finished request has none)."""
        return self._states.get(req_id)

    def finish(self, req_ids: Iterable[str]) -> None:
        """These requests ended (finished or aborted): their records go."""
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def restart(self, req_ids: Iterable[str]) -> None:
        """Resumed after preemption: their KV was freed, the draft re-reads their context."""
        for req_id in req_ids:
            state = self._states.get(req_id)
            if state is not None:
                state.draft_kv_end = 0

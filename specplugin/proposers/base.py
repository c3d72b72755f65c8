"""The one interface every proposer implements.

A proposer sees the whole batch and returns at most one candidate per row (``None``: no
guess): the tokens it guesses come next, each with a *signal* in [0, 1] saying how good
it thinks the guess is. :mod:`specplugin.adaptive` learns what a signal is worth and
decides how much of which candidate each request verifies. Per-request state is dropped
on :meth:`Proposer.finish_requests`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class StepBatch:
    """What a proposer may read this step. Arrays are views into the engine's buffers: read only.

    ``rows``: the rows that want drafts; other rows get ``None``. ``allowed``: per row, the
    proposers its request allows (None: every one).

    Never changed once built, yet slotted rather than frozen: a frozen ``__init__`` costs
    ~8x more per step. Other per-step records are built the same way.
    """

    req_ids: tuple[str, ...]  # [num_reqs]
    token_ids: np.ndarray  # [max_num_reqs, max_model_len] int: prompt + output per row
    num_tokens: np.ndarray  # [num_reqs] int: valid length of each row of token_ids
    num_prompt_tokens: np.ndarray  # [num_reqs] int: the prompt's share of it
    max_draft_lens: np.ndarray  # [num_reqs] int: most draft tokens allowed per row (>= 0)
    sampled: np.ndarray  # [num_reqs] bool: temperature > 0 (else greedy)
    rows: tuple[int, ...]
    allowed: tuple[frozenset[str] | None, ...] | None = None  # [num_reqs]
    # [num_reqs] tokens each row may still emit within max_model_len (None: not known)
    remaining_tokens: Sequence[int] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.num_tokens)

    def context(self, row: int) -> np.ndarray:  # [num_tokens[row]]
        return self.token_ids[row, : self.num_tokens[row]]

    def for_proposer(self, name: str) -> StepBatch:
        """This batch with ``rows`` cut to the rows whose request allows proposer ``name``."""
        if self.allowed is None:
            return self
        rows = tuple(r for r in self.rows if self.allowed[r] is None or name in self.allowed[r])
        return self if len(rows) == len(self.rows) else dataclasses.replace(self, rows=rows)


@dataclass(slots=True)
class Candidate:
    """A guessed continuation: deterministic tokens, verified as one-hot drafts.

    ``alternatives``: other guesses for the same row, offered only when
    ``max_candidates`` > 1."""

    token_ids: np.ndarray  # [k] int64
    signal: np.ndarray  # [k] float64 in [0, 1]
    alternatives: tuple[Candidate, ...] = ()

    def __post_init__(self):
        assert self.token_ids.shape == self.signal.shape, (self.token_ids.shape, self.signal.shape)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class Proposer(Protocol):
    """Guesses the next tokens of each request.

    An optional ``defer(job)`` attribute takes work the next proposal need not wait for;
    the union points it at its background runner, a lone proposer runs the job at once."""

    name: str

    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        """One entry per row of the batch (``batch.num_reqs``), each at most
        ``batch.max_draft_lens[row]`` tokens; rows not in ``batch.rows`` get ``None``."""
        ...

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """These requests ended (finished or aborted): drop their per-request state."""
        ...

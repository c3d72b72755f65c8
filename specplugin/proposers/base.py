"""The one interface every proposer implements.

A proposer sees the whole batch at once (no per-request Python loop is forced on
it) and returns at most one candidate per row: the tokens it guesses come next,
each with its own *signal* in [0, 1] (what the proposer knows about how good the
guess is: a suffix continuation's frequency, an n-gram match's length, a draft
model's confidence). The difficulty estimator (:mod:`specplugin.adaptive`) learns
what a signal is worth; the controller decides how much of which candidate each
request verifies. ``None`` means "no guess for this row".

Lifecycle: a proposer meets a request the first time it appears in a batch (its
prompt and output so far are in the batch's token buffer, its id in ``req_ids``),
sees its accepted tokens as the context grows from step to step, and is told
when it finished (:meth:`Proposer.finish_requests`), so per-request state can go
and cross-request state (past outputs) can keep what it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class StepBatch:
    """What a proposer may read this step. Arrays are views into the engine's buffers: read only.

    ``rows`` lists the batch rows that want drafts (decoding, with room left under
    their limits); other rows get no candidate without asking. ``allowed`` holds, per
    row, the proposers its request allows (``specplugin_proposers``; None: every one);
    :meth:`for_proposer` is the batch one proposer is asked with.

    Built every step, and never changed once built: a slotted dataclass, not a frozen one,
    whose ``__init__`` sets each field through ``object.__setattr__`` (measured on a
    dataclass of 11 fields: 1.10 against 0.14 us warm, several times that after the
    target's forward has swept the caches). The other per-step records (:class:`Candidate`, the union's ``Verified`` and
    ``StepPlan``, the runner's ``StepContext``) are built the same way for the same reason.
    """

    req_ids: tuple[str, ...]  # [num_reqs]
    token_ids: np.ndarray  # [max_num_reqs, max_model_len] int: prompt + output per row
    num_tokens: np.ndarray  # [num_reqs] int: valid length of each row of token_ids
    num_prompt_tokens: np.ndarray  # [num_reqs] int: the prompt's share of it
    max_draft_lens: np.ndarray  # [num_reqs] int: most draft tokens allowed per row (>= 0)
    sampled: np.ndarray  # [num_reqs] bool: temperature > 0 (else greedy)
    rows: tuple[int, ...]
    allowed: tuple[frozenset[str] | None, ...] | None = None  # [num_reqs] (None: all rows allow all)

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

    ``alternatives``: the proposer's other guesses for the same row (another match, a
    less frequent branch), offered only when the batch-expanding scorer may verify
    several candidates per request (``max_candidates`` > 1); the union weighs them like
    any other candidate."""

    token_ids: np.ndarray  # [k] int64
    signal: np.ndarray  # [k] float64 in [0, 1]
    alternatives: tuple[Candidate, ...] = ()

    def __post_init__(self):
        assert self.token_ids.shape == self.signal.shape, (self.token_ids.shape, self.signal.shape)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class Proposer(Protocol):
    """Guesses the next tokens of each request.

    A proposer may also have a ``defer`` attribute, a callable taking a job (a callable
    of no arguments): work that its next proposal need not wait for (the suffix index's
    tree of all outputs) goes there. The union sets it to its background's ``submit``
    (:mod:`specplugin.adaptive.background`: run in the worker's wait for its next step);
    a proposer used alone runs the job at once."""

    name: str

    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        """One entry per row of the batch (``batch.num_reqs``), each at most
        ``batch.max_draft_lens[row]`` tokens; rows not in ``batch.rows`` get ``None``."""
        ...

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """These requests ended (finished or aborted): drop their per-request state."""
        ...

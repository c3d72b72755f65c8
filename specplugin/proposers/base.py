"""The one interface every proposer implements.

A proposer sees the whole batch at once (no per-request Python loop is forced on
it) and returns one draft per row; an empty draft means "no guess, decode this
request plainly this step".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class DraftBatch:
    """What a proposer may read this step. Arrays are views into the engine's buffers: read only.

    ``rows`` lists the batch rows that want drafts (decoding, with room left under
    the model's length limit); other rows get an empty draft without asking.
    """

    token_ids: np.ndarray  # [max_num_reqs, max_model_len] int32: prompt + output per row
    num_tokens: np.ndarray  # [num_reqs] int: valid length of each row of token_ids
    max_draft_lens: np.ndarray  # [num_reqs] int: most draft tokens allowed per row (>= 0)
    rows: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.num_tokens)

    def context(self, row: int) -> np.ndarray:  # [num_tokens[row]]
        return self.token_ids[row, : self.num_tokens[row]]


class Proposer(Protocol):
    """Guesses the next tokens of each request."""

    name: str

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        """One draft per row of the batch (``batch.num_reqs`` lists), each at most
        ``batch.max_draft_lens[row]`` long; rows not in ``batch.rows`` get ``[]``."""
        ...

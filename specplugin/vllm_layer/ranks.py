"""Tensor parallelism: every rank takes the same drafting decisions, from rank 0's clock.

Under tensor parallelism each rank runs the plugin's drafter. The scheduler verifies
rank 0's drafts, but every rank must still do the same work: the draft model's
forward is sharded across the ranks (a rank that skips a pass, or runs a different
number of rows, stalls the others in a collective), and at temperature > 0 each rank's
rejection sampler needs the draft probabilities of exactly the drafts the scheduler
sent. The inputs of every decision are the same on every rank (token ids, verified
counts, logits gathered across ranks, seeded random draws) except one: wall-clock
time, which feeds the cost models, the draft's stopping threshold and the step
arbiter. So those times are measured on rank 0 and broadcast (one small tensor per
step); on one rank nothing is sent.

Token-level proposers alone (``specplugin.Speculator``) need none of this: they run no
collective, and what a rank other than 0 drafts is never verified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


class RankZeroClock:
    """Timings as rank 0 of the tensor-parallel group measured them."""

    def __init__(self):
        self.group = _tensor_parallel_group()

    @property
    def shared(self) -> bool:
        return self.group is not None

    def agree(self, values: Sequence[float | None]) -> list[float | None]:
        """Rank 0's ``values`` on every rank (None travels as NaN)."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor([math.nan if v is None else float(v) for v in values],
                              dtype=torch.float64)
        tensor = self.group.broadcast(tensor, src=0)
        return [None if math.isnan(v) else v for v in tensor.tolist()]


def _tensor_parallel_group():
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_tp_group()
    except AssertionError:  # no distributed state (a drafter built alone, in tests)
        return None
    return group if group.world_size > 1 else None


def tensor_parallel_rank() -> int:
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_tp_group().rank_in_group
    except AssertionError:  # no distributed state
        return 0


def agree_array(clock: RankZeroClock, values: np.ndarray) -> np.ndarray:  # [n] seconds
    return np.asarray(clock.agree(values.tolist()), dtype=np.float64)

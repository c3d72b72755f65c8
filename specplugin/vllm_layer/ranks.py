"""Tensor parallelism: every rank takes the same drafting decisions, from rank 0's clock.

Every rank runs the drafter and must do the same work (sharded draft forwards stall on
collectives otherwise; each rank's rejection sampler needs the draft probs of the drafts
the scheduler sent). All decision inputs agree across ranks except wall-clock time, so
timings are measured on rank 0 and broadcast (one small tensor per step; none on one rank),
and failures: a proposer or a draft pass's inputs failing on one rank fail on all
(:meth:`RankZeroClock.any_rank`, a small all-reduce after the proposers and before each
draft forward). Token-level proposers (``specplugin.Speculator``) need none of this.
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

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag as set on any rank (one small all-reduce): a failure on one rank becomes
        every rank's, so all take the same fallback (:meth:`Union.ask`, the draft's passes)."""
        if self.group is None:
            return list(flags)
        tensor = torch.tensor([float(f) for f in flags], dtype=torch.float32)
        return [v > 0 for v in self.group.all_reduce(tensor).tolist()]


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

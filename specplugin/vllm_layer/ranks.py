"""Tensor parallelism: every rank takes the same drafting decisions, from rank 0's clock.

Every rank runs the drafter and must do the same work (sharded draft forwards stall on
collectives otherwise; each rank's rejection sampler needs the draft probs of the drafts
the scheduler sent). All decision inputs agree across ranks except wall-clock time, so
timings are measured on rank 0 and broadcast (one small tensor per step; none on one rank),
and failures: a proposer or a draft pass's inputs failing on one rank fail on all
(:meth:`RankZeroClock.any_rank`, a small all-reduce after the proposers and before each
draft forward). Token-level proposers (``specplugin.Speculator``) need none of this.

These collectives run on the group's host (gloo) group, whatever the device, and wait at
most :data:`RANK_WAIT_S`: a rank that never arrives (stuck or gone) ends the engine with
:class:`RanksDidNotAgree` naming the agreement point, instead of a hang.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch


# the longest one rank waits for the others at an agreement point (they meet every step,
# so anything near this means a rank is stuck or gone)
RANK_WAIT_S = 300.0


class RanksDidNotAgree(BaseException):
    """A tensor-parallel rank waited :data:`RANK_WAIT_S` for the others and gave up. Not an
    ``Exception``: the guards that turn a drafting failure into a plain step must let it
    through, since the group cannot be used again and the engine has to stop."""


class RankZeroClock:
    """Timings as rank 0 of the tensor-parallel group measured them. ``group``: a vLLM
    ``GroupCoordinator`` (default: the tensor-parallel group, if there is one)."""

    def __init__(self, group=None, wait_s: float = RANK_WAIT_S):
        self.group = group if group is not None else _tensor_parallel_group()
        self.wait_s = wait_s

    @property
    def shared(self) -> bool:
        return self.group is not None

    def agree(self, values: Sequence[float | None]) -> list[float | None]:
        """Rank 0's ``values`` on every rank (None travels as NaN)."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor([math.nan if v is None else float(v) for v in values],
                              dtype=torch.float64)
        self._wait(torch.distributed.broadcast(tensor, src=self.group.ranks[0],
                                               group=self.group.cpu_group, async_op=True),
                   "rank 0's timings (broadcast)")
        return [None if math.isnan(v) else v for v in tensor.tolist()]

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag as set on any rank (one small all-reduce): a failure on one rank becomes
        every rank's, so all take the same fallback (:meth:`Union.ask`, the draft's passes)."""
        if self.group is None:
            return list(flags)
        tensor = torch.tensor([float(f) for f in flags], dtype=torch.float32)
        self._wait(torch.distributed.all_reduce(tensor, group=self.group.cpu_group,
                                                async_op=True),
                   "the failure flags (all-reduce)")
        return [v > 0 for v in tensor.tolist()]

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.wait_s))
        except RuntimeError as err:
            raise RanksDidNotAgree(
                f"specplugin: tensor-parallel rank {self.group.rank_in_group} waited "
                f"{self.wait_s:.0f} s for the other ranks at {what}; a rank is stuck or "
                f"has died, so this engine stops rather than hang ({err})") from err


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

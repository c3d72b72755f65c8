"""Tensor parallelism: rank 0 decides the drafting, the other ranks follow.

Every rank runs the drafter and must do the same work: the draft model's forwards are
sharded (a rank left alone in one waits forever), and each rank's rejection sampler needs
the probabilities of exactly the drafts the scheduler sent (each rank samples the same
tokens from them). The ranks' own plans cannot be trusted to agree: a proposer that failed
on one rank only leaves its index, hence its later offers, different there. So rank 0 plans
and tells the others (:meth:`RankZeroClock.tell`): before the draft model would run, which
run (none, or each row's cap); after it, which rows send the draft's tokens and the others'
tokens. The draft run's own per-position choices follow from state every rank keeps the
same (the draft's logits, what verification accepted, rank 0's timings broadcast once per
step: :meth:`RankZeroClock.agree`). Before each draft forward one small all-reduce checks
that every rank is ready for a forward of the same size (:meth:`RankZeroClock.all_ready`).
Token-level proposers alone (``specplugin.Speculator``) need none of this: their drafts
are deterministic, and the scheduler verifies rank 0's.

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

from specplugin.adaptive.plan import StepPlan


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

    @property
    def leads(self) -> bool:
        """This rank decides: rank 0, or no group."""
        return self.group is None or self.group.rank_in_group == 0

    def tell(self, values: Sequence[int] | None, size: int, what: str) -> list[int]:
        """Rank 0's ``values`` (at most ``size`` ints) on every rank; the others pass None."""
        if self.group is None:
            return list(values)
        tensor = torch.zeros(size + 1, dtype=torch.int64)
        if values is not None:
            tensor[0] = len(values)
            tensor[1:1 + len(values)] = torch.as_tensor(values, dtype=torch.int64)
        self._wait(torch.distributed.broadcast(tensor, src=self.group.ranks[0],
                                               group=self.group.cpu_group, async_op=True),
                   f"rank 0's {what} (broadcast)")
        return tensor[1:1 + int(tensor[0])].tolist()

    def all_ready(self, ready: bool, size: int) -> tuple[bool, bool]:
        """(every rank is ready, every rank's forward has ``size`` tokens): one all-reduce."""
        if self.group is None:
            return ready, True
        tensor = torch.tensor([0.0 if ready else 1.0, size, -size], dtype=torch.float64)
        self._wait(torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX,
                                                group=self.group.cpu_group, async_op=True),
                   "the draft forward's readiness (all-reduce)")
        failed, largest, smallest = tensor.tolist()
        return failed == 0, largest == -smallest

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


def lead(drafter, batch, verified) -> StepPlan:
    """Rank 0: the union's plan, its draft run told to the others (in ``drafter.run``),
    then the plan told, failure or not, so that they never wait."""
    drafter.told, plan = None, None
    try:
        plan = drafter.union.step(batch, verified, draft=drafter)
        return plan
    finally:
        if drafter.told is None:
            drafter.clock.tell([0], 1, "draft run")  # no run: nothing of the draft's sent
        elif not drafter.told:  # (a held run sends every drafting row's whole run)
            values = plan_values(plan, batch.num_reqs, drafter.union.draft_index,
                                 drafter.k_max)
            drafter.clock.tell(values, len(values), "plan")


def follow(drafter, batch) -> StepPlan:
    """Another rank: rank 0's draft run, then rank 0's plan (see :func:`lead`)."""
    num_reqs = batch.num_reqs
    told = drafter.clock.tell(None, 2 + num_reqs, "draft run")
    if not told[0]:
        return StepPlan.plain(num_reqs)
    held, caps = bool(told[1]), told[2:]
    try:
        drafter.run(batch, caps, held)
    finally:
        if not held:
            values = drafter.clock.tell(None, num_reqs * (2 + drafter.k_max), "plan")
    if held:  # every drafting row sends its whole run (as Union.choose_held plans it)
        return StepPlan(None, [None] * num_reqs, [[] for _ in range(num_reqs)])
    return plan_from_values(values, num_reqs, drafter.union.draft_index, drafter.k_max)


def ready_everywhere(clock: RankZeroClock, cursor, error: Exception | None,
                     req_ids: list[str], num_tokens: int) -> Exception | None:
    """Before a sharded draft forward of ``num_tokens``: ``error``, or an error if another
    rank is not ready or would run a forward of another size (a rank alone in the forward
    waits forever). A size that differs means the ranks' draft KV cursors do: every rank
    then re-reads ``req_ids`` whole at their next run."""
    ready, same_size = clock.all_ready(error is None, num_tokens)
    if not same_size:
        cursor.forget(req_ids)
        return error or RuntimeError("the draft forward's size differs between "
                                     "tensor-parallel ranks")
    if not ready and error is None:
        return RuntimeError("a draft pass's inputs failed on another tensor-parallel rank")
    return error


def plan_values(plan: StepPlan | None, num_reqs: int, draft_index: int,
                k_max: int) -> list[int]:
    """``plan`` as rank 0 tells it: per row, whether it sends the draft model's tokens, how
    many, and the tokens (padded to ``k_max``); no drafts if the plan failed (None)."""
    values = [0] * (num_reqs * (2 + k_max))
    if plan is None or plan.drafts is None:
        return values
    for r, (draft, source) in enumerate(zip(plan.drafts, plan.sources)):
        start = r * (2 + k_max)
        values[start:start + 2 + len(draft)] = [int(source == draft_index), len(draft), *draft]
    return values


def plan_from_values(values: list[int], num_reqs: int, draft_index: int,
                     k_max: int) -> StepPlan:
    """The plan :func:`plan_values` told (another proposer's rows: source -1)."""
    drafts, sources, width = [], [], 2 + k_max
    for start in range(0, num_reqs * width, width):
        is_draft, length = values[start], values[start + 1]
        drafts.append(values[start + 2:start + 2 + length])
        sources.append(draft_index if is_draft else -1 if length else None)
    return StepPlan(drafts, sources, [[] for _ in range(num_reqs)])


def agree_array(clock: RankZeroClock, values: np.ndarray) -> np.ndarray:  # [n] seconds
    return np.asarray(clock.agree(values.tolist()), dtype=np.float64)

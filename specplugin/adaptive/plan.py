"""The step's plan: what :meth:`Union.step <specplugin.adaptive.union.Union.step>` returns,
the draft model as the step runs it, and the flat plan the compiled planner fills. vLLM-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specplugin.adaptive.controller import NO_CANDIDATE, Choice
from specplugin.proposers.base import Candidate, StepBatch


@dataclass(slots=True)
class StepPlan:
    """One step's decision for the whole batch, what :meth:`Union.step` and
    :meth:`Union.choose` return: each row's draft, whose candidate it is, and the extra
    candidates the batch-expanding scorer verifies beside it."""

    # [num_reqs] token ids each row verifies ([]: none); None from choose_held, whose
    # caller holds the tokens (the draft model's run)
    drafts: list[list[int]] | None
    sources: list[int | None]  # [num_reqs] proposer index of each row's draft (None: none)
    alternates: list[list[list[int]]]  # [num_reqs] extra candidates per row (the scorer's)

    @classmethod
    def plain(cls, num_reqs: int) -> StepPlan:
        """No row verifies anything."""
        return cls([[] for _ in range(num_reqs)], [None] * num_reqs,
                   [[] for _ in range(num_reqs)])


@dataclass(slots=True)
class DraftOutput:
    """One draft-model run: per row, the tokens its stop rule kept."""

    lengths: list[int]  # [num_reqs] draft tokens per row (0: it did not draft)
    signals: list[list[float]]  # [num_reqs][length] the draft's confidence per token
    num_forwards: int  # forwards the run made (its first pass included)
    # [num_reqs] the rows' drafts as candidates (None in a held step, which needs none)
    candidates: list[Candidate | None] | None = None


class DraftModel(Protocol):
    """The draft model as the vLLM layer runs it inside :meth:`Union.step`: the facts its
    prices need, and its run."""

    ran_last_step: bool  # it ran in the step before (its first pass is then warm)

    def catch_up_tokens(self, batch: StepBatch) -> list[int]:
        """[num_reqs] tokens each row's first pass would read beyond its newest."""
        ...

    def param_ratio(self) -> float:
        """Draft / target parameters (its forward's price before one was timed)."""
        ...

    def run(self, batch: StepBatch, caps: list[int], held: bool) -> DraftOutput:
        """Draft up to ``caps[r]`` tokens for each row with ``caps[r] > 0`` (``held``: no
        candidates needed)."""
        ...


@dataclass
class FlatPlan:
    """One step's offers and plan as the union's ``_plan`` made it
    (:func:`kernels.plan_offers <specplugin.adaptive.kernels.plan_offers>`): offer ``o`` is
    ``offers[o]`` (in row order), its tokens' cells ``cells[starts[o]:starts[o + 1]]``.
    The arrays are views of the union's buffers, valid until its next plan."""

    offers: list  # [num_offers] (row, proposer index, candidate)
    cells: np.ndarray  # [num_tokens] each offered token's estimator cell
    starts: list[int]  # [num_offers + 1]
    # [2 * num_tokens + num_reqs] each token's estimate (mean or draw), each token's
    # cumulative estimate along its offer, each row's best offer's worth at the price
    estimates: np.ndarray
    offer: list[int]  # [num_reqs] each row's chosen offer (-1: none)
    num_tokens: list[int]  # [num_reqs] the tokens it verifies of it
    best_offer: list[int]  # [num_reqs] each row's best offer before the prefix's cut
    expected: float  # tokens the step is expected to emit
    seconds: float  # its predicted seconds (the draft's forwards not included)

    def values(self) -> list[float]:
        """:attr:`estimates` as floats (one conversion; see :meth:`acceptance`)."""
        return self.estimates.tolist()

    def acceptance(self, values: list[float] | None = None) -> list[list]:
        """[num_reqs][candidates] each row's offers' token estimates, in offer order
        (lists, from ``values``, else arrays)."""
        values = self.estimates if values is None else values
        out: list[list] = [[] for _ in self.offer]
        for o, (r, _, _) in enumerate(self.offers):
            out[r].append(values[self.starts[o]:self.starts[o + 1]])
        return out

    def best(self, values: list[float]) -> list[tuple[int, list[float], float]]:
        """[num_reqs] each row's candidate worth most at the step's price, as
        :func:`~specplugin.adaptive.controller.best_candidates` gives it: (index in the
        row, cumulative estimates, worth), from ``values`` (:meth:`values`)."""
        total = self.starts[-1]
        first = self._first()
        out = []
        for r, o in enumerate(self.best_offer):
            if o < 0:
                out.append((NO_CANDIDATE, [], 0.0))
            else:
                out.append((o - first[r], values[total + self.starts[o]:total + self.starts[o + 1]],
                            values[2 * total + r]))
        return out

    def choices(self) -> list[Choice]:
        """[num_reqs] the plan as the controller's choices (candidates indexed per row)."""
        first = self._first()
        return [Choice(o - first[r], k) if o >= 0 else Choice(NO_CANDIDATE, 0)
                for r, (o, k) in enumerate(zip(self.offer, self.num_tokens))]

    def _first(self) -> dict[int, int]:
        """Row -> its first offer."""
        first: dict[int, int] = {}
        for o, (r, _, _) in enumerate(self.offers):
            first.setdefault(r, o)
        return first

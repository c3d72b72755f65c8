"""The draft model's gate, in numbers: its candidate's estimate before it runs, the number
of forwards that pays, a step's expected tokens and seconds; and the backoff that spaces
out asks that keep finding nothing (the gate's, the plain steps' peeks, the held steps'
looks). :meth:`Union.plan_draft <specplugin.adaptive.union.Union.plan_draft>` puts them
together; the derivation is in docs/design.md. vLLM-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specplugin.adaptive.controller import (NO_CANDIDATE, Choice, cumulative, plan, planned,
                                           token_price, with_candidates)
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.estimator import AcceptanceEstimator
from specplugin.proposers.base import StepBatch

# The rows an untried draft model's trial runs for (see Union.plan_draft).
DRAFT_TRIAL_ROWS = 2


@dataclass
class Backoff:
    """Asks spaced out while they find nothing (the plain steps' peeks, the draft's gate):
    after ``patience`` asks in a row that found nothing the gap to the next one doubles
    with each further one, up to a limit; after one that found something, or when new
    text arrives, the next step asks again."""

    gap: int = 1  # steps from one ask to the next
    wait: int = 0  # steps until the next ask
    patience: int = 1  # asks in a row that find nothing before the gap grows
    misses: int = 0  # asks in a row that found nothing

    def due(self) -> bool:
        """Whether this step asks (else one step of the wait is spent)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def asked(self, found: bool, limit: int) -> None:
        """This step asked and ``found`` something (or not): the next ask is due in 1, or,
        from the ``patience``-th miss in a row, in the doubled gap (at most ``limit``)."""
        if found:
            self.gap, self.misses = 1, 0
        else:
            self.misses += 1
            if self.misses >= self.patience:
                self.gap = min(2 * self.gap, limit)
        self.wait = self.gap - 1

    def reset(self) -> None:
        self.gap, self.wait, self.misses = 1, 0, 0

    def skip(self, steps: int) -> None:
        """``steps`` steps went by that could not ask (an ask coming due waits for the
        next step that can)."""
        self.wait = max(0, self.wait - steps)



def trial_rows(lengths: list[int],
                catch_up_seconds: Sequence[float] | None) -> tuple[int, ...]:
    """The rows a trial of the draft runs for on its optimistic estimate: of those
    that may use it (``lengths`` [num_reqs] > 0), the :data:`DRAFT_TRIAL_ROWS` whose
    first pass reads least (``catch_up_seconds``; the first rows without it)."""
    rows = [r for r, n in enumerate(lengths) if n]
    if catch_up_seconds is not None:
        rows.sort(key=lambda r: catch_up_seconds[r])
    return tuple(rows[:DRAFT_TRIAL_ROWS])


def add_draft_estimates(estimator: AcceptanceEstimator, explore: bool, batch: StepBatch,
                        lengths: list[int], histories: list[int], acceptance: list[list],
                        draft_index: int,
                        trial_rows: tuple[int, ...]) -> list[tuple[int, int, list]]:
    """Append to ``acceptance`` each row's draft candidate before it runs (``lengths``
    [num_reqs] tokens: its pooled cells, one posterior draw per cell shared by the rows;
    a trial row's as if every token were accepted); returns (row, index, estimates)."""
    sampled, pooled_cells = batch.sampled, estimator.pooled_cells
    pooled: dict[tuple, list[float]] = {}  # (mode, history, n) -> the rows' shared cells
    added = []
    for r, n in enumerate(lengths):
        if not n:
            continue
        if r in trial_rows:  # untried: as if every token were accepted
            draft = [1.0 - 1e-6] * n
        else:
            key = (sampled[r], histories[r], n)
            draft = pooled.get(key)
            if draft is None:
                draft = pooled[key] = pooled_cells(draft_index, sampled[r], histories[r],
                                                   n, draw=explore)
        acceptance[r].append(draft)
        added.append((r, len(acceptance[r]) - 1, draft))
    return added


def plan_with_draft(cost: StepCostModel, acceptance, best, added,
                    lengths: list[int]) -> tuple[list[Choice], list[int]]:
    """(the plan with the draft's candidates ``added``, [num_reqs] draft tokens of the rows
    that choose the draft in it; all 0: none). The token-level candidates are not weighed
    again: a row takes the draft's only if it is worth more than the row's ``best`` (one
    plan fewer when no row does)."""
    best_with, gains_draft = with_candidates(best, added, token_price(cost, len(lengths)))
    if not gains_draft:
        return [], [0] * len(lengths)
    with_draft = planned(acceptance, cost, spec_overhead=cost.spec_overhead_s,
                         best=best_with)[0]
    return with_draft, [c.num_tokens if n and c.candidate == len(acceptance[r]) - 1 else 0
                        for r, (c, n) in enumerate(zip(with_draft, lengths))]


def best_forwards(cost: StepCostModel, acceptance, with_draft: list[Choice], k: list[int],
                   num_reqs: int, overhead: float, forward_seconds: float,
                   rate_without: float) -> tuple[int, float]:
    """(m, its rate): the number of draft forwards whose step, the with-draft plan cut to
    m forwards (the draft rows add their P_m while they have an m-th token, the other
    rows' part fixed), emits the most tokens per second; 0 where none beats
    ``rate_without``."""
    others = [Choice(NO_CANDIDATE, 0) if k[r] else c for r, c in enumerate(with_draft)]
    expected = rate_terms(cost, acceptance, others)[0]
    num_tokens = num_reqs + sum(c.num_tokens for c in others)
    gains, reach = [0.0] * max(k), [0] * max(k)  # [max k] sum of P_m, rows with an m-th
    for r, kr in enumerate(k):
        if not kr:  # (a row without the draft may have no candidate at all: nothing to add)
            continue
        for j, p in enumerate(cumulative(acceptance[r][-1][:kr])):
            gains[j] += p
            reach[j] += 1
    best, best_rate = 0, rate_without
    for m in range(1, len(gains) + 1):
        expected += gains[m - 1]
        num_tokens += reach[m - 1]
        rate = expected / (cost.step_one(num_tokens) + overhead + forward_seconds * m)
        if rate > best_rate:
            best, best_rate = m, rate
    return best, best_rate


def step_seconds(cost: StepCostModel, num_tokens: int, drafts: bool) -> float:
    """Seconds of a step of ``num_tokens`` query tokens as ``cost`` now prices it
    (``drafts``: it verifies some, and pays the speculative machinery)."""
    return cost.step_one(num_tokens) + (cost.spec_overhead_s if drafts else 0.0)


def rate_terms(cost: StepCostModel, acceptance, choices) -> tuple[float, float]:
    """(expected tokens emitted, seconds) of a step that verifies ``choices``."""
    expected, num_tokens = float(len(choices)), len(choices)
    for r, c in enumerate(choices):
        if c.candidate != NO_CANDIDATE:
            expected += sum(cumulative(acceptance[r][c.candidate][:c.num_tokens]))
            num_tokens += c.num_tokens
    return expected, step_seconds(cost, num_tokens, num_tokens > len(choices))


def run_overhead(estimator: AcceptanceEstimator, cost: StepCostModel, acceptance,
                 k: list[int], draft_index: int, batch: StepBatch, histories: list[int],
                 run_seconds: float, catch_up_seconds: Sequence[float] | None,
                 remaining_tokens: Sequence[int] | None,
                 warm_run_seconds: float | None) -> tuple[float, bool, float]:
    """(seconds a run adds beyond its forwards this step, whether a row catches up, a cold
    run's excess): the speculative machinery and the run's fixed cost, with one-time costs
    (catch-up reading, a cold run's excess) spread over the steps left of the rows expected
    to keep drafting (see :meth:`Union.plan_draft <specplugin.adaptive.union.Union.plan_draft>`)."""
    overhead = cost.spec_overhead_s + run_seconds
    behind = ([] if catch_up_seconds is None else  # the first pass's catch-up rows
              [r for r, (c, kr) in enumerate(zip(catch_up_seconds, k)) if kr and c > 0.0])
    cold = (0.0 if warm_run_seconds is None
            else max(0.0, run_seconds - warm_run_seconds))
    asked = [r for r, kr in enumerate(k) if kr] if cold > 0.0 else behind
    kept_on = (set() if remaining_tokens is None or not asked
               else draft_kept_on(estimator, cost, acceptance, asked, draft_index, batch,
                                  histories))
    share = {}  # [kept-on rows] the part of a one-time cost that falls to this step
    for r in kept_on:  # one step of the row's steps left
        emitted = 1.0 + sum(cumulative(acceptance[r][-1][:k[r]]))
        share[r] = min(1.0, emitted / max(1, remaining_tokens[r]))
    if share and cold > 0.0:  # the run after it is warm for as long as a row drafts
        overhead -= cold * (1.0 - min(share.values()))
    for r in behind:
        overhead += catch_up_seconds[r] * share.get(r, 1.0)
    return overhead, bool(behind), cold


def draft_kept_on(estimator: AcceptanceEstimator, cost: StepCostModel, acceptance,
                  rows: list[int], draft_index: int, batch: StepBatch,
                  histories: list[int]) -> set[int]:
    """Of ``rows`` (draft rows whose draft KV is behind), those whose draft candidate the plan
    also chooses at the posterior means: expected to keep drafting, so a catch-up paid now
    serves later steps too. A row chosen only by this step's draw or a trial is not."""
    means = list(acceptance)
    for r in rows:
        means[r] = acceptance[r][:-1] + [estimator.pooled_cells(
            draft_index, batch.sampled[r], histories[r], len(acceptance[r][-1]))]
    chosen = plan(means, cost, spec_overhead=cost.spec_overhead_s)
    return {r for r in rows if chosen[r].candidate == len(acceptance[r]) - 1}

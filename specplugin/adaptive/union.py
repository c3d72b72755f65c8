"""The union: every configured proposer is asked each step; the controller picks per request.

One step of :meth:`Union.step`, in order:

1. **learn** from the step just verified (:class:`Verified`): its wall time -> the cost
   model and the step arbiter, at once (they decide this step); for each request that
   had drafts, which of them were accepted, and how the offers of other proposers it did
   not send compare with the tokens it emitted -> the difficulty estimator and the
   request's recent acceptance, once this step's plan is made, in the worker's wait
   for its next step where a deferred :class:`~specplugin.adaptive.background.Background`
   runs it (it shapes later plans, not this one);
2. **ask** every proposer for candidates (a proposer that raises is counted and
   costs its own candidates only, never a request), unless the step arbiter
   (:mod:`specplugin.adaptive.arbiter`) has measured that plain decoding is faster
   at this batch size: then the step decodes plainly and no proposer runs;
3. **estimate** each candidate token's acceptance probability;
4. **choose**, for the whole batch, which candidate and how many of its tokens
   each request verifies (:func:`specplugin.adaptive.controller.plan`; none where
   nothing pays);
5. **remember** what was proposed, to learn from it next step.

It returns one :class:`StepPlan` for the batch: each row's draft, whose candidate it is,
and the extra candidates the batch-expanding scorer verifies beside it (nothing read back
from the union afterwards).

Everything here is vLLM-free; the vLLM layer builds the :class:`StepBatch` and the
:class:`Verified` record from the engine's buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specplugin.adaptive import kernels
from specplugin.adaptive.arbiter import StepArbiter
from specplugin.adaptive.background import Background
from specplugin.adaptive.controller import (NO_CANDIDATE, Choice, cumulative,
                                           divergence, expand, plan, planned, token_price,
                                           with_candidates)
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.draft_rule import CostModel as DraftCostModel, draft_prices
from specplugin.adaptive.estimator import (AcceptanceEstimator, RequestHistory, as_list,
                                           expected_emitted, history_bucket, judged_outcomes)
from specplugin import trace
from specplugin.metrics import FailureCounter, ProposerStats
from specplugin.config import MODEL_PROPOSERS
from specplugin.proposers.base import Candidate, Proposer, StepBatch

logger = logging.getLogger("specplugin")
# Backoffs: asks that keep finding nothing are spaced out, the gap doubling up to a limit,
# and back to 1 when one finds something or new requests join (_Backoff).
# Plain steps between two peeks (plain_step): a peek costs ~0.1 ms, 1-3% of a small
# model's plain step, and a copy stays in sight as long as it runs.
MAX_PEEK_GAP = 8
# Speculative steps between two asks of the draft model's gate (plan_draft), once it kept
# the draft off GATE_PATIENCE times in a row: the gate prices the draft's candidate with
# a second plan, about twice the token-level proposers' share of the step.
MAX_GATE_GAP = 8
GATE_PATIENCE = 2  # one posterior draw keeping the draft off is noise; two say more
# Speculative steps between two full looks while every row keeps choosing the draft model
# (holding): a held step runs the draft as the last look planned and asks nothing else.
# A greedy batch looks more often: a copy can come in sight at any step and pays several
# tokens a step.
MAX_HOLD_GAP = 8
MAX_HOLD_GAP_GREEDY = 2
HOLD_PATIENCE = 3
# An untried draft model runs on an optimistic estimate in its first DRAFT_TRIALS gated
# steps (until DRAFT_TRIAL_EVIDENCE of its tokens are judged), for the DRAFT_TRIAL_ROWS
# rows whose first pass reads least: its worth is learnt only by running it.
DRAFT_TRIALS = 4
DRAFT_TRIAL_EVIDENCE = 8.0
DRAFT_TRIAL_ROWS = 2
# The estimator learns the verdicts of LEARN_EVERY steps in one update (an update and its
# sums were a third of the union's per-step work), except while cold (fewer than
# COLD_TOKENS judged tokens): there every verdict moves the plan most, so it learns at once.
LEARN_EVERY = 4
COLD_TOKENS = 64
_NO_SIGNAL = np.empty(0)  # an offer learned by its cells (see Union._offers_not_sent)


def judge_guess(tokens: np.ndarray, emitted: np.ndarray) -> tuple[int, int]:
    """(tokens judged, tokens accepted) of an unsent guess against the tokens emitted since
    it was made: accepted while equal, the first that differs judged and rejected, tokens
    past the emitted ones not judged. What verification would have said: exactly at
    temperature 0, in expectation above (a fixed guess x is accepted with p(x))."""
    seen = min(len(tokens), len(emitted))
    differs = np.flatnonzero(tokens[:seen] != emitted[:seen])
    accepted = int(differs[0]) if differs.size else seen
    return min(accepted + 1, seen), accepted


@dataclass(frozen=True)
class Scored:
    """How a request's candidates fared when the batch-expanding scorer verified extra
    candidates beside its draft (None where the acceptance rule does not tell)."""

    own_accepted: int | None  # tokens of the draft itself that the target accepted
    extra_accepted: tuple[int | None, ...]  # per extra candidate, in the order sent
    extra_lengths: tuple[int, ...]  # tokens of each extra candidate actually verified
    winner: int | None  # index of the extra candidate whose tokens were emitted (None: the draft's)


@dataclass(slots=True)
class Verified:
    """The engine step that just ran, for the requests of the current batch rows."""

    req_ids: tuple[str, ...]  # [num_reqs]
    # [num_reqs] draft tokens the target verified per row (a list, or an array)
    num_scheduled_drafts: Sequence[int] | np.ndarray
    num_emitted: Sequence[int] | np.ndarray  # [num_reqs] tokens each row emitted (accepted + 1)
    seconds: float | None  # wall time of the step (None: unknown, e.g. the first one)
    num_query_tokens: int  # tokens the target ran in it (all rows, drafts included)
    scored: dict[str, Scored] | None = None  # req_id -> outcome, for requests with extras
    # seconds of ``seconds`` the draft model's forwards took (priced apart: plan_draft)
    draft_seconds: float = 0.0
    # [num_reqs] each verified draft token's acceptance probability, where the verifier
    # knew it (None: it did not); sampled rows learn these instead of the verdicts (see
    # _learn)
    expected: Sequence[Sequence[float]] | None = None
    # the step read prompt tokens: its time is a prefill's, which no cost model
    # nor the step arbiter learns from (see Union._observe)
    read_prompts: bool = False
    # [num_reqs] each row's last emitted token (its recovered or bonus token; -1: not
    # known), with which the offers the plan did not send are judged (see _learn_unchosen)
    next_tokens: Sequence[int] | None = None


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
class _Pending:
    proposer: int  # index of the proposer whose candidate was sent
    sampled: bool
    history: int  # the request's history bucket when it was sent
    signal: np.ndarray  # [k] signals of the k tokens sent for verification
    # a proposer's alternative (not its own best guess): verified only as an extra
    # candidate, and never learned from (see _learn_extras)
    alternative: bool = False
    # [k] the estimator cells of the tokens sent, where the plan had them (None: from
    # the signals when learned)
    cells: list[int] | None = None


@dataclass
class _Backoff:
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


@dataclass
class _Shadow:
    """A candidate the peek found on a plain step and did not send: judged against the
    tokens the target emits next (:meth:`Union._judge_shadows`)."""

    sent: _Pending
    tokens: np.ndarray  # [k] the candidate's tokens
    start: int  # the request's context length when it was found


@dataclass
class _FlatPlan:
    """One step's offers and plan as :meth:`Union._plan` made it
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


class Union:
    def __init__(self, proposers: Sequence[Proposer], cost: StepCostModel | None = None,
                 estimator: AcceptanceEstimator | None = None, explore: bool = True,
                 arbiter: StepArbiter | None = None, max_candidates: int = 1,
                 decoy_primary: bool = False, max_peek_gap: int = MAX_PEEK_GAP,
                 draft_always: bool = False, learn_every: int = LEARN_EVERY,
                 background: Background | None = None):
        """``explore``: one row per step (at random among those with candidates) is judged by
        posterior draws (Thompson sampling), the others by posterior means: a proposer unlucky
        early is tried again without every row of a large batch paying for exploration.
        ``arbiter``: switches whole steps to plain decoding where speculating does not pay
        (None: every step is planned). ``max_peek_gap``: :data:`MAX_PEEK_GAP`.
        ``draft_always``: tests only, the draft model runs in every speculative step.
        ``learn_every``: :data:`LEARN_EVERY`. ``background``: where verdicts are learned once
        the next plan is made (default inline)."""
        self.explore = explore
        self.arbiter = arbiter
        if arbiter is not None:
            arbiter.plain_rate_model = self._plain_rate
            arbiter.step_seconds_model = self._step_seconds
        self.proposers = list(proposers)
        names = tuple(p.name for p in self.proposers)
        self.estimator = estimator or AcceptanceEstimator(names)
        self.cost = cost or StepCostModel()
        self.draft_costs = DraftCostModel()  # what the draft model's runs cost, as timed
        self.draft_costs.deferred_flush = True  # (learned in the background, as the steps)
        self.failures = [FailureCounter(name, logger) for name in names]
        self.stats = ProposerStats()
        self.max_candidates = max_candidates
        self.decoy_primary = decoy_primary
        self._alternative_offers: list[tuple[int, int, Candidate]] = []  # this step's
        # the draft model's index, whose steady choice a held step keeps, and the proposer
        # plain_step's peek asks, the cheapest token-level one (None: the union has none)
        self._draft_index = next((i for i, p in enumerate(self.proposers)
                                  if p.name in MODEL_PROPOSERS), None)
        self._peek_index = next((i for name in ("ngram", "suffix")
                                 for i, p in enumerate(self.proposers) if p.name == name), None)
        self.max_peek_gap = max_peek_gap
        # the draft run plan_draft let go this step, priced for the arbiter's prediction:
        # (seconds a forward, a run's fixed seconds, forwards planned)
        self._draft_price = (0.0, 0.0, 0)
        # the row whose offers this step's estimates draw from the posterior (see
        # _explorer; None: not picked yet this step, -1: none)
        self._step_explorer: int | None = None
        # plan_draft's plan over this step's token-level candidates (their id()s, the
        # plan): choose reuses it when the draft then runs for no row
        self._gate_plan: tuple[frozenset[int], _FlatPlan] | None = None
        # the compiled plan's outputs, kept from step to step (grown when a step needs more)
        self._token_buffer = np.empty(0)  # each offered token's estimate
        self._plan_buffer = np.empty(0, dtype=np.int64)  # each row's offer, then its tokens
        self._cell_buffer = np.empty(0, dtype=np.int64)  # each offered token's cell
        # (this step's batch, its rows' history buckets): see _histories
        self._step_histories: tuple[StepBatch, list[int]] | None = None
        self.learn_every = learn_every
        self.draft_always = draft_always
        self.history = RequestHistory()
        self.background = background or Background()
        for proposer in self.proposers:  # (work a proposal need not wait for: Proposer)
            if hasattr(proposer, "defer"):
                proposer.defer = self.background.submit
        self.cost.deferred_flush = True  # held steps learned with the verdicts (_learn_held)
        # the verdicts begin() took from the step just verified, to learn once this step's
        # plan is made (release): (verified record, its drafts' _Pending, the extras')
        self._held: tuple[Verified, dict, dict, dict] | None = None
        self._start_learning()

    def _start_learning(self) -> None:
        """The union's own learned state as a fresh engine starts it (``__init__``,
        :meth:`forget_learned`)."""
        self.speculating = True  # this step's arbiter decision (see begin, plain_step)
        self._pending: dict[str, _Pending] = {}
        self._pending_extras: dict[str, list[_Pending]] = {}  # the scorer's extra candidates
        # req_id -> (the tokens it sent, the offers of other proposers it did not send and
        # their tokens): judged against what the target emits (see _learn_unchosen)
        self._unchosen: dict[str, tuple[list[int], list[tuple[_Pending, np.ndarray]]]] = {}
        self._shadows: dict[str, _Shadow] = {}  # req_id -> the peek's unsent candidate
        self._observed = False  # plain_step observed the last step and chose to speculate
        self._skipped_steps = 0  # plain steps since begin() last ran (estimator decay)
        self._peek = _Backoff()  # the plain steps' peeks (see MAX_PEEK_GAP)
        # the draft's gate, in speculative steps (see MAX_GATE_GAP and GATE_PATIENCE)
        self._gate = _Backoff(patience=GATE_PATIENCE)
        # the full looks while every row chooses the draft (see MAX_HOLD_GAP); a "miss"
        # is a look that confirmed the draft for every row
        self._hold = _Backoff(patience=HOLD_PATIENCE)
        self.holding = False  # this speculative step is held (no look)
        self._gate_k: list[int] | None = None  # the draft tokens this step's gate planned
        # what the last confirming look planned, for the held steps after it: the batch's
        # request ids, the draft's tokens per row, and the draft run's price (_draft_price)
        self._hold_plan: tuple[tuple, list[int], tuple[float, float, int]] | None = None
        self._draft_trials = DRAFT_TRIALS  # optimistic draft runs left (see plan_draft)
        # this step's time is not a rate of speculating that the step arbiter should weigh
        # (see _observe): it runs one of the draft's optimistic trials (its exploration),
        # or the draft's catch-up over the tokens decoded plainly just before it
        self._unrated_step = False
        self._last_plain = False  # the last decision kept its step plain
        self._after_plain = False  # this step speculates right after a plain one
        # verdicts not yet in the estimator: (sent, tokens judged, tokens accepted), and
        # the steps of decay it has not yet applied (see flush_learning)
        self._unlearned: list[tuple[_Pending, list]] = []
        self._undecayed_steps = 0
        self._learned_tokens = 0  # judged tokens flush_learning has taught (to COLD_TOKENS)

    def forget_learned(self) -> None:
        """Back to what a fresh engine knows: acceptance counts, request histories, the arbiter's
        rates, the draft's trials and the cost model's step observations are forgotten; the
        forwards timed at engine start, the proposers' indexes and the counters are kept.
        ``specplugin bench`` calls it after warming an engine up, so a cell starts as a user's
        engine does. Only between requests (nothing pending)."""
        self.settle()
        self._start_learning()
        if trace.TRACE is not None:
            trace.TRACE.write("forget")
        self.estimator.set_counts(0.0, 0.0)
        self.history = RequestHistory(self.history.alpha)
        self.cost.forget()
        self.draft_costs.forget()
        if self.arbiter is not None:
            self.arbiter.forget()

    def step(self, batch: StepBatch, verified: Verified | None,
             draft: DraftModel | None = None) -> StepPlan:
        """Learn from ``verified``, then the step's plan for ``batch``: ask the proposers,
        run ``draft`` (the draft model, if the union has one) where the gate says it pays,
        estimate, plan and remember (see the module docstring)."""
        if not self.begin(verified, batch.num_reqs, bool(np.mean(batch.sampled) > 0.5)):
            return StepPlan.plain(batch.num_reqs)
        index = self._draft_index
        if draft is None or index is None:
            return self.choose(batch, self.ask(batch, range(len(self.proposers))))
        caps = [0] * batch.num_reqs  # the rows whose request allows the draft: their K limit
        for r in batch.for_proposer(self.proposers[index].name).rows:
            caps[r] = int(batch.max_draft_lens[r])
        held = self.held_draft(batch, caps) if self.holding else None
        if held is not None:  # the last look's plan holds: nothing asked, nothing priced
            out = draft.run(batch, held, held=True)
            return self.choose_held(batch, out.lengths, out.signals, out.num_forwards)
        offers = self.ask(batch, [i for i in range(len(self.proposers)) if i != index])
        rows = sum(1 for c in caps if c > 0)
        k = None
        if rows and self.draft_gate_due():
            price = draft_prices(self.draft_costs, self.cost, rows, draft.catch_up_tokens(batch),
                                 draft.ran_last_step, draft.param_ratio)
            k = self.plan_draft(batch, offers, index, caps, price.forward_s, price.catch_up_s,
                                batch.remaining_tokens, run_seconds=price.run_s,
                                warm_run_seconds=price.warm_run_s)
        if k is None or not any(k):  # no draft-model machinery at all
            self.stats.steps_without_draft_model += 1
            return self.choose(batch, offers)
        out = draft.run(batch, k, held=False)  # (only rows with caps > 0 draft)
        offers += [(r, index, c) for r, c in enumerate(out.candidates)
                   if c is not None and len(c)]
        return self.choose(batch, offers, draft_forwards=out.num_forwards)

    @property
    def draft_index(self) -> int | None:
        """The draft model's index among :attr:`proposers` (None: the union has none)."""
        return self._draft_index

    def begin(self, verified: Verified | None, num_reqs: int, sampled: bool) -> bool:
        """Learn from ``verified``; return whether this step speculates (the arbiter's call;
        ``sampled``: most requests sample). A plain step needs nothing else. After
        :meth:`plain_step` said True, the step was already observed and decided there.

        The step's verdicts are held and handed to :attr:`background` by :meth:`release` once
        this step's plan is made (one step late, next to a memory of thousands of steps), except
        while the estimator is cold (:data:`COLD_TOKENS`), where each verdict counts most."""
        self.settle()
        self._alternative_offers = []
        self._draft_price = (0.0, 0.0, 0)
        self.holding, self._gate_k = False, None
        self._step_explorer, self._gate_plan = None, None
        self._step_histories = None
        observed, self._observed = self._observed, False
        unrated, self._unrated_step = self._unrated_step, False
        pending, self._pending = self._pending, {}
        pending_extras, self._pending_extras = self._pending_extras, {}
        unchosen, self._unchosen = self._unchosen, {}
        if verified is not None:
            if not observed:
                self._observe_verified(verified, pending, unrated)
            self._held = (verified, pending, pending_extras, unchosen)
        self._undecayed_steps += 1 + self._skipped_steps
        self._skipped_steps = 0
        if self._learned_tokens < COLD_TOKENS:  # cold: each verdict moves the plan, learn now
            held, self._held = self._held, None
            if held is not None:
                self._learn_held(*held)  # (cold: the estimator's update included)
            else:
                self.cost.flush_due()
                self.flush_learning()
        if self.arbiter is not None and not observed:
            self.speculating = self.arbiter.speculate(num_reqs, sampled)
            self._note_decision()
        if not self.speculating:
            if self._hold_plan is not None:
                self._end_hold()
            self._count_plain_step(num_reqs)
            self.release()
        else:
            self.holding = (self._hold_plan is not None and not self._after_plain
                            and not self._hold.due())
        return self.speculating

    def release(self) -> None:
        """This step's plan is made: what :meth:`begin` held (the verified step's
        verdicts, and the estimator's update when due) goes to :attr:`background`."""
        held, self._held = self._held, None
        if held is not None:
            self.background.submit(lambda: self._learn_held(*held))

    def settle(self) -> None:
        """Everything learned so far is in: held verdicts that were never released (a
        step whose drafting failed after :meth:`begin`) are learned now, and the
        background's jobs are waited for. Every reader of what learning writes (the next
        step, the counters, the saved state) calls this first."""
        if self._held is not None:
            self.release()
        self.background.settle()

    def _learn_held(self, verified: Verified, pending: dict, pending_extras: dict,
                    unchosen: dict) -> None:
        """The verdicts of ``verified`` (whose drafts ``pending`` and ``pending_extras``
        recorded, and the offers not sent ``unchosen``), then the estimator's update when
        one is due (see :data:`LEARN_EVERY`)."""
        self._learn_rows(verified, pending, pending_extras)
        self._learn_unchosen(verified, unchosen)
        self.cost.flush_due()
        if self._undecayed_steps >= self.learn_every or self._learned_tokens < COLD_TOKENS:
            self.flush_learning()

    def plain_step(self, seconds: float | None, num_reqs: int, num_query_tokens: int,
                   sampled: bool, peek: Callable[[], StepBatch] | None = None,
                   draft_seconds: float = 0.0, read_prompts: bool = False) -> bool:
        """The cheap path after a step that verified no draft: observe its time and say whether
        the next step speculates. False: the next step is plain and nothing runs for it. True:
        the caller plans it with :meth:`begin`. Always True without an arbiter or with drafts
        awaiting their verdict. ``draft_seconds``: the part of ``seconds`` the draft model ran,
        kept out of the cost model; ``read_prompts``: see :meth:`_observe`.

        ``peek``: the batch as it stands. Where the arbiter keeps the step plain, the cheapest
        token-level proposer is asked on it (:meth:`_copy_in_sight`); if the plan it allows
        beats the measured plain rate, the step speculates after all: a rate measured on earlier
        text must not keep decoding plainly through text that copies."""
        self.settle()
        if self.arbiter is None or self._pending or self._pending_extras:
            return True
        unrated, self._unrated_step = self._unrated_step, False
        self._observe(seconds, num_query_tokens, num_reqs, speculative=False,
                      draft_seconds=draft_seconds, unrated=unrated, read_prompts=read_prompts,
                      num_reqs=num_reqs)
        self.speculating = self.arbiter.speculate(num_reqs, sampled)
        if not self.speculating and peek is not None and self._peek.due():
            found = self._copy_in_sight(peek)
            if found:
                self.arbiter.speculate_now(num_reqs, sampled)
                self.speculating = True
                self.stats.steps_peeked += 1
            self._peek.asked(found, self.max_peek_gap)
        self._note_decision()
        if self.speculating:
            self._observed = True
        else:
            if self._hold_plan is not None:
                self._end_hold()
            self._skipped_steps += 1
            self._count_plain_step(num_reqs)
            self.stats.steps_skipped += 1
        return self.speculating

    def plain_steps_ahead(self) -> int:
        """After :meth:`plain_step` kept the next step plain: how many following decisions are
        foregone (the arbiter's plain block runs on), so those steps may run as the engine's
        own plain steps with only their times kept (:meth:`plain_steps_ran`). Each must decode
        one token per request of an unchanged batch. 0 while speculating. A peek that comes due
        within the run waits for the step that ends it."""
        if self.speculating or self.arbiter is None or self._pending or self._pending_extras:
            return 0
        return self.arbiter.plain_steps_ahead()

    def plain_steps_ran(self, seconds: Sequence[float], num_reqs: int) -> None:
        """Steps that :meth:`plain_steps_ahead` foretold ran, each in ``seconds`` of wall
        time, ``num_reqs`` requests decoding one token each: learn what :meth:`plain_step`
        would have learned from each (the cost model's and the arbiter's observations,
        the counters, the peek's countdown, a peek due then waiting for the next
        decision), without its decisions, which were foregone."""
        self.settle()
        for step_seconds in seconds:
            self._observe(step_seconds, num_reqs, num_reqs, speculative=False,
                          num_reqs=num_reqs)
        self._count_plain_step(num_reqs, len(seconds))
        self._skipped_steps += len(seconds)
        self.stats.steps_skipped += len(seconds)
        self._peek.skip(len(seconds))

    def _note_decision(self) -> None:
        """After this step's arbiter decision: whether it speculates right after plain
        steps (see :meth:`plan_draft`'s catch-up)."""
        self._after_plain = self.speculating and self._last_plain
        self._last_plain = not self.speculating

    def held_draft(self, batch: StepBatch, caps: Sequence[int]) -> list[int] | None:
        """In a held step (:attr:`holding`, see :data:`MAX_HOLD_GAP`): the draft tokens
        each row drafts (``caps`` [num_reqs] each row's limit), as the last full look
        planned them, with no proposer asked and no gate weighed. None when the step
        cannot be held (another batch than the look's, or a row that may not use the
        draft now): the hold ends and the step looks in full."""
        if not self.holding:
            return None
        req_ids, lengths, price = self._hold_plan
        if tuple(batch.req_ids) != req_ids or not all(c > 0 for c in caps):
            self._end_hold()
            return None
        self._draft_price = price
        return [min(c, n) for c, n in zip(caps, lengths)]

    def _update_hold(self, batch: StepBatch, sources: list[int | None],
                     draft_forwards: int | None) -> None:
        """After this step's plan: a full look that chose the draft model's candidate for
        every row (its run made ``draft_forwards``) spaces the next looks out (see
        :data:`MAX_HOLD_GAP`); any other plan, held or not, ends the hold."""
        draft = self._draft_index
        # (not with the scorer's extra candidates, which a held step does not weigh)
        confirmed = (draft is not None and bool(draft_forwards) and self.max_candidates == 1
                     and all(s == draft for s in sources))
        if not confirmed or (not self.holding and self._gate_k is None):
            if self._hold_plan is not None or self._hold.misses:
                self._end_hold()
            return
        if self.holding:
            return
        self._hold_plan = (tuple(batch.req_ids), self._gate_k, self._draft_price)
        self._hold.asked(False, MAX_HOLD_GAP if all(batch.sampled) else MAX_HOLD_GAP_GREEDY)

    def choose_held(self, batch: StepBatch, lengths: list[int], signals: list[list[float]],
                    draft_forwards: int) -> StepPlan:
        """A held step's plan (:attr:`holding`): each row sends what the draft model's run drafted
        for it (``lengths`` [num_reqs], ``signals`` its confidences), cut by the run's stop rule
        alone. The bookkeeping (pending drafts, counters, the arbiter's prediction) decides
        nothing this step, so it goes to :attr:`background`, ahead of the held verdicts (the same
        order as inline). ``drafts`` is None: the caller holds the tokens."""
        sources = [self._draft_index if k else None for k in lengths]
        self.background.submit(lambda: self._remember_held(batch, lengths, signals, sources,
                                                           draft_forwards))
        self.release()
        return StepPlan(None, sources, [[] for _ in range(batch.num_reqs)])

    def _remember_held(self, batch: StepBatch, lengths: list[int],
                       signals: list[list[float]], sources: list[int | None],
                       draft_forwards: int) -> None:
        """:meth:`choose_held`'s bookkeeping: each row's draft remembered (with its
        estimator cells), the counters, the arbiter's prediction, the hold's next look."""
        draft, num_reqs = self._draft_index, batch.num_reqs
        histories = self._histories(batch)
        self._pending, self._pending_extras, self._unchosen = {}, {}, {}
        stats, cells_of, name = self.stats, self.estimator.cells, self.proposers[draft].name
        stats.steps += 1
        sent_cells: list[list[int]] = []
        for r, k in enumerate(lengths):
            stats.k_histogram[k] += 1
            if not k:
                continue
            sampled, signal = bool(batch.sampled[r]), signals[r][:k]
            cells = cells_of(draft, sampled, histories[r], signal)
            self._pending[batch.req_ids[r]] = _Pending(draft, sampled, histories[r],
                                                       np.asarray(signal), cells=cells)
            sent_cells.append(cells)
            stats.chosen[name] += 1
        num_drafts = sum(lengths)
        if not num_drafts:
            stats.steps_without_drafts += 1
        if trace.TRACE is not None:
            trace.TRACE.write("plan", sources=[name if k else None for k in lengths], held=True)
        if self.arbiter is not None and (num_drafts or not self.arbiter.nothing_to_verify()):
            values = self.estimator.values([c for cells in sent_cells for c in cells])
            acceptance, i = [], 0  # [num_reqs][1] the sent tokens' posterior means
            for k in lengths:
                acceptance.append([values[i:i + k]])
                i += k
            expected, seconds = self._rate_terms(
                acceptance, [Choice(0, k) if k else Choice(NO_CANDIDATE, 0) for k in lengths])
            self._predict(expected, seconds, num_reqs, num_drafts, draft_forwards)
        self._update_hold(batch, sources, draft_forwards)

    def _predict(self, expected: float, seconds: float, num_reqs: int, num_drafts: int,
                 draft_forwards: int | None) -> None:
        """Tell the step arbiter what the step just planned should emit (``expected``
        tokens) and take: ``seconds`` without the draft model, whose forwards, if it ran,
        are the step's too (``draft_forwards`` as its run made them; None: the m forwards
        :meth:`plan_draft` priced)."""
        per_forward, run_seconds, planned_forwards = self._draft_price
        forwards = planned_forwards if draft_forwards is None else draft_forwards
        seconds += per_forward * forwards + run_seconds * (forwards > 0)
        self.arbiter.predicted(expected, seconds, num_reqs + num_drafts, num_drafts > 0)

    def _end_hold(self) -> None:
        """The next speculative step looks in full, and so does every one after it until
        looks confirm the draft again."""
        self._hold.reset()
        self._hold_plan = None
        self.holding = False

    def new_requests(self, num_new: int, num_reqs: int) -> None:
        """``num_new`` of the batch's ``num_reqs`` requests arrived: the next plain step peeks at
        once, the gate is asked again, the next speculative step looks in full (the hold was the
        old batch's), and the arbiter hears of it."""
        self.settle()
        if num_new > 0:
            self._peek.reset()
            self._gate.reset()
            self._hold_plan, self.holding = None, False
        if self.arbiter is not None:
            self.arbiter.new_requests(num_new, num_reqs)

    def _copy_in_sight(self, peek: Callable[[], StepBatch]) -> bool:
        """Whether the peek's proposer (n-gram, else suffix; if the union has either) finds,
        on the batch ``peek()`` returns, candidates the controller would verify (posterior
        means) in a step the arbiter judges faster than a plain one."""
        index = self._peek_index
        if index is None:
            return False
        batch = peek()
        self._judge_shadows(batch)
        offers = [(r, index, c) for r, c in enumerate(self._ask(index, batch)) if c is not None]
        if not offers:
            return False
        histories = self._histories(batch)
        for r, _, c in offers:  # judged once the target has emitted what they guess
            req_id = batch.req_ids[r]
            if req_id not in self._shadows:
                self._shadows[req_id] = _Shadow(
                    _Pending(index, bool(batch.sampled[r]), histories[r], np.asarray(c.signal)),
                    np.asarray(c.token_ids), int(batch.num_tokens[r]))
        acceptance: list[list[np.ndarray]] = [[] for _ in range(batch.num_reqs)]
        for (r, _, _), a in zip(offers, self._estimate(offers, batch, histories, explore=False)):
            acceptance[r].append(a)
        choices, expected, seconds = planned(acceptance, self.cost,
                                             spec_overhead=self.cost.spec_overhead_s)
        if not any(c.num_tokens for c in choices):
            return False
        return self.arbiter.pays_now(batch.num_reqs, expected / seconds,
                                     bool(np.mean(batch.sampled) > 0.5))

    def _judge_shadows(self, batch: StepBatch) -> None:
        """Judge the peek's unsent candidates against the tokens the target emitted since: token
        j counts as accepted if it and every token before it equal the emitted ones (what
        verification would say: exactly at temperature 0, in expectation above). Plain steps so
        teach the estimator what copying would bring. Judged once the emitted tokens differ from
        the candidate or cover it."""
        parts = []
        for r, req_id in enumerate(batch.req_ids):
            shadow = self._shadows.get(req_id)
            if shadow is None:
                continue
            emitted = batch.token_ids[r, shadow.start:int(batch.num_tokens[r])]
            judged, accepted = judge_guess(shadow.tokens, emitted)
            if judged == accepted < len(shadow.tokens):
                continue  # so far so good (or nothing emitted yet): wait for the rest
            parts.append((shadow.sent, judged_outcomes(None, r, False, judged, accepted)))
            self.history.update(req_id, judged, accepted)
            del self._shadows[req_id]
        if parts:  # learned at once: the peek's estimate that follows rests on them
            self._teach(parts)
            self.flush_learning()

    def _plain_rate(self, num_reqs: int) -> float | None:
        """Tokens per second of a plain step of ``num_reqs`` requests, as the cost model
        predicts it (None: it has timed no forward yet)."""
        if not self.cost.calibrated:
            return None
        return num_reqs / self.cost.step_one(num_reqs)

    def _step_seconds(self, num_tokens: int, drafts: bool) -> float:
        """Seconds of a step of ``num_tokens`` query tokens as the cost model now prices
        it (``drafts``: it verifies some, and pays the speculative machinery): what the
        step arbiter re-predicts its speculative blocks' steps with."""
        return self.cost.step_one(num_tokens) + (self.cost.spec_overhead_s if drafts else 0.0)

    def _count_plain_step(self, num_reqs: int, num_steps: int = 1) -> None:
        if self._pending or self._pending_extras or self._unchosen:  # (no new objects on
            self._pending, self._pending_extras, self._unchosen = {}, {}, {}  # every plain step)
        self.stats.steps += num_steps
        self.stats.steps_without_drafts += num_steps
        self.stats.k_histogram[0] += num_reqs * num_steps

    def _observe(self, seconds: float | None, num_query_tokens: int, num_emitted: int,
                 speculative: bool, draft_seconds: float = 0.0, unrated: bool = False,
                 read_prompts: bool = False, num_reqs: int = 1,
                 rate_tokens: float | None = None) -> None:
        """A step's wall time to the cost model (without ``draft_seconds``: :meth:`plan_draft`
        prices the draft's forwards itself) and to the step arbiter (all of it: what a block of
        such steps emits per second). An ``unrated`` step (one of the draft's optimistic trials,
        or a draft catch-up right after plain steps) is a one-off price, not the rate of
        speculating: the arbiter counts its tokens, not its time. A step that read prompt tokens
        (``read_prompts``) teaches neither: its time is the prompts' attention, which the forward
        curve does not price. ``rate_tokens``: the tokens the arbiter counts, if not
        ``num_emitted`` (:func:`~specplugin.adaptive.estimator.expected_emitted`)."""
        if trace.TRACE is not None:
            timed = seconds is not None and not read_prompts
            trace.TRACE.write("step", ms=seconds * 1e3 if timed else None,
                              query_tokens=num_query_tokens, emitted=num_emitted,
                              num_reqs=num_reqs, speculative=speculative,
                              draft_ms=draft_seconds * 1e3, unrated=unrated,
                              rate_tokens=rate_tokens)
        if read_prompts:
            seconds = None  # (the arbiter counts the step, not its time)
        if seconds is None:
            pass
        elif speculative or draft_seconds:
            self.cost.observe(num_query_tokens, max(seconds - draft_seconds, 1e-9),
                              speculative=speculative)
        else:  # a plain step: learned with the next ones of its size (StepSums)
            self.cost.observe_plain(num_query_tokens, seconds)
        if self.arbiter is not None:
            self.arbiter.observe(num_emitted if rate_tokens is None else rate_tokens,
                                 None if unrated else seconds)

    def ask(self, batch: StepBatch, proposers: Sequence[int]) -> list[tuple[int, int, Candidate]]:
        if not self.speculating:
            return []
        per_proposer = {i: self._ask(i, batch) for i in proposers}
        # a proposer's alternatives are for the scorer only (see _alternates): the choice
        # of each request's draft, and whether the draft model runs, stay the union's
        self._alternative_offers += [(r, i, alt) for i, cands in per_proposer.items()
                                     for r, c in enumerate(cands) if c is not None
                                     for alt in c.alternatives if len(alt)]
        return [(r, i, c) for i, cands in per_proposer.items()
                for r, c in enumerate(cands) if c is not None]

    def draft_gate_due(self) -> bool:
        """Whether this speculative step asks the draft model's gate (:meth:`plan_draft`): every
        step while the gate opens and right after plain steps (a re-check of speculation must
        weigh the draft); after :data:`GATE_PATIENCE` closings in a row, once every gap, doubling
        up to :data:`MAX_GATE_GAP`. A step that does not ask weighs the token-level candidates
        alone. The draft's optimistic trials wait for asked steps too."""
        return self.draft_always or self._after_plain or self._gate.due()

    def _draft_trial_due(self, draft_index: int) -> bool:
        """Whether the draft's next run is one of its optimistic trials (see
        :meth:`plan_draft`): trials left, and too few of its tokens judged yet."""
        return (self._draft_trials > 0
                and self.estimator.judged_tokens(draft_index) < DRAFT_TRIAL_EVIDENCE)

    def plan_draft(self, batch: StepBatch, offers, draft_index: int, caps: np.ndarray,
                   forward_seconds: float,
                   catch_up_seconds: Sequence[float] | None = None,
                   remaining_tokens: Sequence[int] | None = None,
                   run_seconds: float = 0.0,
                   warm_run_seconds: float | None = None) -> list[int]:  # [num_reqs]
        """Tokens the draft model drafts for each row this step (0: it does not run for it).

        The draft's candidate is unknown until it runs, and each drafted position costs
        ``forward_seconds`` whatever the rows. So the step is planned over the token-level
        ``offers`` alone, then with one more candidate per row that may use the draft (``caps``
        [num_reqs] > 0) whose acceptance is the estimator's pooled cells for the draft, one
        posterior draw per cell shared by all rows (Thompson sampling: one forward serves every
        row, so one guess at the draft's worth decides it). The draft runs for the rows that
        prefer it if some number of forwards m beats the plan without it::

            max_m E_with(m) / (T(n_with(m)) + run_seconds + forward_seconds * m)  >  E_without / T(n_without)

        A row may draft up to its planned ``k_r``: the run's stop rule (which sees the draft's
        confidence) decides how many forwards it makes. An untried draft runs on an optimistic
        estimate first (:data:`DRAFT_TRIALS`).

        One-time costs are spread over the steps they serve: ``catch_up_seconds`` [num_reqs]
        (the first pass reading tokens the draft KV lacks) and a cold run's excess over
        ``warm_run_seconds`` are divided over the row's ``remaining_tokens`` for rows expected to
        keep drafting (:meth:`_draft_kept_on`); charged to one step, they kept the draft off for
        good. ``run_seconds``: a run's cost beyond its forwards. See docs/design.md."""
        lengths_list = [n if n > 0 else 0 for n in as_list(caps)]  # [num_reqs]
        if not self.speculating or not any(lengths_list):
            return [0] * batch.num_reqs
        histories = self._histories(batch)
        offers = sorted(offers, key=lambda o: o[0])
        # the token-level candidates' plan: what choose also makes when the draft then
        # runs for no row (kept for it), and the rows' best candidates the draft must beat
        flat = self._plan(batch, offers, histories)
        self._gate_plan = (frozenset(id(c) for _, _, c in offers), flat)
        values = flat.values()
        acceptance = flat.acceptance(values)  # [num_reqs][candidates]
        best = flat.best(values)  # [num_reqs] the token-level candidates' best
        kept, kept_seconds = flat.expected, flat.seconds
        spec_overhead = self.cost.spec_overhead_s
        theta = token_price(self.cost, batch.num_reqs)
        if self.draft_always:
            self._draft_price = (forward_seconds, run_seconds, max(lengths_list))
            return lengths_list
        trial = self._draft_trial_due(draft_index)
        trial_rows = self._trial_rows(lengths_list, catch_up_seconds) if trial else ()
        added = self._add_draft_estimates(batch, lengths_list, histories, acceptance,
                                          draft_index, trial_rows)
        # the token-level candidates are not weighed again: a row takes the draft's only
        # if it is worth more than the row's best (one plan fewer when no row does)
        best_with, gains_draft = with_candidates(best, added, theta)
        if not gains_draft:  # no row would choose the draft's candidate: it cannot run
            self._gate.asked(False, MAX_GATE_GAP)
            return [0] * batch.num_reqs
        with_draft = planned(acceptance, self.cost, spec_overhead=spec_overhead,
                             best=best_with)[0]
        k = [c.num_tokens if n and c.candidate == len(acceptance[r]) - 1 else 0
             for r, (c, n) in enumerate(zip(with_draft, lengths_list))]  # [num_reqs]
        if not any(k):
            self._gate.asked(False, MAX_GATE_GAP)
            return [0] * batch.num_reqs
        overhead, catch_up, cold = self._run_overhead(
            acceptance, k, draft_index, batch, histories, run_seconds, catch_up_seconds,
            remaining_tokens, warm_run_seconds)
        best, best_rate = self._best_forwards(acceptance, with_draft, k, batch.num_reqs,
                                              overhead, forward_seconds, kept / kept_seconds)
        if trace.TRACE is not None:
            trace.TRACE.write("draft_plan", forwards=best, rate=best_rate,
                              rate_without=kept / kept_seconds, trial=trial,
                              catch_up=catch_up, cold_ms=cold * 1e3,
                              forward_ms=forward_seconds * 1e3, run_ms=run_seconds * 1e3,
                              overhead_ms=overhead * 1e3)
        if not best:
            self._gate.asked(False, MAX_GATE_GAP)
            return [0] * batch.num_reqs
        self._gate.asked(True, MAX_GATE_GAP)
        self._draft_price = (forward_seconds, run_seconds, best)  # (m: until choose knows)
        self._gate_k = k
        self._draft_trials -= trial
        self._unrated_step = trial or catch_up
        return k

    def _add_draft_estimates(self, batch: StepBatch, lengths: list[int], histories: list[int],
                             acceptance: list[list], draft_index: int,
                             trial_rows: tuple[int, ...]) -> list[tuple[int, int, list]]:
        """Append to ``acceptance`` each row's draft candidate before it runs (``lengths``
        [num_reqs] tokens: its pooled cells, one posterior draw per cell shared by the rows;
        a trial row's as if every token were accepted); returns (row, index, estimates)."""
        sampled, pooled_cells = batch.sampled, self.estimator.pooled_cells
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
                                                       n, draw=self.explore)
            acceptance[r].append(draft)
            added.append((r, len(acceptance[r]) - 1, draft))
        return added

    def _run_overhead(self, acceptance, k: list[int], draft_index: int, batch: StepBatch,
                      histories: list[int], run_seconds: float,
                      catch_up_seconds: Sequence[float] | None,
                      remaining_tokens: Sequence[int] | None,
                      warm_run_seconds: float | None) -> tuple[float, bool, float]:
        """(seconds a run adds beyond its forwards this step, whether it catches up right
        after plain steps, a cold run's excess): the speculative machinery and the run's
        fixed cost, with one-time costs (catch-up reading, a cold run's excess) spread
        over the steps left of the rows expected to keep drafting (see :meth:`plan_draft`)."""
        overhead = self.cost.spec_overhead_s + run_seconds
        behind = ([] if catch_up_seconds is None else  # the first pass's catch-up rows
                  [r for r, (c, kr) in enumerate(zip(catch_up_seconds, k)) if kr and c > 0.0])
        cold = (0.0 if warm_run_seconds is None
                else max(0.0, run_seconds - warm_run_seconds))
        asked = [r for r, kr in enumerate(k) if kr] if cold > 0.0 else behind
        kept_on = (set() if remaining_tokens is None or not asked
                   else self._draft_kept_on(acceptance, asked, draft_index, batch, histories))
        share = {}  # [kept-on rows] the part of a one-time cost that falls to this step
        for r in kept_on:  # one step of the row's steps left
            emitted = 1.0 + sum(cumulative(acceptance[r][-1][:k[r]]))
            share[r] = min(1.0, emitted / max(1, remaining_tokens[r]))
        if share and cold > 0.0:  # the run after it is warm for as long as a row drafts
            overhead -= cold * (1.0 - min(share.values()))
        for r in behind:
            overhead += catch_up_seconds[r] * share.get(r, 1.0)
        return overhead, bool(behind) and self._after_plain, cold

    def _best_forwards(self, acceptance, with_draft: list[Choice], k: list[int],
                       num_reqs: int, overhead: float, forward_seconds: float,
                       rate_without: float) -> tuple[int, float]:
        """(m, its rate): the number of draft forwards whose step, the with-draft plan cut to
        m forwards (the draft rows add their P_m while they have an m-th token, the other
        rows' part fixed), emits the most tokens per second; 0 where none beats
        ``rate_without``."""
        others = [Choice(NO_CANDIDATE, 0) if k[r] else c for r, c in enumerate(with_draft)]
        expected = self._rate_terms(acceptance, others)[0]
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
            rate = expected / (self.cost.step_one(num_tokens) + overhead + forward_seconds * m)
            if rate > best_rate:
                best, best_rate = m, rate
        return best, best_rate

    @staticmethod
    def _trial_rows(lengths: list[int],
                    catch_up_seconds: Sequence[float] | None) -> tuple[int, ...]:
        """The rows a trial of the draft runs for on its optimistic estimate: of those
        that may use it (``lengths`` [num_reqs] > 0), the :data:`DRAFT_TRIAL_ROWS` whose
        first pass reads least (``catch_up_seconds``; the first rows without it)."""
        rows = [r for r, n in enumerate(lengths) if n]
        if catch_up_seconds is not None:
            rows.sort(key=lambda r: catch_up_seconds[r])
        return tuple(rows[:DRAFT_TRIAL_ROWS])

    def _draft_kept_on(self, acceptance, rows: list[int], draft_index: int, batch: StepBatch,
                       histories: list[int]) -> set[int]:
        """Of ``rows`` (draft rows whose draft KV is behind), those whose draft candidate the plan
        also chooses at the posterior means: expected to keep drafting, so a catch-up paid now
        serves later steps too. A row chosen only by this step's draw or a trial is not."""
        means = list(acceptance)
        for r in rows:
            means[r] = acceptance[r][:-1] + [self.estimator.pooled_cells(
                draft_index, batch.sampled[r], histories[r], len(acceptance[r][-1]))]
        chosen = plan(means, self.cost, spec_overhead=self.cost.spec_overhead_s)
        return {r for r in rows if chosen[r].candidate == len(acceptance[r]) - 1}

    def _rate_terms(self, acceptance, choices) -> tuple[float, float]:
        """(expected tokens emitted, seconds) of a step that verifies ``choices``."""
        expected, num_tokens = float(len(choices)), len(choices)
        for r, c in enumerate(choices):
            if c.candidate != NO_CANDIDATE:
                expected += sum(cumulative(acceptance[r][c.candidate][:c.num_tokens]))
                num_tokens += c.num_tokens
        return expected, self._step_seconds(num_tokens, num_tokens > len(choices))

    def choose(self, batch: StepBatch, offers, draft_forwards: int | None = None) -> StepPlan:
        """The controller's choice among ``offers``: the step's plan, one draft per row.
        ``draft_forwards``: the forwards the draft's run made (its stop rule's count), which the
        arbiter's prediction prices (None: the m forwards :meth:`plan_draft` priced)."""
        histories = self._histories(batch)
        order = sorted(range(len(offers)), key=lambda o: offers[o][0])  # by row, stable
        offers = [offers[o] for o in order]
        gate = self._gate_plan
        if gate is not None and len(gate[0]) == len(offers) and all(
                id(c) in gate[0] for _, _, c in offers):
            flat = gate[1]  # the gate's plan over the same candidates (the draft ran for none)
        else:
            flat = self._plan(batch, offers, histories)
        drafts, sources = self._remember(batch, offers, histories, flat)
        if trace.TRACE is not None:
            trace.TRACE.write("plan", sources=[None if i is None else self.proposers[i].name
                                               for i in sources], held=self.holding)
        self._update_hold(batch, sources, draft_forwards)
        # a step that verifies nothing may end a re-check of speculation (then there is no
        # speculative block left to predict it for)
        ended = (self.arbiter is not None and not any(drafts)
                 and self.arbiter.nothing_to_verify())
        if self.arbiter is not None and not ended:
            self._predict(flat.expected, flat.seconds, batch.num_reqs,
                          sum(len(d) for d in drafts), draft_forwards)
        alternates: list[list[list[int]]] = [[] for _ in range(batch.num_reqs)]
        if self.max_candidates > 1:
            acceptance, choices = flat.acceptance(), flat.choices()
            alternatives = sorted(self._alternative_offers, key=lambda o: o[0])
            for (r, _, _), a in zip(alternatives, self._estimate(alternatives, batch, histories)):
                acceptance[r].append(a)
            self._alternates(batch, offers + alternatives, acceptance, choices, drafts,
                             alternates, histories, len(offers))
        self.release()
        return StepPlan(drafts, sources, alternates)

    def _plan(self, batch: StepBatch, offers, histories: list[int]) -> _FlatPlan:
        """The controller's plan over ``offers`` (in row order) in one compiled call
        (:func:`kernels.plan_offers <specplugin.adaptive.kernels.plan_offers>`), which builds each
        token's estimator cell and reads its estimate. The explorer row takes posterior draws
        (the gate's, where :meth:`plan_draft` estimated them this step), the others means."""
        estimator, sampled, num_reqs = self.estimator, batch.sampled, batch.num_reqs
        gate = self._gate_plan[0] if self._gate_plan is not None else frozenset()
        explorer = -1
        if offers and self.explore:
            explorer = self._explorer(offers if not gate else
                                      [o for o in offers if id(o[2]) in gate])
        meta, starts, signals = [], [0], []
        for r, i, c in offers:
            meta += (r, i, int(sampled[r]), histories[r],
                     r == explorer and (not gate or id(c) in gate))
            starts.append(starts[-1] + len(c.signal))
            signals.append(c.signal)
        num_tokens = starts[-1]
        if (len(self._cell_buffer) < num_tokens
                or len(self._token_buffer) < 2 * num_tokens + num_reqs
                or len(self._plan_buffer) < 3 * num_reqs):
            self._token_buffer = np.empty(max(4 * num_tokens + 2 * num_reqs, 512))
            self._cell_buffer = np.empty(max(2 * num_tokens, 256), dtype=np.int64)
            self._plan_buffer = np.empty(max(6 * num_reqs, 96), dtype=np.int64)
        tables = estimator.tables
        ints, floats = kernels.pack_plan(num_reqs, meta, starts, signals,
                                         self.cost.step_times(num_reqs, num_tokens + 2), tables,
                                         estimator.strides, self.cost.spec_overhead_s)
        expected, seconds = kernels.plan_offers(ints, floats, *tables.posterior_arrays(),
                                                tables.groups, self._token_buffer,
                                                self._cell_buffer, self._plan_buffer)
        chosen = self._plan_buffer[:3 * num_reqs].tolist()
        return _FlatPlan(offers, self._cell_buffer[:num_tokens], starts,
                         self._token_buffer[:2 * num_tokens + num_reqs], chosen[:num_reqs],
                         chosen[num_reqs:2 * num_reqs], chosen[2 * num_reqs:], expected,
                         seconds)

    def _explorer(self, offers) -> int:
        """This step's explorer row (-1: none): picked once per step, at random among the
        rows of ``offers`` (in proportion to their offers), so that the gate and the choice
        explore the same row."""
        if self._step_explorer is None:
            if not offers:
                return -1
            self._step_explorer = offers[self.estimator.random.randrange(len(offers))][0]
        return self._step_explorer

    def _alternates(self, batch: StepBatch, offers, acceptance, choices, drafts, alternates,
                    histories, num_main: int) -> None:
        """Fill ``alternates`` ([num_reqs] lists): the extra candidates worth verifying too.
        ``offers``: the step's offers then its alternatives (the first ``num_main`` are
        offers), per row in the order of ``acceptance[row]``."""
        cands: list[list[Candidate]] = [[] for _ in choices]
        sources: list[list[int]] = [[] for _ in choices]
        main: list[list[bool]] = [[] for _ in choices]
        for o, (r, i, c) in enumerate(offers):
            cands[r].append(c)
            sources[r].append(i)
            main[r].append(o < num_main)
        # at temperature > 0 only deterministic candidates are verified together (the
        # draft model's are samples, verified against their own probabilities)
        greedy = ~np.asarray(batch.sampled, dtype=bool)
        usable = [[greedy[r] or self.proposers[i].name not in MODEL_PROPOSERS for i in row]
                  for r, row in enumerate(sources)]
        eligible = [choice.candidate != NO_CANDIDATE and usable[r][choice.candidate]
                    for r, choice in enumerate(choices)]
        never = 1 << 30  # a divergence past any draft: never an extra candidate
        diverge = [[divergence(cands[r][choice.candidate].token_ids, c.token_ids) if ok else never
                    for c, ok in zip(cands[r], usable[r])]
                   if eligible[r] else [] for r, choice in enumerate(choices)]
        extras = expand(choices, acceptance, diverge, self.cost.step_seconds,
                        self.max_candidates - int(self.decoy_primary), eligible=eligible,
                        spec_overhead=self.cost.spec_overhead_s)
        for r, row_extras in enumerate(extras):
            alternates[r] = [cands[r][e.candidate].token_ids[:e.num_tokens].tolist()
                             for e in row_extras]
            self.stats.extra_candidates += len(row_extras)
            if row_extras:
                self._pending_extras[batch.req_ids[r]] = [
                    _Pending(sources[r][e.candidate], bool(batch.sampled[r]), histories[r],
                             cands[r][e.candidate].signal[:e.num_tokens],
                             not main[r][e.candidate]) for e in row_extras]
        if self.decoy_primary:
            for r, draft in enumerate(drafts):
                if draft and eligible[r]:
                    alternates[r].insert(0, list(draft))
                    drafts[r] = [t - 1 if t > 0 else t + 1 for t in draft]
                    # what is learned is the real draft's fate (the decoy is nobody's)
                    sent = self._pending.pop(batch.req_ids[r])
                    self._pending_extras.setdefault(batch.req_ids[r], []).insert(0, sent)

    def _histories(self, batch: StepBatch) -> list[int]:
        """[num_reqs] each row's history bucket, once per step's batch (the gate and the
        choice both ask)."""
        kept = self._step_histories
        if kept is not None and kept[0] is batch:
            return kept[1]
        histories = [history_bucket(self.history.get(req_id)) for req_id in batch.req_ids]
        self._step_histories = (batch, histories)
        return histories

    def forget_pending(self) -> None:
        """The engine skipped drafting for a step: the drafts proposed before it were
        verified in a step whose results never reach :meth:`step`."""
        self.settle()
        self._pending, self._pending_extras, self._unchosen = {}, {}, {}
        self._observed = False  # a plain_step's decision for a step that then failed

    @property
    def idle(self) -> bool:
        """No request the union knows of is running (an offline job's end)."""
        self.settle()
        return not len(self.history) and not self._pending and not self._pending_extras

    def finish_requests(self, req_ids: Sequence[str]) -> None:
        self.settle()  # (a held verdict of these requests must not outlive them)
        for proposer in self.proposers:
            proposer.finish_requests(req_ids)
        self.history.forget(req_ids)
        for req_id in req_ids:
            self._shadows.pop(req_id, None)
            self._pending.pop(req_id, None)
            self._pending_extras.pop(req_id, None)
            self._unchosen.pop(req_id, None)

    def _ask(self, index: int, batch: StepBatch) -> list[Candidate | None]:
        proposer = self.proposers[index]
        batch = batch.for_proposer(proposer.name)  # rows whose request allows it
        try:
            candidates = proposer.propose(batch)
        except Exception:  # a proposer bug costs its drafts, never a request
            self.failures[index].record()
            return [None] * batch.num_reqs
        return [c if c is not None and len(c) else None for c in candidates]

    def _estimate(self, offers, batch: StepBatch, histories: list[int],
                  explore: bool | None = None, explorer: int | None = None) -> list[list[float]]:
        """Acceptance of every offered token, per offer: posterior means in one compiled
        call (:meth:`~specplugin.adaptive.estimator.AcceptanceEstimator.values`),
        the ``explorer`` row's drawn from the posterior (None: one row picked at random
        here if ``explore``, default the union's setting; -1: none)."""
        if not offers:
            return []
        estimator, sampled, cells_of = self.estimator, batch.sampled, self.estimator.cells
        if explorer is None:
            explorer = -1
            if self.explore if explore is None else explore:
                explorer = offers[estimator.random.randrange(len(offers))][0]
        codes, starts = [], [0]
        for r, i, c in offers:
            cells = cells_of(i, sampled[r], histories[r], c.signal)
            codes += [-x - 1 for x in cells] if r == explorer else cells
            starts.append(len(codes))
        values = estimator.values(codes)
        return [values[starts[o]:starts[o + 1]] for o in range(len(offers))]

    def _remember(self, batch: StepBatch, offers, histories, flat: _FlatPlan):
        """Record what each row sends (to learn from its verdict, with the cells its tokens
        were estimated in); returns the drafts and their sources ([num_reqs] each)."""
        self._pending, self._pending_extras = {}, {}
        drafts: list[list[int]] = []
        sources: list[int | None] = [None] * batch.num_reqs
        stats, histogram = self.stats, self.stats.k_histogram
        stats.steps += 1
        for r, (o, k) in enumerate(zip(flat.offer, flat.num_tokens)):
            histogram[k] += 1
            if o < 0:
                drafts.append([])
                continue
            _, index, candidate = offers[o]
            sources[r] = index
            drafts.append(candidate.token_ids[:k].tolist())
            start = flat.starts[o]
            self._pending[batch.req_ids[r]] = _Pending(
                index, bool(batch.sampled[r]), histories[r], candidate.signal[:k],
                cells=flat.cells[start:start + k].tolist())
            stats.chosen[self.proposers[index].name] += 1
        if not any(drafts):
            stats.steps_without_drafts += 1
        self._unchosen = self._offers_not_sent(batch, offers, histories, flat, drafts)
        return drafts, sources

    def _offers_not_sent(self, batch: StepBatch, offers, histories, flat: _FlatPlan,
                         drafts: list[list[int]]) -> dict:
        """Each row's offers that the plan did not send, as req_id -> (the row's draft, [(offer as
        :class:`_Pending`, its tokens)]) for :meth:`_learn_unchosen`. Not the draft model's offers
        for a sampled request: a match against the emitted token does not measure them."""
        if len(offers) <= sum(1 for o in flat.offer if o >= 0):
            return {}  # every offer was sent (or none was made)
        unchosen: dict = {}
        cells = None
        for o, (r, index, candidate) in enumerate(offers):
            if o == flat.offer[r]:
                continue
            sampled = bool(batch.sampled[r])
            if sampled and self.proposers[index].name in MODEL_PROPOSERS:
                continue
            if cells is None:
                cells = flat.cells.tolist()  # (the buffer is the next plan's)
            start, end = flat.starts[o], flat.starts[o + 1]
            sent = _Pending(index, sampled, histories[r], _NO_SIGNAL, cells=cells[start:end])
            req_id = batch.req_ids[r]
            if req_id not in unchosen:
                unchosen[req_id] = (drafts[r], [])
            unchosen[req_id][1].append((sent, np.array(candidate.token_ids[:end - start])))
        return unchosen

    def _learn_unchosen(self, verified: Verified, unchosen: dict) -> None:
        """The offers a step did not send, judged against the tokens it emitted (the sent draft's
        accepted tokens, then the row's last token): accepted while equal, rejected at the first
        difference (exactly what verification says at temperature 0, in expectation above).
        Without this, a proposer the plan did not pick early never learns, and the first one
        believed keeps winning. Not for rows with the scorer's extras (their emitted tokens may
        be an extra's)."""
        next_tokens = verified.next_tokens
        if not unchosen or next_tokens is None:
            return
        scheduled_drafts = as_list(verified.num_scheduled_drafts)  # [num_reqs]
        num_emitted = as_list(verified.num_emitted)  # [num_reqs]
        scored = verified.scored or {}
        judged_parts: list[tuple[_Pending, list]] = []
        for row, req_id in enumerate(verified.req_ids):
            entry = unchosen.get(req_id)
            if entry is None or req_id in scored or next_tokens[row] < 0:
                continue
            own, others = entry
            accepted = max(0, min(num_emitted[row] - 1, scheduled_drafts[row], len(own)))
            emitted = np.array(own[:accepted] + [next_tokens[row]])  # [accepted + 1]
            for sent, tokens in others:  # (tokens: as many as its cells)
                judged, matched = judge_guess(tokens, emitted)
                if judged > 0:
                    judged_parts.append((sent, judged_outcomes(None, row, False, judged,
                                                               matched)))
        self.stats.offers_judged_unsent += len(judged_parts)
        self._teach(judged_parts)

    def _learn_extras(self, extras: list[_Pending], outcome: Scored, emitted: int,
                      judged_parts: list) -> None:
        """The scorer's extra candidates: each one's accepted tokens (where the rule tells) to the
        estimator, the winner's emitted tokens to its proposer's counters. A proposer's
        alternatives (its second guesses) are not learned from: they would teach that the
        proposer is worse than it is."""
        for j, extra in enumerate(extras[: len(outcome.extra_accepted)]):
            accepted = outcome.extra_accepted[j]
            if accepted is not None and not extra.alternative:
                length = min(len(extra.signal), outcome.extra_lengths[j])
                judged_parts.append((extra, judged_outcomes(
                    None, j, False, min(length, accepted + 1), min(accepted, length))))
        if outcome.winner is not None and outcome.winner < len(extras):
            self.stats.won(self.proposers[extras[outcome.winner].proposer].name, emitted)

    def _observe_verified(self, verified: Verified, pending: dict, unrated: bool) -> None:
        """The verified step's wall time, to the cost model and the step arbiter (at once:
        they decide the step being planned); ``pending``: its drafts as sent;
        ``unrated``: its time is not a rate of speculating (see :meth:`_observe`)."""
        scheduled_drafts = as_list(verified.num_scheduled_drafts)  # [num_reqs]
        num_emitted = as_list(verified.num_emitted)  # [num_reqs]
        scored = verified.scored or {}
        # the arbiter's rate: sampled rows' drafts at their acceptance probabilities
        # (rows with the scorer's extras: their emitted tokens)
        rate_tokens = None
        if verified.expected:
            sampled = [req_id in pending and pending[req_id].sampled
                       and req_id not in scored for req_id in verified.req_ids]
            if any(sampled):
                rate_tokens = expected_emitted(scheduled_drafts, num_emitted,
                                               verified.expected, sampled)
        self._observe(verified.seconds, verified.num_query_tokens, sum(num_emitted),
                      any(k > 0 for k in scheduled_drafts), verified.draft_seconds,
                      unrated=unrated, read_prompts=verified.read_prompts,
                      num_reqs=len(num_emitted), rate_tokens=rate_tokens)

    def _learn_rows(self, verified: Verified, pending: dict, pending_extras: dict) -> None:
        """What each row of ``verified`` accepted of the drafts ``pending`` (and the
        scorer's ``pending_extras``) recorded: the request's history, the counters, and
        one estimator update for every judged token (at the next flush)."""
        scheduled_drafts = as_list(verified.num_scheduled_drafts)  # [num_reqs]
        num_emitted = as_list(verified.num_emitted)  # [num_reqs]
        scored = verified.scored or {}
        judged_parts: list[tuple[_Pending, list]] = []  # (sent, its judged_outcomes)
        for row, (req_id, scheduled, emitted) in enumerate(
                zip(verified.req_ids, scheduled_drafts, num_emitted)):
            if scheduled <= 0:
                continue
            emitted = max(emitted - 1, 0)  # accepted tokens emitted
            outcome = scored.get(req_id)
            sent = pending.get(req_id)
            if sent is not None:
                k = min(len(sent.signal), scheduled)
                won = outcome is not None and outcome.winner is not None
                own = min(emitted, k) if outcome is None else outcome.own_accepted
                self.history.update(req_id, min(k, emitted + 1), emitted)
                self.stats.verified(self.proposers[sent.proposer].name, k,
                                    0 if won else min(emitted, k))
                if own is not None:
                    # (with the scorer's extras, the verdicts: its rows are not the batch's)
                    judged_parts.append((sent, judged_outcomes(
                        verified.expected if outcome is None else None, row, sent.sampled,
                        min(k, own + 1), min(own, k))))
            if outcome is not None:
                self._learn_extras(pending_extras.get(req_id, []), outcome, emitted, judged_parts)
        self._teach(judged_parts)

    def _teach(self, judged_parts: list[tuple[_Pending, list]]) -> None:
        """(sent, what each judged token teaches: :func:`judged_outcomes`) per candidate:
        for the estimator's next update (:meth:`flush_learning`)."""
        self._unlearned += judged_parts

    def flush_learning(self) -> None:
        """Everything judged since the last flush into the estimator, in one update, after
        the decay of the steps since (see :data:`LEARN_EVERY`). Also before the learned
        state is written (:mod:`specplugin.adaptive.memory`)."""
        if self._undecayed_steps:
            self.estimator.step(self._undecayed_steps)
            self._undecayed_steps = 0
        judged_parts, self._unlearned = self._unlearned, []
        if judged_parts:
            estimator, cells, accepted = self.estimator, [], []
            for sent, outcomes in judged_parts:
                cells += (sent.cells[:len(outcomes)] if sent.cells is not None else
                          estimator.cells(sent.proposer, sent.sampled, sent.history,
                                          sent.signal[:len(outcomes)]))
                accepted += outcomes
            estimator.update_cells(cells, accepted)
            self._learned_tokens += len(cells)

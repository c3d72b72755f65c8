"""The union: every configured proposer is asked each step; the controller picks per request.

:meth:`Union.step` is one step, in order: **learn** from the step just verified
(:class:`~specplugin.adaptive.learning.Verified`: its time to the cost model and the step
arbiter at once, its verdicts to the estimator once the plan is made, in the worker's wait
for its next step); **ask** every proposer (unless the step arbiter measured that plain
decoding is faster: then nothing runs), running the draft model where its gate says it pays;
**estimate** each offered token's acceptance; **plan** which candidate and how many of its
tokens each request verifies (none where nothing pays); **remember** what was sent. It returns
one :class:`~specplugin.adaptive.plan.StepPlan`; nothing is read back from the union after.
A proposer that raises costs its own candidates, never a request. vLLM-free: the vLLM layer
builds the :class:`StepBatch` and the ``Verified`` record from the engine's buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from specplugin.adaptive import kernels
from specplugin.adaptive.arbiter import StepArbiter
from specplugin.adaptive.background import Background
from specplugin.adaptive.controller import NO_CANDIDATE, Choice, divergence, expand, planned
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.draft_gate import (Backoff, add_draft_estimates, best_forwards,
                                            plan_with_draft, rate_terms, run_overhead,
                                            step_seconds, trial_rows)
from specplugin.adaptive.draft_rule import CostModel as DraftCostModel, draft_prices
from specplugin.adaptive.estimator import (AcceptanceEstimator, as_list, expected_emitted,
                                           history_bucket)
from specplugin.adaptive.learning import LEARN_EVERY, Learner, Sent, Shadow, Verified
from specplugin.adaptive.plan import DraftModel, FlatPlan, StepPlan
from specplugin import trace
from specplugin.metrics import FailureCounter, ProposerStats
from specplugin.config import MODEL_PROPOSERS
from specplugin.profiling import phase
from specplugin.proposers.base import Candidate, Proposer, StepBatch
from specplugin.requests import Requests

logger = logging.getLogger("specplugin")
# Asks that keep finding nothing are spaced out, the gap doubling to a limit (Backoff).
# Plain steps between two peeks: a peek costs ~0.1 ms, and a copy stays in sight.
MAX_PEEK_GAP = 8
# Speculative steps between two asks of the draft's gate once it kept the draft off
# GATE_PATIENCE times in a row (its second plan costs about the proposers' share).
MAX_GATE_GAP = 8
GATE_PATIENCE = 2  # one posterior draw keeping the draft off is noise; two say more
# Steps between two full looks while every row holds the draft model (a greedy batch
# looks more often: a copy can come in sight at any step).
MAX_HOLD_GAP = 8
MAX_HOLD_GAP_GREEDY = 2
HOLD_PATIENCE = 3
# An untried draft runs on an optimistic estimate in its first DRAFT_TRIALS gated steps
# (until DRAFT_TRIAL_EVIDENCE of its tokens are judged): its worth is learnt by running it.
DRAFT_TRIALS = 4
DRAFT_TRIAL_EVIDENCE = 8.0


class Union:
    def __init__(self, proposers: Sequence[Proposer], cost: StepCostModel | None = None,
                 estimator: AcceptanceEstimator | None = None, explore: bool = True,
                 arbiter: StepArbiter | None = None, max_candidates: int = 1,
                 decoy_primary: bool = False, max_peek_gap: int = MAX_PEEK_GAP,
                 draft_always: bool = False, learn_every: int = LEARN_EVERY,
                 background: Background | None = None, requests: Requests | None = None):
        """``explore``: one random row per step is judged by posterior draws (Thompson
        sampling), the others by posterior means, so a proposer unlucky early is tried again
        without a whole batch paying. ``arbiter``: switches steps to plain decoding where
        speculating does not pay (None: every step is planned). ``draft_always``: tests only.
        ``background``: where verdicts are learned once the next plan is made (default
        inline). ``requests``: the records shared with the proposers and the vLLM layer."""
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
        self.requests = requests if requests is not None else Requests()
        self.learner = Learner(self.estimator, names, self.stats, self.requests, learn_every)
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
        # the draft run plan_draft let go this step, for the arbiter's prediction:
        # (seconds a forward, a run's fixed seconds, forwards planned)
        self._draft_price = (0.0, 0.0, 0)
        self._step_explorer: int | None = None  # the row drawn from the posterior (_explorer)
        # plan_draft's plan over this step's token-level candidates (their id()s, the plan)
        self._gate_plan: tuple[frozenset[int], FlatPlan] | None = None
        # the compiled plan's outputs, kept from step to step (grown when a step needs more)
        self._token_buffer = np.empty(0)  # each offered token's estimate
        self._plan_buffer = np.empty(0, dtype=np.int64)  # each row's offer, then its tokens
        self._cell_buffer = np.empty(0, dtype=np.int64)  # each offered token's cell
        # (this step's batch, its rows' history buckets): see _histories
        self._step_histories: tuple[StepBatch, list[int]] | None = None
        self.draft_always = draft_always
        self.background = background or Background()
        for proposer in self.proposers:  # (work a proposal need not wait for: Proposer)
            if hasattr(proposer, "defer"):
                proposer.defer = self.background.submit
        self.cost.deferred_flush = True  # held steps learned with the verdicts
        # the verdicts begin() took from the step just verified, to learn once this step's
        # plan is made (release): (verified record, its drafts' Sent, the extras')
        self._held: tuple[Verified, dict, dict, dict] | None = None
        self._start_learning()

    def _start_learning(self) -> None:
        """The union's own learned state as a fresh engine starts it (``__init__``,
        :meth:`forget_learned`)."""
        self.speculating = True  # this step's arbiter decision (see begin, plain_step)
        self._pending: dict[str, Sent] = {}
        self._pending_extras: dict[str, list[Sent]] = {}  # the scorer's extra candidates
        # req_id -> (the tokens it sent, the offers of other proposers it did not send and
        # their tokens): judged against what the target emits (Learner.learn_unchosen)
        self._unchosen: dict[str, tuple[list[int], list[tuple[Sent, np.ndarray]]]] = {}
        self._observed = False  # plain_step observed the last step and chose to speculate
        self._skipped_steps = 0  # plain steps since begin() last ran (estimator decay)
        self._peek = Backoff()  # the plain steps' peeks (see MAX_PEEK_GAP)
        # the draft's gate, in speculative steps (see MAX_GATE_GAP and GATE_PATIENCE)
        self._gate = Backoff(patience=GATE_PATIENCE)
        # the full looks while every row chooses the draft (see MAX_HOLD_GAP); a "miss"
        # is a look that confirmed the draft for every row
        self._hold = Backoff(patience=HOLD_PATIENCE)
        self.holding = False  # this speculative step is held (no look)
        self._gate_k: list[int] | None = None  # the draft tokens this step's gate planned
        # what the last confirming look planned, for the held steps after it: the batch's
        # request ids, the draft's tokens per row, and the draft run's price (_draft_price)
        self._hold_plan: tuple[tuple, list[int], tuple[float, float, int]] | None = None
        self._draft_trials = DRAFT_TRIALS  # optimistic draft runs left (see plan_draft)
        # this step's time is no rate for the step arbiter (_observe): a draft trial, or the
        # draft's catch-up over tokens decoded plainly just before
        self._unrated_step = False
        self._last_plain = False  # the last decision kept its step plain
        self._after_plain = False  # this step speculates right after a plain one

    def forget_learned(self) -> None:
        """Back to what a fresh engine knows (acceptance, histories, the arbiter's rates, the
        draft's trials, step observations); kept: the start-up forward times, the proposers'
        indexes, the counters. For ``specplugin bench`` after warm-up, between requests."""
        self.settle()
        self._start_learning()
        if trace.TRACE is not None:
            trace.TRACE.write("forget")
        self.learner.reset()
        self.cost.forget()
        self.draft_costs.forget()
        if self.arbiter is not None:
            self.arbiter.forget()

    @phase("plugin: other")
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

    @phase("plugin: learn")
    def begin(self, verified: Verified | None, num_reqs: int, sampled: bool) -> bool:
        """Learn from ``verified``; return whether this step speculates (the arbiter's call;
        ``sampled``: most requests sample). A plain step needs nothing else. After
        :meth:`plain_step` said True, the step was already observed and decided there.

        The step's verdicts are held and handed to :attr:`background` by :meth:`release` once
        this step's plan is made (one step late, next to a memory of thousands of steps), except
        while the estimator is cold (``learning.COLD_TOKENS``), where each verdict counts most."""
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
        self.learner.undecayed_steps += 1 + self._skipped_steps
        self._skipped_steps = 0
        if self.learner.cold:  # cold: each verdict moves the plan, learn now
            held, self._held = self._held, None
            if held is not None:
                self._learn_held(*held)  # (cold: the estimator's update included)
            else:
                self.cost.flush_due()
                self.learner.flush()
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
        self.learner.learn(verified, pending, pending_extras, unchosen)
        self.cost.flush_due()

    def plain_step(self, seconds: float | None, num_reqs: int, num_query_tokens: int,
                   sampled: bool, peek: Callable[[], StepBatch] | None = None,
                   draft_seconds: float = 0.0, read_prompts: bool = False) -> bool:
        """The cheap path after a step that verified no draft: observe its time and say whether
        the next step speculates. False: the next step is plain and nothing runs for it. True:
        the caller plans it with :meth:`begin`. Always True without an arbiter or with drafts
        awaiting their verdict. ``draft_seconds``: the draft model's part of ``seconds``, kept
        out of the cost model. ``peek``: the batch as it stands. Where the arbiter keeps the step plain, the cheapest
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
        own, one token per request of an unchanged batch, only their times kept
        (:meth:`plain_steps_ran`). 0 while speculating."""
        if self.speculating or self.arbiter is None or self._pending or self._pending_extras:
            return 0
        return self.arbiter.plain_steps_ahead()

    def plain_steps_ran(self, seconds: Sequence[float], num_reqs: int) -> None:
        """Steps that :meth:`plain_steps_ahead` foretold ran, each in ``seconds`` of wall
        time, ``num_reqs`` requests decoding one token each: learn what :meth:`plain_step`
        would have learned from each, without its decisions, which were foregone."""
        self.settle()
        for wall in seconds:
            self._observe(wall, num_reqs, num_reqs, speculative=False,
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

    @phase("plugin: plan")
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
            self._pending[batch.req_ids[r]] = Sent(draft, sampled, histories[r],
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
            expected, seconds = rate_terms(self.cost,
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

    @phase("plugin: peek")
    def _copy_in_sight(self, peek: Callable[[], StepBatch]) -> bool:
        """Whether the peek's proposer (n-gram, else suffix; if the union has either) finds,
        on the batch ``peek()`` returns, candidates the controller would verify (posterior
        means) in a step the arbiter judges faster than a plain one."""
        index = self._peek_index
        if index is None:
            return False
        batch = peek()
        self.learner.judge_shadows(batch)
        offers = [(r, index, c) for r, c in enumerate(self._ask(index, batch)) if c is not None]
        if not offers:
            return False
        histories = self._histories(batch)
        for r, _, c in offers:  # judged once the target has emitted what they guess
            req_id = batch.req_ids[r]
            state = self.requests[req_id]
            if state.shadow is None:
                state.shadow = Shadow(
                    Sent(index, bool(batch.sampled[r]), histories[r], np.asarray(c.signal)),
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

    def _plain_rate(self, num_reqs: int) -> float | None:
        """Tokens per second of a plain step of ``num_reqs`` requests, as the cost model
        predicts it (None: it has timed no forward yet)."""
        if not self.cost.calibrated:
            return None
        return num_reqs / self.cost.step_one(num_reqs)

    def _step_seconds(self, num_tokens: int, drafts: bool) -> float:
        """What the step arbiter re-predicts its speculative blocks' steps with."""
        return step_seconds(self.cost, num_tokens, drafts)

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

    @phase("plugin: ask")
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

    @phase("plugin: plan")
    def plan_draft(self, batch: StepBatch, offers, draft_index: int, caps: np.ndarray,
                   forward_seconds: float,
                   catch_up_seconds: Sequence[float] | None = None,
                   remaining_tokens: Sequence[int] | None = None,
                   run_seconds: float = 0.0,
                   warm_run_seconds: float | None = None) -> list[int]:  # [num_reqs]
        """Tokens the draft model drafts for each row this step (0: it does not run for it).

        The step is planned over the token-level ``offers``, then with one more candidate per
        row that may use the draft (``caps`` [num_reqs] > 0), estimated from the estimator's
        pooled cells for the draft with one posterior draw shared by the rows (one forward
        serves every row). The draft runs for the rows that prefer it if some number of
        forwards m beats the plan without it::

            max_m E_with(m) / (T(n_with(m)) + overhead + forward_seconds * m) > E_without / T(n_without)

        The run's stop rule then decides within each row's planned tokens. One-time costs
        (``catch_up_seconds``, a cold run's excess over ``warm_run_seconds``) are spread over
        the ``remaining_tokens`` of rows expected to keep drafting; an untried draft runs on
        an optimistic estimate first (:data:`DRAFT_TRIALS`). Derivation: docs/design.md."""
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
        if self.draft_always:
            self._draft_price = (forward_seconds, run_seconds, max(lengths_list))
            return lengths_list
        trial = self._draft_trial_due(draft_index)
        trials = trial_rows(lengths_list, catch_up_seconds) if trial else ()
        added = add_draft_estimates(self.estimator, self.explore, batch, lengths_list,
                                    histories, acceptance, draft_index, trials)
        with_draft, k = plan_with_draft(self.cost, acceptance, best, added, lengths_list)
        if not any(k):  # no row would choose the draft's candidate: it does not run
            self._gate.asked(False, MAX_GATE_GAP)
            return [0] * batch.num_reqs
        overhead, behind, cold = run_overhead(
            self.estimator, self.cost, acceptance, k, draft_index, batch, histories,
            run_seconds, catch_up_seconds, remaining_tokens, warm_run_seconds)
        catch_up = behind and self._after_plain  # (right after plain steps)
        best, best_rate = best_forwards(self.cost, acceptance, with_draft, k, batch.num_reqs,
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

    @phase("plugin: plan")
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

    def _plan(self, batch: StepBatch, offers, histories: list[int]) -> FlatPlan:
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
        return FlatPlan(offers, self._cell_buffer[:num_tokens], starts,
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
                    Sent(sources[r][e.candidate], bool(batch.sampled[r]), histories[r],
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
        requests = self.requests  # (a request's record is made at its first step, here)
        histories = [history_bucket(requests[req_id].recent_acceptance)
                     for req_id in batch.req_ids]
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
        return not len(self.requests) and not self._pending and not self._pending_extras

    @phase("plugin: learn")
    def finish_requests(self, req_ids: Sequence[str]) -> None:
        """These requests ended (finished or aborted): the proposers let go of them, then
        their records go (:meth:`Requests.finish <specplugin.requests.Requests.finish>`,
        the one place they are dropped)."""
        self.settle()  # (a held verdict of these requests must not outlive them)
        for proposer in self.proposers:
            proposer.finish_requests(req_ids)
        self.requests.finish(req_ids)
        for req_id in req_ids:
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

    @phase("plugin: estimate")
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

    def _remember(self, batch: StepBatch, offers, histories, flat: FlatPlan):
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
            self._pending[batch.req_ids[r]] = Sent(
                index, bool(batch.sampled[r]), histories[r], candidate.signal[:k],
                cells=flat.cells[start:start + k].tolist())
            stats.chosen[self.proposers[index].name] += 1
        if not any(drafts):
            stats.steps_without_drafts += 1
        self._unchosen = self.learner.unsent_offers(batch, offers, histories, flat.offer,
                                                    flat.cells, flat.starts, drafts)
        return drafts, sources

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

    def counters(self, own: FailureCounter, extra_failures: dict[str, int]) -> dict:
        """A drafter's counters, JSON-able, with its ``own`` failures (a name the union also
        counts is summed) and ``extra_failures``; verdicts still held are not waited for."""
        self.background.settle()
        failures = own.snapshot()
        for f in self.failures:
            failures[f.name] = failures.get(f.name, 0) + f.count
        learning = self.background.failures
        if learning.count:
            failures[learning.name] = learning.count
        failures.update(extra_failures)
        return {**self.stats.as_dict(), "proposer_failures": failures,
                "arbiter": None if self.arbiter is None else self.arbiter.stats(),
                "tracked_requests": len(self.requests)}

    def flush_learning(self) -> None:
        """Everything judged so far into the estimator (:meth:`Learner.flush`)."""
        self.learner.flush()

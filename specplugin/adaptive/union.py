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

import numpy as np

from specplugin.adaptive import kernels
from specplugin.adaptive.arbiter import StepArbiter
from specplugin.adaptive.background import Background
from specplugin.adaptive.controller import (NO_CANDIDATE, Choice, cumulative,
                                           divergence, expand, plan, planned, token_price,
                                           with_candidates)
from specplugin.adaptive.cost import StepCostModel
from specplugin.adaptive.estimator import (AcceptanceEstimator, RequestHistory, as_list,
                                           expected_emitted, history_bucket, judged_outcomes)
from specplugin import trace
from specplugin.metrics import FailureCounter, ProposerStats
from specplugin.config import MODEL_PROPOSERS
from specplugin.proposers.base import Candidate, Proposer, StepBatch

logger = logging.getLogger("specplugin")
# Plain steps between two peeks at most (Union.plain_step): the gap doubles from 1
# while the peeks find nothing worth verifying and is back to 1 when one does or new
# requests join. A peek costs 0.05-0.15 ms, 1-3% of a 5 ms plain step at batch 1
# (measured in an engine); text that starts copying stays in sight for as many tokens as
# the copy runs, so a late look loses at most the gap's steps of it.
MAX_PEEK_GAP = 8
# Speculative steps from one ask of the draft model's gate (Union.plan_draft) to the next
# at most: the gap doubles from 1 while the gate keeps the draft off (from its second
# closing in a row, GATE_PATIENCE) and is back to 1 when it runs or new requests join
# (Union.draft_gate_due). The gate costs what the draft's
# candidate is priced with (its prices, its posterior draws, a second plan): measured in
# the union's core at batch 1 (scripts/core_bench.py, warm caches), 0.122 ms a step with
# the gate asked every step against 0.049 ms for n-gram and suffix alone, on text where it
# rarely opens. Where the draft pays, it runs and the gate is asked every step.
MAX_GATE_GAP = 8
# Speculative steps from one full look to the next at most while every row keeps choosing
# the draft model's candidate (Union.holding): a full look asks every proposer and prices
# the draft's gate; a held step between two looks runs the draft for every row, as the
# last look planned, asks no token-level proposer, weighs no gate, and sends each row's
# run as the draft's stop rule cut it (Union.choose_held). The gap doubles
# from 1 after HOLD_PATIENCE looks in a row that chose the draft for every row, and is
# back to 1 (a look every step) after one that did not, a held step whose plan sent no
# draft for some row, or a plain step. New requests get a look at once (the held plan was
# the old batch's); if it confirms the draft, the gap reached before goes on (a request
# of 128 tokens at batch 1 had started over with 5 looks in its first 9 steps, and a look
# and its plan cost ~0.6 ms). Where every row samples, a
# token-level candidate's token x is accepted with probability p(x) (a guess, not a
# sample of the target), so the draft's lead moves slowly; a greedy row's copy can come
# in sight at any step and pays several tokens a step, so a batch with a greedy row looks
# at least every MAX_HOLD_GAP_GREEDY steps. What a held step saves is the looks' price:
# measured in an engine at batch 1, temperature 1 (validation pair, fine timers), asking
# n-gram and suffix 0.11 ms and the union's planning 0.25 ms, in a ~12 ms step of which
# the plugin's own work was 1.9 ms; held, 0.05 and 0.10 ms.
MAX_HOLD_GAP = 8
MAX_HOLD_GAP_GREEDY = 2
HOLD_PATIENCE = 3
# Asks in a row that keep the draft off before the gate's gap starts to grow. The gate
# weighs one posterior draw of the draft's worth (Thompson sampling, see
# Union.plan_draft), so where the draft pays, some draws still keep it off now and then;
# backing off at the first of them skipped the gate in the next step too, which then had
# no draft and, for a sampled request, nothing else worth verifying (traced on the
# validation pair, fresh engine, complete/b1/t1: each of a run's 11 closings was
# followed by a step without the draft emitting 1 token, 8 of them plain, against 2.66 a
# speculative step). Two in a row say more than a draw's noise.
GATE_PATIENCE = 2
# Steps in which an untried draft model runs on an optimistic estimate (Union.plan_draft):
# its worth is unknown until it runs, and the posterior's coin flip may keep it off for
# a whole short run (seen: a fresh engine's 60 speculative steps with no draft forward).
DRAFT_TRIALS = 4
# Judged draft tokens past which the draft counts as tried (a restored state included).
DRAFT_TRIAL_EVIDENCE = 8.0
# Rows a trial runs the draft for on its optimistic estimate (Union.plan_draft), those
# whose first pass reads least: what is learnt is the draft's acceptance, which two rows'
# drafts show as well as sixteen, while the first pass reads every trial row's prompt
# (measured on the validation pair, fresh engine, adversarial/b16/t1: the first trial
# read 16 prompts in a 32.8 ms step, the plain step 7 ms). The other rows are planned on
# the estimator's posterior, as after the trials.
DRAFT_TRIAL_ROWS = 2
# Steps whose verdicts the estimator learns at once (Union.flush_learning): one update
# and one decay of its tables per LEARN_EVERY steps instead of one of each per step (the
# tables' sums are recomputed after every change: measured in the union's core at batch
# 1, learning and the sums were a third of its per-step work). What it learns is the
# same, LEARN_EVERY - 1 steps late at most, next to a memory of thousands of steps; and
# every step until COLD_TOKENS judged tokens were learned (an engine's first steps: against
# a prior worth 2 tokens and a parent worth 4, a proposer's first dozens of verdicts move
# its estimates most). Cold steps
# learn on the step, not in the worker's wait, so the threshold is a price: measured on
# the validation pair at batch 1 (complete, greedy, fresh engine), 256 tokens kept 71 of
# 147 steps cold at ~0.13 ms each; the core test
# (test_exploration_tries_again_a_proposer_rejected_by_bad_luck) accepts 13,306 tokens with
# 64, 13,368 with 256, 12,932 with 32 and 10,185 with 16 (at 6c9846f, before the cost model
# learned a fresh engine's first plain steps one at a time: 1,408, 1,408, 1,327 and 970).
LEARN_EVERY = 4
COLD_TOKENS = 64
_NO_SIGNAL = np.empty(0)  # an offer learned by its cells (see Union._offers_not_sent)


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
        """``explore``: one request per step (chosen at random among those with
        candidates) is judged by posterior draws (Thompson sampling), the others by
        posterior means, so that a proposer unlucky early on is tried again (see the
        estimator) while a large batch does not pay for exploring in every row: one
        optimistic draw among 16 rows would make most steps speculative, and a
        speculative step costs the whole batch the engine's speculative machinery.
        ``arbiter``: measures whether speculating pays at all and switches whole steps
        to plain decoding when it does not (None: every step is planned).
        ``max_peek_gap``: see :data:`MAX_PEEK_GAP` (1: peek on every plain step).
        ``draft_always``: test only (``fault_injection.draft_always``): the draft model
        runs in every speculative step, for every row that may use it, whatever it costs
        (priced, a new request's catch-up over its whole prompt could keep it off a short
        test's every step).
        ``learn_every``: see :data:`LEARN_EVERY` (1: the estimator learns every step).
        ``background``: where a verified step's verdicts are learned once the next plan
        is made (:mod:`~specplugin.adaptive.background`; default inline, at that point)."""
        self.explore = explore
        self.arbiter = arbiter
        if arbiter is not None:
            arbiter.plain_rate_model = self._plain_rate
            arbiter.step_seconds_model = self._step_seconds
        self.proposers = list(proposers)
        names = tuple(p.name for p in self.proposers)
        self.estimator = estimator or AcceptanceEstimator(names)
        self.cost = cost or StepCostModel()
        self.failures = [FailureCounter(name, logger) for name in names]
        self.stats = ProposerStats()
        self.max_candidates = max_candidates
        self.decoy_primary = decoy_primary
        self._alternative_offers: list[tuple[int, int, Candidate]] = []  # this step's
        # the proposer plain_step's peek asks: the cheapest token-level one the union has,
        # n-gram, else suffix (None: neither; a union of suffix alone that never peeked
        # decoded plainly 115 of 130 steps where vLLM's suffix speculated all along)
        # the draft model's index (None: the union has none), whose steady choice a
        # held step keeps (see MAX_HOLD_GAP)
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
        # plan_draft's plan over the token-level candidates this step (the id()s of those
        # candidates, the plan): when the draft model then runs for no row, choose has
        # nothing else to weigh; else choose weighs them as the gate did (one posterior
        # draw per step for the gate and the choice, the same explorer row; the draws are
        # kept per cell until the counts change), and the draft model's candidates, known
        # only after it ran, at their posterior means
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
        """Forget what verification taught (acceptance counts, request histories, the
        step arbiter's rates, the draft model's optimistic trials) and what the steps
        taught the cost model (:meth:`StepCostModel.forget
        <specplugin.adaptive.cost.StepCostModel.forget>`): back to what a fresh engine
        knows. Kept: the forwards timed at engine start, the proposers' indexes (earlier
        outputs, as vLLM's suffix method keeps its cache) and the counters.

        Why: ``specplugin bench`` warms an engine up on a reversed prompt (one-off costs:
        compiled shapes, allocations) before it times a cell; taught by that text, the
        union started the cell believing its proposers fail (measured on the zoo pair at
        batch 8: the suffix proposer's first token estimated 0.04, and 1 draft in the
        cell against 165 without the warm-up). A user's engine starts on its own text,
        and with a cost model that has seen no step: kept from the warm-up (until
        2026-12-03), the cost model priced the cell's first steps as no user's engine
        could (a fresh engine's first speculative steps at batch 8 predicted at 4.8-6.2 ms
        where they took 13-19). Only between requests (nothing pending)."""
        self.settle()
        self._start_learning()
        if trace.TRACE is not None:
            trace.TRACE.write("forget")
        self.estimator.set_counts(0.0, 0.0)
        self.history = RequestHistory(self.history.alpha)
        self.cost.forget()
        if self.arbiter is not None:
            self.arbiter.forget()

    def step(self, batch: StepBatch, verified: Verified | None) -> StepPlan:
        """Learn from ``verified``, then the step's plan for ``batch``."""
        if not self.begin(verified, batch.num_reqs, bool(np.mean(batch.sampled) > 0.5)):
            return StepPlan.plain(batch.num_reqs)
        return self.choose(batch, self.ask(batch, range(len(self.proposers))))

    def begin(self, verified: Verified | None, num_reqs: int, sampled: bool) -> bool:
        """Learn from ``verified``; whether this step speculates (the arbiter's call;
        ``sampled``: most requests sample). A plain step needs nothing else: no
        proposer runs, and the caller need not even build the step's batch.
        After :meth:`plain_step` said True, the step was observed and decided there.

        The step's verdicts are held, not learned: :meth:`release` (after this step's
        plan, or here for a plain step) hands them to :attr:`background`, so that the
        plan rests on the verdicts up to the step before, one step late, next to a memory
        of thousands of steps. Not while the estimator is cold (fewer than
        :data:`COLD_TOKENS` judged tokens learned, an engine's first steps): there each
        verdict moves the estimates most, and a proposer whose first drafts all fail
        would draft one step more on its prior and learn two rejections where it had one
        (measured in the core, ``test_exploration_tries_again_a_proposer_rejected_by_bad_luck``:
        a proposer rejected in its first two steps, then always right, had 13,306 tokens
        accepted over eight seeds' 200 steps with this rule, and none without draws; with
        the lag from the first step the test fails: the late rejections let even posterior
        means draft on, 12,416 tokens against 42,968 with draws, where it asks for ten
        times more)."""
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
        """The cheap path for a step that verified no draft: observe its time (cost model,
        step arbiter) and say whether the next step speculates. False: the next step is
        plain and nothing else runs for it (the caller skips drafting; no proposer is
        asked, nothing is estimated). True: the caller plans it with :meth:`begin`, which
        then neither observes this step again nor asks the arbiter again. Without an
        arbiter, or with drafts still waiting for their verdict, always True.
        ``draft_seconds``: the part of ``seconds`` the draft model ran (it ran for a step
        that then verified none of its tokens), kept out of the cost model.
        ``read_prompts``: the step read prompt tokens (:meth:`_observe`).

        ``peek``: the batch as it stands (contexts up to the last step's tokens). Where the
        arbiter keeps the step plain, the cheapest proposer the union has (n-gram, else
        suffix) is asked on it (:meth:`_copy_in_sight`); if the controller would verify
        some of its candidates and the step it plans, at the rate it predicts with its seconds
        corrected by what speculative steps measured, beats the measured plain rate
        (:meth:`StepArbiter.pays_now
        <specplugin.adaptive.arbiter.StepArbiter.pays_now>`), the step speculates after
        all and the arbiter starts a speculative block: a rate measured on earlier text
        must not keep decoding plainly through text that copies, and steps that proved
        slower than predicted must not undo the arbiter's measurements."""
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
        """After :meth:`plain_step` kept the next step plain: how many of the decisions
        that follow are foregone (the arbiter's plain block runs on), so that the steps
        they would decide may run as the engine's own plain steps, none of the plugin's
        code in them, with only their times kept for :meth:`plain_steps_ran`. Each of
        those steps must decode one token per request of an unchanged batch (a request
        that joins, leaves or resumes ends the run: the caller then learns what ran and
        decides that step in full). 0 while speculating.

        A peek that comes due within the run waits for the step that ends it (at most a
        plain block's length - 1 steps later, see the arbiter's "Long plain blocks"):
        stopping the run for it too would leave half of the plain steps decided in full,
        and a decided step costs the plugin's whole plain path (measured in an engine at
        batch 1, validation pair: +0.15 ms over vLLM's own step, 1.4 ms; a step foretold,
        +0.001 ms after another one, +0.03 ms right after a decided one)."""
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
        """A held step's plan (:attr:`holding`): each row sends what the draft model's run
        drafted for it (``lengths`` [num_reqs] tokens, their ``signals``: the draft's
        confidences), cut by the run's stop rule alone, as with the draft model alone; no
        plan over candidates (there is one, and the stop rule priced its cut). What
        :meth:`choose` does beside its plan stays: each row's draft is remembered to learn
        from (with its estimator cells), the step arbiter hears the step's prediction (the
        estimator's means of the tokens sent, the cost model's seconds, the draft's price),
        and a row without a draft ends the hold. Measured in an engine at batch 1,
        temperature 1 (validation pair), a run's end through :meth:`choose` took 0.30-0.38
        ms a step. ``draft_forwards``: the forwards the run made. The plan's ``drafts`` is
        None: the caller holds the tokens (the run's).

        All of that decides nothing in this step, so it goes to :attr:`background` (the
        worker's wait), ahead of the verdicts :meth:`begin` held: the same order, and so
        the same state, as inline (measured in an engine at batch 1, temperature 1, 0.09
        ms a held step on the step inline)."""
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
        """``num_new`` of the batch's ``num_reqs`` requests arrived this step: new text, so
        the next plain step peeks at once (and the arbiter hears of it), and the next
        speculative step looks in full (the hold's plan was the old batch's). A look that
        confirms the draft again resumes the spacing the hold had reached, where it used to
        start over (HOLD_PATIENCE looks in a row, then gaps of 2 and 4): what the draft's
        lead rests on is the pair's, and a row's new text gets its look at once (a copy in
        sight ends the hold there, as any look that does not confirm it)."""
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
        """Judge the peek's earlier candidates against the tokens the target emitted
        since (plain steps): a candidate's token j counts as accepted if it equals the
        emitted token and every token before it did. That is what verification would
        have said: at temperature 0 exactly, at temperature > 0 in expectation (a
        deterministic draft token x is accepted with probability p(x), the probability
        that the target samples x). So plain steps teach the estimator what copying
        would bring, and the peek's predictions rest on evidence, not on the prior.
        A candidate is judged once the emitted tokens differ from it or cover it."""
        parts = []
        for r, req_id in enumerate(batch.req_ids):
            shadow = self._shadows.get(req_id)
            if shadow is None:
                continue
            emitted = batch.token_ids[r, shadow.start:int(batch.num_tokens[r])]
            seen = min(len(emitted), len(shadow.tokens))
            if seen <= 0:
                continue
            differs = np.flatnonzero(shadow.tokens[:seen] != emitted[:seen])
            if not differs.size and seen < len(shadow.tokens):
                continue  # so far so good: wait for the rest
            accepted = int(differs[0]) if differs.size else seen
            judged = min(accepted + 1, len(shadow.tokens))
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
        """A step's wall time, to the cost model (without ``draft_seconds``, the draft
        model's forwards: :meth:`plan_draft` prices them itself, and counted in ``T(n)``
        they would be paid twice and make plain steps look dearer) and the step arbiter
        (all of it: what a block of such steps really emits per second), except an
        ``unrated`` step (see :meth:`plan_draft`), whose cost is not the rate of
        speculating:

        - a step that ran one of the draft's optimistic trials: the price of learning the
          draft's worth, paid once per engine (measured on the validation pair,
          edit/b1/t0, fresh engine: with the trials' steps counted, the cell's first two
          speculative blocks measured 232 and 367 tok/s against 688 for plain decoding,
          which then ran for 100 steps, while speculation later measured 1,000-2,000
          tok/s);
        - a step whose draft run caught up, right after plain steps, on the tokens decoded
          plainly: the price of switching, paid once per switch, where the block that
          re-checks speculation after plain blocks is a single block (measured on the
          validation pair, complete/b1/t1, fresh engine: the 11 draft runs right after a
          plain step took 21.0 ms a step, median, against 17.1 for the other 111, for
          2.55 against 2.66 tokens; such re-checks lost to plain decoding for most of the
          run's first half).

        A step that read prompt tokens (``read_prompts``: one fact of the step,
        which the runner hands every observer) teaches the cost model and the arbiter
        nothing: its time is mostly the prompts' attention, which the forward curve
        (timed on short contexts) does not price, and one such residual, clipped only to
        one forward of that many tokens, moved the model's fixed part and its speculative
        overhead by milliseconds (measured on the validation pair, server/b8/t1, fresh
        engine: after the 1,348-token prefill step the model priced a plain step of 8
        requests at 3.25 ms, where it took 5-7, and the speculative machinery at 6.12 ms;
        the union then drafted nothing, its steps measured half the rate it predicted,
        and that correction kept plain decoding on for most of the greedy requests' run
        while their copies were in sight).

        ``rate_tokens``: the tokens the step arbiter counts for the step, if not
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
        """Whether this speculative step asks the draft model's gate (:meth:`plan_draft`),
        for a batch with rows that may use the draft: every step while the gate opens,
        and in a step right after plain ones (a re-check of speculation must weigh the
        draft: seen on the validation pair, complete/b1/t1, a re-check whose step skipped
        the gate planned nothing and plain decoding went on); after the gate kept the
        draft off :data:`GATE_PATIENCE` times in a row, once every ``gap`` steps, the gap
        doubling up to :data:`MAX_GATE_GAP` (see both). A step that does not ask runs no
        draft and weighs the token-level candidates alone, at the price of the step it
        plans (what the gate would have planned too when it stays closed).

        The draft's optimistic trials wait for the steps the gate is asked in, as any
        run does: a trial the gate declines (a perfect draft for the trial's rows would
        not beat the step's token-level candidates) spends none of them, and asked every
        step for a trial that never ran, the gate cost the whole run its prices (measured
        on the validation pair, fresh engine, complete/b8/t0: asked in 45 of 50 steps, no
        draft run, 0.284 ms a step for the plan, 3% of the step)."""
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

        The draft model's candidate is unknown until it runs, and running it costs
        ``forward_seconds`` per drafted position whatever the rows (its first pass
        included). So the step is planned twice (:func:`plan`): over the token-level
        ``offers`` alone, and with one more candidate for every row that may use the draft
        (``caps`` [num_reqs] > 0), ``caps[r]`` tokens long, whose acceptance is the
        estimator's for the draft proposer before a signal is known (its cells pooled over
        signal buckets), drawn from the posterior once per cell for all rows (Thompson
        sampling: one forward serves every row, so the draw that decides it is one guess
        at the draft's worth; the posterior mean would never run a draft whose prior
        does not pay on its own, and never learn that it does). The second plan keeps the
        first's choice for every row but those where the draft's candidate is worth more
        (:func:`~specplugin.adaptive.controller.with_candidates`), and is not made at all
        when no row is: the draft then cannot run. The
        draft runs for the rows the second plan gives it if, for some number of positions
        m (each one forward, shared by the rows; row r drafting ``min(k_r, m)``), the
        step's tokens per second with its forwards counted beat the first plan's::

            max_m E_with(m) / (T(n_with(m)) + run_seconds + forward_seconds * m)  >  E_without / T(n_without)

        Where it runs, row r may draft up to the second plan's ``k_r``, not ``min(k_r, m)``:
        how many forwards a run makes is its stop rule's call
        (:class:`~specplugin.adaptive.draft_rule.StopRule`, whose thresholds price a
        forward too), taken with the draft's confidence at each position, which this plan,
        made before the draft runs, does not have (measured on the validation pair, fresh
        engines, complete/b1/t1, the union against itself with the runs cut at m: 0.91x
        the time, median of eight pairs, seven of them faster).

        At a cold start the draft's tokens are coin flips (the estimator's prior, Beta
        around 0.5), so the draft runs in the steps whose draw is high enough to pay;
        once its acceptance is measured the draws narrow around it. Before that, in an
        engine's first :data:`DRAFT_TRIALS` steps where it would pay if every token were
        accepted (while fewer than :data:`DRAFT_TRIAL_EVIDENCE` of its tokens were
        judged), it runs on that optimistic estimate: what it is worth on this pair is
        learnt only by running it, and a few forwards are cheap next to a run that never
        learns it (its own stop rule still ends each run where its confidence falls).
        A trial is optimistic for :data:`DRAFT_TRIAL_ROWS` rows only, those whose first
        pass reads least; the batch's other rows are planned on the posterior.

        ``run_seconds``: what a draft run costs beyond its forwards whatever it drafts
        (its first pass's inputs and draw over a forward's, timed by the caller).
        ``warm_run_seconds``: what it costs in a run right after another (None: this run
        is one, or none was timed). A run after plain steps costs more (its weights and
        code went cold), once: the runs after it are warm. So where the rows that draft
        are expected to keep drafting (:meth:`_draft_kept_on`), the excess is spread as a
        catch-up is (below), over the steps their remaining tokens last; charged whole to
        one step it kept the draft off for good once it had been off (traced on the
        validation pair, fresh engine, complete/b1/t1: a cold run priced 2.64 ms over a
        warm one's 0.16, a new request's 50 steps decoded plainly, the arbiter's every
        re-check weighing that price against one step's gain).
        ``catch_up_seconds`` [num_reqs]: what the draft's first pass adds for row r beyond
        one that reads its newest token only, if it drafts for it: the tokens its draft KV
        lacks (a new request's prompt, the gap since the row last drafted) read through the
        draft model. Counted
        for the rows the plan gives the draft (measured: unpriced, the catch-ups of the
        draft's exploratory runs held a fresh engine at batch 1, temperature 1 to 0.83x
        of no speculation while it decoded 476 of 510 steps plainly).
        ``remaining_tokens`` [num_reqs]: tokens each row may still emit. A catch-up is
        paid once and serves every later step in which the row drafts, so with it the
        catch-up of a row expected to keep drafting with the draft (:meth:`_draft_kept_on`)
        is spread over the steps it has left, its remaining tokens over the tokens a step
        with the draft emits for it (``1 + P_1 + ... + P_k``): charged whole to one step,
        a new request's prompt outweighed any one step's gain and the draft never ran
        (measured on the validation pair, fresh engine, complete batch 1 temperature 1:
        not one draft-model run in the cell's 512 steps)."""
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
        # the draft's tokens before it runs: one cell per (mode, position, history)
        sampled, pooled_cells = batch.sampled, self.estimator.pooled_cells
        trial_rows = self._trial_rows(lengths_list, catch_up_seconds) if trial else ()
        pooled: dict[tuple, list[float]] = {}  # (mode, history, n) -> the rows' shared cells
        added = []  # (row, index, acceptance) of the draft's candidates
        for r, n in enumerate(lengths_list):
            if not n:
                continue
            if r in trial_rows:  # untried: as if every token were accepted (see the docstring)
                draft = [1.0 - 1e-6] * n
            else:  # one draw per cell, shared by the rows (see the docstring)
                key = (sampled[r], histories[r], n)
                draft = pooled.get(key)
                if draft is None:
                    draft = pooled[key] = pooled_cells(draft_index, sampled[r], histories[r],
                                                       n, draw=self.explore)
            acceptance[r].append(draft)
            added.append((r, len(acceptance[r]) - 1, draft))
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
        # the with-draft plan cut to m = 1 .. max k forwards: the other rows' part is
        # fixed, the draft rows add their P_m while they have an m-th token
        others = [Choice(NO_CANDIDATE, 0) if k[r] else c for r, c in enumerate(with_draft)]
        expected = self._rate_terms(acceptance, others)[0]
        num_tokens = batch.num_reqs + sum(c.num_tokens for c in others)
        gains, reach = [0.0] * max(k), [0] * max(k)  # [max k] sum of P_m, rows with an m-th
        for r, kr in enumerate(k):
            if not kr:  # (a row without the draft may have no candidate at all: nothing to add)
                continue
            for j, p in enumerate(cumulative(acceptance[r][-1][:kr])):
                gains[j] += p
                reach[j] += 1
        best, best_rate = 0, kept / kept_seconds
        overhead = spec_overhead + run_seconds
        catch_up = False  # the run catches up right after plain steps (see _observe)
        behind = ([] if catch_up_seconds is None else  # the first pass's catch-up rows
                  [r for r, (c, kr) in enumerate(zip(catch_up_seconds, k)) if kr and c > 0.0])
        cold = (0.0 if warm_run_seconds is None
                else max(0.0, run_seconds - warm_run_seconds))  # (see the docstring)
        asked = [r for r, kr in enumerate(k) if kr] if cold > 0.0 else behind
        kept_on = (set() if remaining_tokens is None or not asked
                   else self._draft_kept_on(acceptance, asked, draft_index, batch, histories))
        share = {}  # [kept-on rows] the part of a one-time cost that falls to this step
        for r in kept_on:  # one step of the row's steps left
            emitted = 1.0 + sum(cumulative(acceptance[r][-1][:k[r]]))
            share[r] = min(1.0, emitted / max(1, remaining_tokens[r]))
        if share and cold > 0.0:  # the run after it is warm for as long as a row drafts
            overhead -= cold * (1.0 - min(share.values()))
        if behind:
            catch_up = self._after_plain
            for r in behind:
                overhead += catch_up_seconds[r] * share.get(r, 1.0)
        for m in range(1, len(gains) + 1):
            expected += gains[m - 1]
            num_tokens += reach[m - 1]
            rate = expected / (self.cost.step_one(num_tokens) + overhead + forward_seconds * m)
            if rate > best_rate:
                best, best_rate = m, rate
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
        """Of ``rows`` (rows the draft plans for whose draft KV is behind), those whose
        draft candidate the step's plan also chooses at the posterior means of the
        draft's tokens: rows expected to keep drafting with it, so that a catch-up paid
        now serves their later steps too. A row that gets the draft only through this
        step's posterior draw or an optimistic trial (exploration) is not expected to: its
        catch-up is this step's alone, or greedy rows whose n-gram and suffix candidates
        are worth more would read their whole prompts through the draft on every
        exploratory draw."""
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
        ``draft_forwards``: forwards the draft model's run made this step (its stop rule's
        count), which the step arbiter's prediction then prices (None: the m forwards
        :meth:`plan_draft` priced). The arbiter compares the rate it measures, every
        forward that ran included, with the predicted one: priced at m while the run made
        more, the prediction ran high for reasons neither the estimator nor the cost
        model has, and its correction would have held speculation back."""
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
        """The controller's plan over ``offers`` (in row order), in one compiled call
        (:func:`kernels.plan_offers <specplugin.adaptive.kernels.plan_offers>`): each
        offer's row, proposer, mode and history bucket, its tokens' signals, and the step
        times, packed in two arrays; the kernel builds each token's estimator cell and
        reads its estimate from the estimator's tables. The explorer row's offers take
        their posterior draws (the gate's, where :meth:`plan_draft` estimated them this
        step: kept per cell, they are the same numbers), every other token its mean."""
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
        call (:meth:`~specplugin.adaptive.estimator.AcceptanceEstimator.estimate_cells`),
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
        """Each row's offers that the plan did not send (every proposer makes one offer a
        row at most, so they are the other proposers'), as req_id -> (the row's draft in
        ``drafts``, [(the offer as a :class:`_Pending` with its cells, its tokens)]), for
        :meth:`_learn_unchosen`. Not the draft model's offers for a sampled request: its
        tokens are drawn from its own distribution, whose acceptance a match against the
        emitted token does not measure."""
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
        """The offers a step did not send, judged against the tokens it emitted: the
        sent draft's accepted tokens, then its row's last token (``verified.next_tokens``).
        An offer's token is judged accepted where it and every token before it equal the
        emitted ones, rejected at the first that differs; tokens past the emitted ones are
        not judged. That is what verification would have said of it: at temperature 0
        exactly, at temperature > 0 in expectation (a deterministic draft token x is
        accepted with probability p(x), and each emitted token is a draw from the
        target's p given the tokens before it, lossless verification's promise).

        Why: only the sent offer's tokens are verified, so a proposer whose offers the
        plan did not pick early learned nothing while they lost, and the first proposer to
        be believed kept winning (seen on the validation pair, fresh engine,
        complete/b8/t0: in one engine suffix's candidates took 99% of the accepted tokens,
        n-gram's 0%, in the next n-gram's 93%, on the same prompts; the plain steps' peek,
        which asks n-gram, then judged copies in sight by an n-gram that had never been
        verified). Not for rows verified with the scorer's extra candidates (their emitted
        tokens may be an extra's)."""
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
            for sent, tokens in others:
                seen = min(len(tokens), len(emitted))  # (tokens: as many as its cells)
                differs = np.flatnonzero(tokens[:seen] != emitted[:seen])
                matched = int(differs[0]) if differs.size else seen
                judged = min(matched + 1, seen)
                if judged > 0:
                    judged_parts.append((sent, judged_outcomes(None, row, False, judged,
                                                               matched)))
        self.stats.offers_judged_unsent += len(judged_parts)
        self._teach(judged_parts)

    def _learn_extras(self, extras: list[_Pending], outcome: Scored, emitted: int,
                      judged_parts: list) -> None:
        """The scorer's extra candidates: each one's accepted tokens (where the rule tells)
        to the estimator; the winner's emitted tokens to its proposer's counters.

        A proposer's alternatives are not learned from: they carry its signals but are
        its second guesses, verified only where expected to pay; learned as its own
        guesses they would teach the estimator that the proposer is worse than it is
        (measured: the n-gram proposer's share of drafts halved)."""
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

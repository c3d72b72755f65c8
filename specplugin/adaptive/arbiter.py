"""The step arbiter: speculate at all this step, or decode plainly? Measured, not modelled.

The controller (:mod:`~specplugin.adaptive.controller`) decides per request from
estimates of acceptance and of cost. Estimates can be wrong in ways no per-request
rule sees: a speculative step pays fixed costs (the draft model's first pass, the
engine's rejection sampler and spec-decode metadata, the union's own Python) that
a model of the target's forward time does not hold, and which the cost model can
only learn by comparing steps with and without drafts, steps the controller no
longer makes once it believes speculation pays. So the plugin also measures the
one thing it promises, emitted tokens per second, for both choices.

Steps are grouped in blocks of ``block_steps``; a block either speculates (the
controller plans as usual) or decodes plainly (no proposer runs, the engine takes
its plain path). A block's rate is the tokens its steps emitted over their wall
time (a step's time runs from one drafting call to the next, so it holds the
drafting the block decided and the verification of those drafts). Steps that are not
counted (the step that read new prompts, a step that ran one of the draft's optimistic
trials or the draft's catch-up right after plain steps, an idle gap) do not fill a
block: it runs on until ``block_steps`` steps were counted, at most
``MAX_BLOCK_FACTOR`` times as many steps in all (measured on the
validation pair, fresh engine, edit/b1/t0: four of the first block's steps ran trials,
and the one counted step left, a request's first, set the bucket's speculative rate at
148 tok/s; with the next block's 311 against plain's 265-288, the bucket decoded
plainly for 8 blocks while speculation later measured 424-1,069). Per batch-size
bucket (``1``, ``2-3``, ``4-7``, ...), greedy and sampled batches apart, each choice
keeps an exponential average of its block rates ``r_spec``, ``r_plain``. The next block
takes the choice with the higher rate, except that the other one is tried again
once it has not run for::

    interval = clip(min_interval * gap / gap_unit, min_interval, max_interval)   blocks

where ``gap = |r_spec - r_plain| / max(r_spec, r_plain)``: choices that are close
are re-measured often (the winner may change with the text and the load), a loser
by far rarely, so that exploring costs about ``gap / interval``, at most
``gap_unit / min_interval`` (1.25% with the defaults) of throughput, except that
speculation, when it loses after only ``b`` measured blocks, is tried again after at
most ``min_interval * b``: its rate is the text's (the plain rate is the machine's), a
bucket's first blocks are a request's first steps (nothing of its own output to copy
yet, the prompt just read), and two of them must not keep a bucket decoding plainly for
hundreds of steps (measured on the validation pair, fresh engine, edit/b1/t0: the two
warm-up speculative blocks measured 246 and 412 tok/s against ~600 plain, and plain
decoding ran the whole first request, where speculating later measured 1,000-2,000
tok/s). A bucket starts
by speculating for ``warmup_blocks`` blocks, then decodes plainly for as many (one
slow block, such as the one in which a new batch's drafts first read their prompts,
must not decide alone); a choice's rate is the mean of its first blocks.

**Plain blocks that need not run.** A plain step is the most predictable step there
is: the cost model (:mod:`~specplugin.adaptive.cost`) times the target's forwards at
engine start and learns the rest of a step from every step since. Where the measured
speculative rate is ``MODEL_MARGIN`` (1.25) times the plain rate that model predicts
(``plain_rate_model``), the plain warm-up blocks are skipped and the modelled rate
stands in until a plain block is measured (the usual re-check of the loser): on text
that copies, a fresh engine then does not decode plainly for its first blocks to
learn what it already knows. The margin covers the model's error: until the cost
model has seen both kinds of steps, it counts the speculative machinery's cost into
every step and so underrates plain decoding by that much. The model was also seen to err
the other way (trace record ``warmup_choice``, validation pair, fresh engines: 458 and 341
tok/s modelled where plain decoding then measured 355 and 339 at complete/b8/t0, 777 where
it measured 505-570 at adversarial/b16/t1): an overrated plain rate only makes the skip
rarer, the warm-up then measuring what the model got wrong.

**Neighbouring batch sizes.** A batch changes bucket as its requests finish (8, then
4-7, 2-3, 1) and as its mix of greedy and sampled requests shifts, and a bucket's warm-up
(speculative blocks first, then plain ones) costs the same whatever was measured next
door: a run of 8 requests of 128 tokens went through five warm-ups in its ~100 steps
(validation pair, fresh engine, server/b8/t1). A bucket seen for the first time
therefore starts from the nearest bucket of the same mode (greedy or sampled) measured
with both choices: its rates scaled by the cost model's plain rate here over there
(``plain_rate_model``: how the machine's rate moves with the batch size; what speculation
gains per step is taken to move alike), counted as the warm-up's blocks, so the new bucket
takes the neighbour's verdict at once and measures the loser after the usual interval
(its first measured blocks weigh in as they would in any bucket).

**New text.** The plain rate is a property of the machine and the batch size; the
speculative rate is one of the text (how much of it the proposers can guess). A rate
measured on other requests says little about a request that just arrived: a batch
that gave plain decoding the lead on text nothing could guess would otherwise keep
decoding plainly through text that copies (measured: 101 of 206 steps plain on an
edit workload where speculating ran 2.8x faster). So when requests join the batch
(:meth:`StepArbiter.new_requests`) and plain decoding leads, the running plain block
ends and the next one speculates, after at least ``min_interval`` other blocks, or at
once when the whole batch is new since speculation was last measured. That block's
rate enters the speculative average like any other block's: the first steps of a
request are its worst for speculating (nothing of its own output to copy yet, the
draft model's first pass reads its prompt), so letting them replace the average
(as an earlier version did, by the batch's new share) sent a whole request at batch 1
to plain decoding after one cold block (measured: 64 of 72 blocks plain in the last
request of a fresh engine's complete/b1 cell, after 8 speculative blocks at 3x the
plain rate in the request before).

**An engine's first steps.** The first speculative steps of an engine's life pay
one-time costs: the first draft-model forwards, first calls into the verification
path, allocations (measured in a fresh compiled engine on the validation pair at
batch 1: 9-17 ms per speculative step in the first request, 5.5-7 ms later; the
plain step was 3.3 ms). Averaged into the rate they sent a fresh engine to plain
decoding for the rest of its first requests and made the union's predictions look
four times too optimistic. So the engine's first ``ENGINE_WARMUP_BLOCKS`` speculative
blocks run but are not measured (nor their predictions compared); the bucket's
warm-up then measures the blocks after them.

**Long plain blocks.** Inside a plain block every step but the first runs as the
engine's own plain step (:meth:`StepArbiter.plain_steps_ahead`); the step that ends a block
is decided by the plugin's code, and that code, run once per block in an engine whose caches
the forward just swept, is what a plain step costs beyond vLLM's own (measured in an engine
at batch 1 on the validation pair: +0.15 ms for the decided step and +0.03 ms for the one
after it, on a 1.4 ms step, one block in four steps). The plain rate is the machine's and
moves little from block to block, and what ends plain decoding early (new requests, a copy
in sight) does not wait for a block's end, or waits at most for one. So a plain block that
runs because plain decoding leads, past the bucket's warm-up, is ``PLAIN_BLOCK_FACTOR``
times ``block_steps`` long and counts as many blocks towards the interval after which
speculation is re-measured: speculation is tried again after as many steps as before, with
half as many decided steps in between. A plain block that re-measures plain decoding while
speculation leads keeps the usual length (doubling it would double what exploring costs).

**Copies in sight.** Text that starts copying in the middle of a request is new text
too. On a plain step the union asks its cheapest proposer (n-gram, else suffix) on the
batch as it stands and plans the step it would verify (:meth:`Union.plain_step
<specplugin.adaptive.union.Union.plain_step>`); the arbiter judges that plan
(:meth:`StepArbiter.pays_now`): its predicted rate times the bucket's ``correction``
against the measured plain rate. If it wins, a speculative block starts at once
(:meth:`StepArbiter.speculate_now`). The correction is what the union's predictions
missed over the bucket's last :data:`RECENT_SPEC_BLOCKS` speculative blocks, in two
factors: the tokens they emitted over the tokens predicted for them (the estimator's
error, such as a copy's tokens under sampling), times the seconds the cost model *now*
gives their steps (each step's query tokens, plus the draft model's priced run) over the
seconds they measured (the speculative machinery's fixed costs, a slow engine). Both
models learn from every step, so an error measured long ago must not be counted again
once they have learned it: the tokens factor reads the last blocks only, and the seconds
are re-predicted rather than kept as a ratio of the time (measured on the zoo pair, fresh
engine, complete/b8/t0: a request's first speculative steps emitted the tokens predicted
for them but took 9.05 ms against a predicted 4.49, and plain steps 6.5-7.3 ms where the
cost model, timed at engine start on short contexts, said ~4; the model then learned the
longer contexts' cost from the plain blocks, while a ratio of the time, 0.5, halved the
peek's predictions a second time: 24 plain steps on text that copied, where speculation
then measured 2,100-2,600 tok/s against 1,100-1,200 plain).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specplugin import trace

SPECULATE, PLAIN = True, False
# speculation that measures this many times the cost model's plain rate needs no plain
# block to prove it (see "Plain blocks that need not run" above)
MODEL_MARGIN = 1.25
# the engine's first speculative blocks are not measured (see "An engine's first steps")
ENGINE_WARMUP_BLOCKS = 2
# a block whose steps were not counted runs on, to at most this many times block_steps
MAX_BLOCK_FACTOR = 2
# alternate_blocks (tests): a plain block is this many times block_steps, so that a test
# engine also decodes plainly long enough to settle (``specplugin profile --step-ab``)
ALTERNATE_PLAIN_FACTOR = 3
# speculative blocks whose steps the correction re-predicts (see "Copies in sight")
RECENT_SPEC_BLOCKS = 3
# a plain block that runs because plain decoding leads is this many times block_steps, and
# counts as many blocks towards re-measuring speculation (see "Long plain blocks")
PLAIN_BLOCK_FACTOR = 2


def batch_bucket(num_reqs: int) -> int:
    """0 for 1 request, 1 for 2-3, 2 for 4-7, ... (rates change with the batch size)."""
    return max(0, int(num_reqs).bit_length() - 1)


@dataclass
class _Bucket:
    rate: dict = field(default_factory=dict)  # choice -> tokens per second (EMA over blocks)
    blocks: dict = field(default_factory=lambda: {SPECULATE: 0, PLAIN: 0})  # measured blocks
    blocks_since: dict = field(default_factory=lambda: {SPECULATE: 0, PLAIN: 0})
    new_share: float = 0.0  # share of the batch new since speculation was last measured
    # what speculative steps measured over what was predicted for them (see "Copies in
    # sight"; None: none measured yet), as last computed; with ``recent`` the correction
    # is computed afresh (a restored bucket has this value alone)
    correction: float | None = None
    # the last RECENT_SPEC_BLOCKS speculative blocks: (a step's measured tokens, its
    # predicted tokens, its measured seconds, the planned steps' (query tokens, drafts
    # verified, seconds beyond the cost model's))
    recent: list = field(default_factory=list)
    num_reqs: int = 0  # batch size of the block measured last


class StepArbiter:
    def __init__(self, block_steps: int = 4, smoothing: float = 0.3, min_interval: int = 4,
                 max_interval: int = 256, gap_unit: float = 0.05, warmup_blocks: int = 2,
                 alternate: bool = False):
        """``alternate``: test only (``fault_injection.alternate_blocks``): speculative and
        plain blocks take turns whatever the rates say."""
        self.alternate = alternate
        if block_steps < 1:
            raise ValueError(f"block_steps must be >= 1; got {block_steps}")
        self.block_steps, self.smoothing, self.warmup_blocks = block_steps, smoothing, warmup_blocks
        self.min_interval, self.max_interval, self.gap_unit = min_interval, max_interval, gap_unit
        self.forget()
        self.num_plain_blocks = self.num_spec_blocks = 0
        self.num_seeded_buckets = 0  # buckets that started from a neighbour's rates
        self._engine_spec_blocks = 0  # speculative blocks closed (see ENGINE_WARMUP_BLOCKS)
        # num_reqs -> tokens per second of a plain step, modelled (None: unknown); the
        # union gives its cost model's
        self.plain_rate_model: Callable[[int], float | None] | None = None
        # (query tokens, verifies drafts) -> the seconds the cost model gives such a step
        # now; the union gives its cost model's (None: predictions are not re-predicted)
        self.step_seconds_model: Callable[[int, bool], float] | None = None

    def forget(self) -> None:
        """A fresh engine's measurements (also what ``__init__`` starts from): no bucket's
        rates, no block running. The block counters stay (see :meth:`Union.forget_learned
        <specplugin.adaptive.union.Union.forget_learned>`)."""
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        self._choice = SPECULATE
        self._bucket: tuple[int, bool] | None = None  # of the running block
        self._steps = 0  # steps of the running block so far
        self._counted = 0  # of them, steps whose time the block's rate holds
        self._length = self.block_steps  # counted steps that end the running block
        self._tokens = self._seconds = 0.0  # counted part of the running block
        # the union's prediction of each planned step: (tokens emitted, seconds)
        self._predicted: list[tuple[float, float]] = []
        # each planned step's (query tokens, verifies drafts, seconds beyond the model's)
        self._shapes: list[tuple[int, bool, float]] = []
        self._num_reqs = 0  # batch size of the running block (at its start)

    def stats(self) -> dict[str, int]:
        return {"speculative_blocks": self.num_spec_blocks, "plain_blocks": self.num_plain_blocks}

    def buckets(self) -> dict[tuple[int, bool], _Bucket]:
        """(batch bucket, sampled) -> what was measured there (for ``state_dir``)."""
        return dict(self._buckets)

    def restore_bucket(self, key: tuple[int, bool], rate: dict, blocks: dict,
                       correction: float | None, num_reqs: int = 0) -> None:
        """Rates an earlier engine measured (``state_dir``, :mod:`specplugin.adaptive.memory`);
        ``num_reqs``: the batch size they were last measured at (0: unknown, and then the
        bucket seeds no neighbour, see "Neighbouring batch sizes")."""
        state = self._buckets.setdefault(key, _Bucket())
        state.rate = dict(rate)
        state.blocks = {SPECULATE: 0, PLAIN: 0} | dict(blocks)
        state.correction = correction
        state.num_reqs = int(num_reqs)

    def rate(self, num_reqs: int, choice: bool, sampled: bool = False) -> float | None:
        """Measured tokens per second of ``choice`` at this batch size (None: not yet)."""
        bucket = self._buckets.get((batch_bucket(num_reqs), bool(sampled)))
        return None if bucket is None else bucket.rate.get(choice)

    def observe(self, num_tokens: int, seconds: float | None) -> None:
        """The step that just ran emitted ``num_tokens`` in ``seconds`` of wall time
        (None: not a decode step's time to count, e.g. the step read new prompts)."""
        self._steps += 1
        if seconds is None or seconds <= 0:
            return
        state = self._buckets.get(self._bucket)  # (no new _Bucket: this runs every step)
        best = None if state is None else max(state.rate.values(), default=None)
        if best and seconds > 10 * max(num_tokens, 1) / best:
            return  # an idle gap (no requests, a new batch arriving), not a step
        self._tokens += num_tokens
        self._seconds += seconds
        self._counted += 1

    def new_requests(self, num_new: int, num_reqs: int) -> None:
        """``num_new`` of the batch's ``num_reqs`` requests arrived this step (new text:
        see the module docstring)."""
        if num_new <= 0 or num_reqs <= 0 or self._bucket is None:
            return
        # the new requests' bucket is the one of the batch they joined
        bucket = (batch_bucket(num_reqs), self._bucket[1])
        state = self._state(bucket, num_reqs)
        state.new_share = min(1.0, state.new_share + num_new / num_reqs)
        if (bucket == self._bucket and self._choice == PLAIN and not self.alternate
                and self._retries_spec(state)):
            self._close()
            self._start(bucket, num_reqs)

    def _retries_spec(self, state: _Bucket) -> bool:
        """Whether new text sends this bucket back to speculating now: after at least
        ``min_interval`` whole blocks of something else, or at once when none of the text
        speculation was measured on is left in the batch (``new_share`` 1: at batch 1,
        every new request)."""
        if state.new_share <= 0 or min(state.blocks.values()) < self.warmup_blocks:
            return False
        return state.new_share >= 1.0 or state.blocks_since[SPECULATE] > self.min_interval

    def speculate(self, num_reqs: int, sampled: bool = False) -> bool:
        """Whether the step about to be planned speculates (call once per step);
        ``sampled``: most of its requests sample (acceptance, and so the rate of
        speculating, differs by far between greedy and sampled text)."""
        bucket = (batch_bucket(num_reqs), bool(sampled))
        if self._bucket is not None and bucket != self._bucket:
            self._start(bucket, num_reqs)  # the batch changed size: this block measures nothing
        elif self._bucket is None or self._block_done():
            self._close()
            self._start(bucket, num_reqs)
        return self._choice

    def plain_steps_ahead(self) -> int:
        """How many of the next decisions are foregone after :meth:`speculate` kept a step
        plain: the running plain block ends only once it has counted its steps (or run
        ``MAX_BLOCK_FACTOR`` times as many), and each step observed counts one at most, so
        until then every decision says plain, whatever the steps measure (a step not
        counted makes the block longer, never shorter). 0 while speculating."""
        if self._choice != PLAIN or self._bucket is None:
            return 0
        steps = self._length
        return max(0, min(steps - self._counted, MAX_BLOCK_FACTOR * steps - self._steps) - 1)

    def _block_done(self) -> bool:
        """The running block has its counted steps (``block_steps``, or a multiple for a
        plain block: see "Long plain blocks"), or has run ``MAX_BLOCK_FACTOR`` times as
        many steps in all."""
        return self._counted >= self._length or self._steps >= MAX_BLOCK_FACTOR * self._length

    def predicted(self, tokens: float, seconds: float, num_tokens: int = 0,
                  drafts: bool = False) -> None:
        """The union planned the running step to emit ``tokens`` in ``seconds``, running
        ``num_tokens`` query tokens (``drafts``: some of them drafts); the part of
        ``seconds`` the cost model does not give such a step (the draft model's priced
        run) is kept with the step's shape, which the correction re-predicts."""
        self._predicted.append((tokens, seconds))
        model = self.step_seconds_model
        if model is not None and num_tokens > 0:
            self._shapes.append((num_tokens, drafts, seconds - model(num_tokens, drafts)))

    def correction(self, num_reqs: int, sampled: bool = False) -> float:
        """The bucket's correction of the union's predicted rates (see "Copies in sight";
        1 until a speculative block was measured)."""
        state = self._buckets.get((batch_bucket(num_reqs), bool(sampled)))
        return 1.0 if state is None else self._correction(state)

    def _correction(self, state: _Bucket) -> float:
        model = self.step_seconds_model
        if not state.recent or model is None:
            return state.correction or 1.0
        tokens = sum(t for t, _, _, _ in state.recent)
        predicted_tokens = sum(p for _, p, _, _ in state.recent)
        seconds = sum(sum(model(n, d) + extra for n, d, extra in shapes) / len(shapes)
                      for _, _, _, shapes in state.recent)
        measured = sum(m for _, _, m, _ in state.recent)
        return tokens / predicted_tokens * seconds / measured

    def pays_now(self, num_reqs: int, predicted_rate: float, sampled: bool = False) -> bool:
        """Whether a step the union predicts at ``predicted_rate`` beats plain decoding at
        this batch size: the prediction times the bucket's correction (what its last
        speculative blocks measured over what is predicted for them; 1 until one was: see
        "Copies in sight") against the measured plain rate (False until plain blocks were
        measured: the warm-up's plain blocks must run to give that rate)."""
        state = self._buckets.get((batch_bucket(num_reqs), bool(sampled)))
        if self.alternate or state is None or PLAIN not in state.rate:
            return False
        correction = self._correction(state)
        pays = correction * predicted_rate > state.rate[PLAIN]
        if trace.TRACE is not None:
            trace.TRACE.write("peek", num_reqs=num_reqs, predicted=predicted_rate,
                              correction=correction, plain=state.rate[PLAIN], pays=pays)
        return pays

    def speculate_now(self, num_reqs: int, sampled: bool = False) -> None:
        """Text worth speculating on is in sight (the union's peek on a plain step): the
        running block ends and a speculative one starts with the step about to be planned."""
        bucket = (batch_bucket(num_reqs), bool(sampled))
        self._close()
        self._start(bucket, num_reqs, SPECULATE)

    def nothing_to_verify(self) -> bool:
        """The step just planned in the running speculative block verifies nothing (no
        candidate paid for any row). If the block re-checks speculation while plain
        decoding leads, it ends here and a plain block starts with the next step; True
        then. Such a block would measure only the cost of asking (measured on the
        validation pair, fresh engine, adversarial/b16/t1: re-check blocks with nothing
        offered ran at ~9.2 ms a step against ~7.0 for plain ones, four steps each):
        what it re-checks, whether the text now pays, was answered by the plan. Its
        counted steps, if any, close it as usual (they did verify drafts); the interval
        to the next re-check runs from this block's start as it would have from its end.
        While speculation leads, or before the bucket's warm-up measured both choices, a
        step without drafts is part of speculating and the block runs on."""
        if self.alternate or self._choice != SPECULATE or self._bucket is None:
            return False
        state = self._buckets.get(self._bucket)
        if (state is None or state.blocks[SPECULATE] < self.warmup_blocks
                or not self._plain_leads(state)):
            return False
        if trace.TRACE is not None:
            trace.TRACE.write("recheck_empty", num_reqs=self._num_reqs, steps=self._steps)
        bucket, num_reqs = self._bucket, self._num_reqs
        self._close()
        self._start(bucket, num_reqs, PLAIN)
        return True

    def _close(self) -> None:
        if self._bucket is None or self._seconds <= 0:
            return
        state = self._buckets.setdefault(self._bucket, _Bucket())
        rate = self._tokens / self._seconds
        counted = not (self._choice == SPECULATE
                       and self._engine_spec_blocks < ENGINE_WARMUP_BLOCKS)
        planned = len(self._predicted)
        # a step's tokens and seconds: predicted (mean over planned steps), measured (mean
        # over counted steps)
        tokens, seconds = self._tokens / self._counted, self._seconds / self._counted
        predicted_tokens = sum(t for t, _ in self._predicted) / planned if planned else None
        predicted_seconds = sum(s for _, s in self._predicted) / planned if planned else None
        if trace.TRACE is not None:
            trace.TRACE.write(
                "block", choice="spec" if self._choice == SPECULATE else "plain",
                num_reqs=self._num_reqs, sampled=self._bucket[1], steps=self._steps,
                rate=rate, counted=counted,
                predicted=(sum(t / s for t, s in self._predicted) / planned
                           if planned else None),
                tokens=tokens, ms=seconds * 1e3, predicted_tokens=predicted_tokens,
                predicted_ms=None if predicted_seconds is None else predicted_seconds * 1e3)
        if not counted:
            self._engine_spec_blocks += 1  # the engine's first: one-time costs, not a rate
            return
        state.blocks[self._choice] += 1
        state.num_reqs = self._num_reqs
        # a plain mean over the first blocks (warm-up), then an exponential average
        weight = max(self.smoothing, 1.0 / state.blocks[self._choice])
        if self._choice == SPECULATE:  # measured on the batch's text as it is now
            state.new_share = 0.0
            if self._shapes:
                block = (tokens, predicted_tokens, seconds, self._shapes)
                state.recent = (state.recent + [block])[-RECENT_SPEC_BLOCKS:]
                state.correction = self._correction(state)
            elif predicted_seconds:  # (no cost model to re-predict with)
                ratio = tokens * predicted_seconds / (predicted_tokens * seconds)
                old_ratio = state.correction
                state.correction = (ratio if old_ratio is None
                                    else old_ratio + self.smoothing * (ratio - old_ratio))
        old = state.rate.get(self._choice, rate)
        state.rate[self._choice] = old + weight * (rate - old)

    def _state(self, bucket: tuple[int, bool], num_reqs: int) -> _Bucket:
        """The bucket's measurements; a bucket seen for the first time is seeded from the
        nearest one of the same mode measured with both choices (see "Neighbouring batch
        sizes")."""
        state = self._buckets.get(bucket)
        if state is not None:
            return state
        state = self._buckets[bucket] = _Bucket()
        donors = [(abs(key[0] - bucket[0]), key[0], s) for key, s in self._buckets.items()
                  if key[1] == bucket[1] and s is not state and s.num_reqs
                  and min(s.blocks.values()) >= self.warmup_blocks]
        model = self.plain_rate_model
        if self.alternate or not donors or model is None:
            return state
        _, _, donor = min(donors, key=lambda d: d[:2])
        here, there = model(num_reqs), model(donor.num_reqs)
        if not here or not there:
            return state
        scale = here / there  # the machine's plain rate from there to here, as modelled
        state.rate = {choice: rate * scale for choice, rate in donor.rate.items()}
        state.blocks = {SPECULATE: self.warmup_blocks, PLAIN: self.warmup_blocks}
        state.correction, state.recent = donor.correction, list(donor.recent)
        state.num_reqs = num_reqs
        self.num_seeded_buckets += 1
        return state

    def _start(self, bucket: tuple[int, bool], num_reqs: int, choice: bool | None = None) -> None:
        state = self._state(bucket, num_reqs)
        self._choice = self._next_choice(state, num_reqs) if choice is None else choice
        factor = self._plain_factor(state) if self._choice == PLAIN else 1
        self._length = factor * self.block_steps
        state.blocks_since[self._choice] = 0
        state.blocks_since[not self._choice] += 1 if self.alternate else factor
        if self._choice == SPECULATE:
            self.num_spec_blocks += 1
        else:
            self.num_plain_blocks += 1
        self._bucket, self._steps, self._tokens, self._seconds = bucket, 0, 0.0, 0.0
        self._counted = 0
        self._num_reqs = num_reqs
        self._predicted, self._shapes = [], []

    def _plain_factor(self, state: _Bucket) -> int:
        """How many times ``block_steps`` a plain block starting now runs (see "Long plain
        blocks"): ``PLAIN_BLOCK_FACTOR`` once the bucket's warm-up measured plain decoding
        and it leads, 1 otherwise (``ALTERNATE_PLAIN_FACTOR`` under ``alternate``)."""
        if self.alternate:
            return ALTERNATE_PLAIN_FACTOR
        return PLAIN_BLOCK_FACTOR if self._plain_leads(state) else 1

    def _plain_leads(self, state: _Bucket) -> bool:
        """The bucket's warm-up measured plain decoding, both choices have a rate, and
        plain decoding's is the higher."""
        plain, spec = state.rate.get(PLAIN), state.rate.get(SPECULATE)
        return (state.blocks[PLAIN] >= self.warmup_blocks and plain is not None
                and spec is not None and plain > spec)

    def _next_choice(self, state: _Bucket, num_reqs: int) -> bool:
        if self.alternate:  # turns by the blocks that ran here, measured or not (an
            # engine's first speculative blocks are not: counting measured blocks, a test's
            # short cell could see only those and never a plain block close)
            return state.blocks_since[PLAIN] == 0
        if state.blocks[SPECULATE] < self.warmup_blocks:
            return SPECULATE
        spec, plain = state.rate[SPECULATE], state.rate.get(PLAIN)
        if state.blocks[PLAIN] < self.warmup_blocks:
            modelled = self.plain_rate_model(num_reqs) if self.plain_rate_model else None
            if trace.TRACE is not None:
                trace.TRACE.write("warmup_choice", num_reqs=num_reqs, spec=spec, plain=plain,
                                  modelled=modelled, plain_blocks=state.blocks[PLAIN])
            if modelled is None or spec < MODEL_MARGIN * modelled:
                return PLAIN  # too close (or unknown) to call without measuring it
            plain = plain or modelled
        best = SPECULATE if spec >= plain else PLAIN
        if best == PLAIN and self._retries_spec(state):
            return SPECULATE
        gap = abs(spec - plain) / max(spec, plain)
        interval = min(self.max_interval,
                       max(self.min_interval, round(self.min_interval * gap / self.gap_unit)))
        if best == PLAIN:  # speculation judged on few blocks is re-checked sooner (above)
            interval = min(interval, self.min_interval * max(1, state.blocks[SPECULATE]))
        return (not best) if state.blocks_since[not best] >= interval else best


def arbiter_for(config) -> StepArbiter | None:
    """The step arbiter a :class:`~specplugin.config.SpecPluginConfig` asks for (None:
    ``step_arbiter`` off, every step planned)."""
    if not config.step_arbiter:
        return None
    return StepArbiter(alternate=config.fault_injection.alternate_blocks)

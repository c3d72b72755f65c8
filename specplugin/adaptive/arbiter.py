"""The step arbiter: speculate at all this step, or decode plainly? Measured, not modelled.

Per-request estimates miss a speculative step's fixed costs (draft first pass, rejection
sampler, spec-decode metadata, the union's Python), which the cost model can only learn
from steps the controller stops making once it believes speculation pays. So the plugin
measures what it promises, emitted tokens per second, for both choices.

Steps run in blocks of ``block_steps`` counted steps (uncounted ones, e.g. prompt reads,
draft trials, idle gaps, extend a block up to ``MAX_BLOCK_FACTOR`` times) that either
speculate or decode plainly. Per batch-size bucket (``1``, ``2-3``, ``4-7``, ...), greedy
and sampled apart, each choice keeps an EMA of its block rates; the faster runs, and the
other is re-measured after::

    interval = clip(min_interval * gap / gap_unit, min_interval, max_interval)   blocks
    gap      = |r_spec - r_plain| / max(r_spec, r_plain)

so exploring costs at most ``gap_unit / min_interval`` (1.25%). A speculation that lost on
``b`` blocks is retried within ``min_interval * b``. A bucket warms up with
``warmup_blocks`` speculative then as many plain blocks. Refinements (named in comments
below; see docs/design.md):

- Plain blocks that need not run: the plain warm-up is skipped where speculation
  measures ``MODEL_MARGIN`` times the cost model's plain rate.
- Neighbouring batch sizes: a new bucket starts from the nearest measured one's rates.
- New text: the speculative rate belongs to the text, so new requests trigger a
  speculative block when plain leads; it joins the average (replacing it would let a
  request's cold first block send it plain).
- An engine's first steps: its first speculative blocks are not measured.
- Long plain blocks: a leading plain block runs ``PLAIN_BLOCK_FACTOR`` times longer.
- Copies in sight: a plain step's peek (:meth:`StepArbiter.pays_now`) starts speculation
  when its predicted rate, times the bucket's ``correction`` (measured over predicted, in
  tokens and in re-predicted seconds), beats the plain rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specplugin import trace
from specplugin.adaptive.cost import GapFilter

SPECULATE, PLAIN = True, False
# speculation measuring this many times the modelled plain rate needs no plain block
# (the margin covers the model's error)
MODEL_MARGIN = 1.25
# the engine's first speculative blocks are not measured (see "An engine's first steps")
ENGINE_WARMUP_BLOCKS = 2
# a block whose steps were not counted runs on, to at most this many times block_steps
MAX_BLOCK_FACTOR = 2
# alternate_blocks (tests): plain block length in block_steps, long enough to settle
ALTERNATE_PLAIN_FACTOR = 3
# speculative blocks whose steps the correction re-predicts (see "Copies in sight")
RECENT_SPEC_BLOCKS = 3
# a plain block run because plain leads is this many times block_steps, and counts as
# many blocks towards re-measuring speculation (see "Long plain blocks")
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
    # measured over predicted for speculative steps ("Copies in sight"; None: none yet),
    # as last computed (a restored bucket has only this; else recomputed from ``recent``)
    correction: float | None = None
    # last RECENT_SPEC_BLOCKS speculative blocks: (measured tokens, predicted tokens,
    # measured seconds, [(query tokens, verifies drafts, seconds beyond the model's)])
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
        # num_reqs -> modelled plain tokens per second (None: unknown); set by the union
        self.plain_rate_model: Callable[[int], float | None] | None = None
        # (query tokens, verifies drafts) -> modelled seconds now; set by the union
        self.step_seconds_model: Callable[[int, bool], float] | None = None

    def forget(self) -> None:
        """Back to a fresh engine: no bucket's rates, no block running (counters stay)."""
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        self._choice = SPECULATE
        self._bucket: tuple[int, bool] | None = None  # of the running block
        self._steps = 0  # steps of the running block so far
        self._counted = 0  # of them, steps whose time the block's rate holds
        self._length = self.block_steps  # counted steps that end the running block
        self._tokens = self._seconds = 0.0  # counted part of the running block
        self._gaps = GapFilter(factor=10.0)  # a step 10x the best rate's: an idle gap
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
        """Rates an earlier engine measured (``state_dir``); ``num_reqs``: the batch size
        last measured at (0: unknown, then it seeds no neighbour)."""
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
        state = self._buckets.get(self._bucket)  # no new _Bucket: runs every step
        best = None if state is None else max(state.rate.values(), default=None)
        if best and self._gaps.is_gap(seconds, max(num_tokens, 1) / best):
            return  # an idle gap, not a step
        self._tokens += num_tokens
        self._seconds += seconds
        self._counted += 1

    def new_requests(self, num_new: int, num_reqs: int) -> None:
        """``num_new`` of the batch's ``num_reqs`` requests arrived this step ("New text")."""
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
        """Whether new text sends this bucket back to speculating now: after
        ``min_interval`` other blocks, or at once when the whole batch is new."""
        if state.new_share <= 0 or min(state.blocks.values()) < self.warmup_blocks:
            return False
        return state.new_share >= 1.0 or state.blocks_since[SPECULATE] > self.min_interval

    def speculate(self, num_reqs: int, sampled: bool = False) -> bool:
        """Whether the step about to be planned speculates (call once per step);
        ``sampled``: most of its requests sample."""
        bucket = (batch_bucket(num_reqs), bool(sampled))
        if self._bucket is not None and bucket != self._bucket:
            self._start(bucket, num_reqs)  # the batch changed size: this block measures nothing
        elif self._bucket is None or self._block_done():
            self._close()
            self._start(bucket, num_reqs)
        return self._choice

    def plain_steps_ahead(self) -> int:
        """How many next decisions are surely plain (the running plain block cannot end
        sooner, whatever the steps measure); 0 while speculating."""
        if self._choice != PLAIN or self._bucket is None:
            return 0
        steps = self._length
        return max(0, min(steps - self._counted, MAX_BLOCK_FACTOR * steps - self._steps) - 1)

    def _block_done(self) -> bool:
        """The running block has its counted steps, or ``MAX_BLOCK_FACTOR`` times as many
        steps in all."""
        return self._counted >= self._length or self._steps >= MAX_BLOCK_FACTOR * self._length

    def predicted(self, tokens: float, seconds: float, num_tokens: int = 0,
                  drafts: bool = False) -> None:
        """The union planned the running step to emit ``tokens`` in ``seconds`` over
        ``num_tokens`` query tokens (``drafts``: some are drafts); the shape is kept for
        the correction to re-predict."""
        self._predicted.append((tokens, seconds))
        model = self.step_seconds_model
        if model is not None and num_tokens > 0:
            self._shapes.append((num_tokens, drafts, seconds - model(num_tokens, drafts)))

    def correction(self, num_reqs: int, sampled: bool = False) -> float:
        """The bucket's correction of predicted rates ("Copies in sight"; 1 until measured)."""
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
        """Whether ``predicted_rate`` times the bucket's correction beats the measured plain
        rate (False until a plain rate was measured)."""
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
        """The peek found text worth speculating on: end the block, start a speculative one."""
        bucket = (batch_bucket(num_reqs), bool(sampled))
        self._close()
        self._start(bucket, num_reqs, SPECULATE)

    def nothing_to_verify(self) -> bool:
        """The step just planned verifies nothing. If the block is a re-check of
        speculation while plain leads, end it and start a plain block (True): the plan
        already answered the re-check, and the block would measure only the cost of
        asking. Otherwise the block runs on."""
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
        # per step: predicted (mean over planned steps), measured (mean over counted ones)
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
            elif predicted_seconds:  # no cost model to re-predict with
                ratio = tokens * predicted_seconds / (predicted_tokens * seconds)
                old_ratio = state.correction
                state.correction = (ratio if old_ratio is None
                                    else old_ratio + self.smoothing * (ratio - old_ratio))
        old = state.rate.get(self._choice, rate)
        state.rate[self._choice] = old + weight * (rate - old)

    def _state(self, bucket: tuple[int, bool], num_reqs: int) -> _Bucket:
        """The bucket's measurements; a new bucket is seeded from the nearest one of the
        same mode measured with both choices, scaled by the modelled plain rate
        ("Neighbouring batch sizes")."""
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
        """A plain block's length in ``block_steps`` ("Long plain blocks")."""
        if self.alternate:
            return ALTERNATE_PLAIN_FACTOR
        return PLAIN_BLOCK_FACTOR if self._plain_leads(state) else 1

    def _plain_leads(self, state: _Bucket) -> bool:
        """Plain was measured past warm-up and has the higher rate."""
        plain, spec = state.rate.get(PLAIN), state.rate.get(SPECULATE)
        return (state.blocks[PLAIN] >= self.warmup_blocks and plain is not None
                and spec is not None and plain > spec)

    def _next_choice(self, state: _Bucket, num_reqs: int) -> bool:
        if self.alternate:  # turns by blocks run, measured or not (the engine's first
            # speculative blocks are not measured)
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
        if best == PLAIN:  # speculation judged on few blocks is re-checked sooner
            interval = min(interval, self.min_interval * max(1, state.blocks[SPECULATE]))
        return (not best) if state.blocks_since[not best] >= interval else best


def arbiter_for(config) -> StepArbiter | None:
    """The step arbiter the config asks for (None: ``step_arbiter`` off)."""
    if not config.step_arbiter:
        return None
    return StepArbiter(alternate=config.fault_injection.alternate_blocks)

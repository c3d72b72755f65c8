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
drafting the block decided and the verification of those drafts). Per batch-size
bucket (``1``, ``2-3``, ``4-7``, ...), greedy and sampled batches apart, each choice
keeps an exponential average of its block rates ``r_spec``, ``r_plain``. The next block
takes the choice with the higher rate, except that the other one is tried again
once it has not run for::

    interval = clip(min_interval * gap / gap_unit, min_interval, max_interval)   blocks

where ``gap = |r_spec - r_plain| / max(r_spec, r_plain)``: choices that are close
are re-measured often (the winner may change with the text and the load), a loser
by far rarely, so that exploring costs about ``gap / interval``, at most
``gap_unit / min_interval`` (1.25% with the defaults) of throughput. A bucket starts
by alternating, speculation first, until each choice has ``warmup_blocks``
measured blocks (one slow block, such as the one in which a new batch's drafts
first read their prompts, must not decide alone); its rate is their mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATE, PLAIN = True, False


def batch_bucket(num_reqs: int) -> int:
    """0 for 1 request, 1 for 2-3, 2 for 4-7, ... (rates change with the batch size)."""
    return max(0, int(num_reqs).bit_length() - 1)


@dataclass
class _Bucket:
    rate: dict = field(default_factory=dict)  # choice -> tokens per second (EMA over blocks)
    blocks: dict = field(default_factory=lambda: {SPECULATE: 0, PLAIN: 0})  # measured blocks
    blocks_since: dict = field(default_factory=lambda: {SPECULATE: 0, PLAIN: 0})


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
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        self._choice = SPECULATE
        self._bucket: tuple[int, bool] | None = None  # of the running block
        self._steps = 0  # steps of the running block so far
        self._tokens = self._seconds = 0.0  # counted part of the running block
        self.num_plain_blocks = self.num_spec_blocks = 0

    def stats(self) -> dict[str, int]:
        return {"speculative_blocks": self.num_spec_blocks, "plain_blocks": self.num_plain_blocks}

    def rate(self, num_reqs: int, choice: bool, sampled: bool = False) -> float | None:
        """Measured tokens per second of ``choice`` at this batch size (None: not yet)."""
        bucket = self._buckets.get((batch_bucket(num_reqs), bool(sampled)))
        return None if bucket is None else bucket.rate.get(choice)

    def observe(self, num_tokens: int, seconds: float | None) -> None:
        """The step that just ran emitted ``num_tokens`` in ``seconds`` of wall time."""
        self._steps += 1
        if seconds is None or seconds <= 0:
            return
        best = max(self._buckets.get(self._bucket, _Bucket()).rate.values(), default=None)
        if best and seconds > 10 * max(num_tokens, 1) / best:
            return  # an idle gap (no requests, a new batch arriving), not a step
        self._tokens += num_tokens
        self._seconds += seconds

    def speculate(self, num_reqs: int, sampled: bool = False) -> bool:
        """Whether the step about to be planned speculates (call once per step);
        ``sampled``: most of its requests sample (acceptance, and so the rate of
        speculating, differs by far between greedy and sampled text)."""
        bucket = (batch_bucket(num_reqs), bool(sampled))
        if self._bucket is not None and bucket != self._bucket:
            self._start(bucket)  # the batch changed size: this block measures nothing
        elif self._bucket is None or self._steps >= self.block_steps:
            self._close()
            self._start(bucket)
        return self._choice

    def _close(self) -> None:
        if self._bucket is None or self._seconds <= 0:
            return
        state = self._buckets.setdefault(self._bucket, _Bucket())
        rate = self._tokens / self._seconds
        state.blocks[self._choice] += 1
        # a plain mean over the first blocks (warm-up), then an exponential average
        weight = max(self.smoothing, 1.0 / state.blocks[self._choice])
        old = state.rate.get(self._choice, rate)
        state.rate[self._choice] = old + weight * (rate - old)

    def _start(self, bucket: tuple[int, bool]) -> None:
        state = self._buckets.setdefault(bucket, _Bucket())
        self._choice = self._next_choice(state)
        state.blocks_since[self._choice] = 0
        state.blocks_since[not self._choice] += 1
        if self._choice == SPECULATE:
            self.num_spec_blocks += 1
        else:
            self.num_plain_blocks += 1
        self._bucket, self._steps, self._tokens, self._seconds = bucket, 0, 0.0, 0.0

    def _next_choice(self, state: _Bucket) -> bool:
        if self.alternate or min(state.blocks.values()) < self.warmup_blocks:
            # alternate, speculation first
            return state.blocks[SPECULATE] <= state.blocks[PLAIN]
        spec, plain = state.rate[SPECULATE], state.rate[PLAIN]
        best = SPECULATE if spec >= plain else PLAIN
        gap = abs(spec - plain) / max(spec, plain)
        interval = min(self.max_interval,
                       max(self.min_interval, round(self.min_interval * gap / self.gap_unit)))
        return (not best) if state.blocks_since[not best] >= interval else best


def arbiter_for(config) -> StepArbiter | None:
    """The step arbiter a :class:`~specplugin.config.SpecPluginConfig` asks for (None:
    ``step_arbiter`` off, every step planned)."""
    if not config.step_arbiter:
        return None
    return StepArbiter(alternate=config.fault_injection.alternate_blocks)

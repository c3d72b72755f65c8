"""The draft model's stop rule: which requests keep drafting, and what drafting costs.

A small draft model runs autoregressively for the whole batch at once (the vLLM
layer, ``specplugin/vllm_layer/draft_proposer.py``, runs it on the paged KV cache; its
mechanics are :mod:`specplugin.proposers.draft`). This module decides, after every
draft position, which requests keep drafting, and learns from verification how far
the draft's confidence can be trusted: the draft's part of the decider, beside the
union's (:mod:`specplugin.adaptive.union`), which decides whether it runs at all.

**Signal.** ``conf`` = the largest probability of the distribution the draft drew
its token from (its own confidence). A draft's confidence is not an acceptance
probability: a small draft model is typically under-confident under greedy
decoding (its argmax agrees with the target's far more often than its top
probability says) and nearly uninformative at temperature 1 (there, acceptance
``sum(min(p, q))`` barely moves with ``conf``). So :class:`AcceptanceCalibration`
maps ``conf`` to an estimated acceptance probability, learned online from the
engine's own verification results, separately for greedy and sampled requests.

**Rule** (:class:`StopRule`). With ``P[r, j] = prod(a[r, :j + 1])`` (``a_i`` the
calibrated acceptance estimate of draft position i: ``P`` is the chance that every
draft token of request r so far is accepted, which is the chance that one more could
be used at all), request r keeps drafting position j + 1 (0-based, up to
``k_max`` = vLLM's ``num_speculative_tokens``) while::

    P[r, j] >= row_threshold

and the batch runs that position's forward only while the drafting rows together
pay for it::

    sum over drafting rows r of (P[r, j] - row_threshold) >= pass_threshold

Both come from :class:`CostModel`, measured on the running engine: an extra draft
token costs the row ``v`` seconds of target verification, an extra batched draft
forward costs ``c`` seconds, and the engine already emits one token per ``t``
seconds; spending time on drafts raises throughput only if the tokens they bring
arrive faster than that, so ``row_threshold = v / t`` and ``pass_threshold = c / t``.
Until a calibration table has seen ``warmup`` verified positions, its requests draft
exactly the default length ``k``. Drafting thus stops early where the draft is likely
wrong, and goes on past ``k`` while it is likely right and the hardware makes that pay.

Stopping never changes the output distribution: it only shortens the draft that
rejection sampling verifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specplugin.adaptive.cost import LEARN_EVERY, StepSums
from specplugin.adaptive.estimator import as_list, judged_outcomes

# An engine's first draft forwards are not timed into the price: they pay one-time costs
# (first calls, allocations, compiled shapes). Measured on the validation pair, compiled,
# batch 1: the forwards of the engine's first draft run averaged 0.9-1.6 ms, later ones
# 0.42 ms; set as the price, the first made the draft look four times dearer than it is,
# and a union that then never ran it never corrected it (no draft-model run in a fresh
# engine's complete batch-1 temperature-1 cell).
WARMUP_FORWARDS = 8
# A later timed forward counts at most this many times the running price: one stall
# (another process, a new shape compiled) must not price the draft out of the steps that
# would correct it.
MAX_FORWARD_JUMP = 4.0
# Weight of a new timing in the first passes' averages (CostModel.observe_first_pass):
# a run has one first pass, so they come at most once a step.
FIRST_PASS_SMOOTHING = 0.1


class CostModel:
    """What drafting costs on this engine, as moving averages of its own timings.

    Measured: ``draft_forward_s`` (c), seconds of one batched draft forward with
    sampling, timed directly (None until :data:`WARMUP_FORWARDS` forwards were timed: the
    caller then prices a forward from a model of its own; a plain mean over the first
    ones, then an exponential average); and per engine step (the wall time between two
    drafting calls) its seconds, emitted tokens, draft forwards and verified draft tokens.
    From those: ``token_s`` (t), seconds per emitted token, and ``verify_s`` (v), the
    target's extra seconds per verified draft token, fitted as the slope of
    ``step seconds - c * forwards`` against verified draft tokens (exponentially
    weighted least squares). :meth:`thresholds` gives ``(v / t, c / t)``; the
    ``fallback`` pair until ``warmup`` steps were seen.

    And the draft run's first pass, timed whole (its inputs, the forward, the first
    draw), which costs what a forward costs only while the draft runs step after step:
    measured on the validation pair at batch 1 (compiled), a forward with its draw
    0.9-1.0 ms and a first pass 0.6-0.7 ms in a run of consecutive draft steps
    (complete/b1/t1), but 2.2-2.5 ms for a first pass reading 2-37 tokens after steps
    without the draft, 2.9-5.0 ms for a new prompt's 211-248 (edit/b1/t0, where the draft
    runs now and then: its weights and code went cold in between). A price of "one
    forward plus the catch-up tokens at the target's price per token" made such runs
    look 2-3 ms cheaper than they were. So first passes are learned apart: after a step
    in which the draft ran (``warm``), an average; otherwise a line in the catch-up
    tokens (:meth:`first_pass_price`).
    """

    def __init__(self, fallback: tuple[float, float] = (0.2, 0.0), smoothing: float = 0.05,
                 warmup: int = 16):
        self.fallback, self.smoothing, self.warmup = fallback, smoothing, warmup
        self.draft_forward_s: float | None = None
        self._forwards_timed = 0  # (see WARMUP_FORWARDS)
        self.token_s: float | None = None
        self._step_s: float | None = None
        self._step_tokens: float | None = None
        # weighted averages of 1, x, y, xx, xy (floats: updated every step, where numpy's
        # per-call cost on five numbers is most of the work)
        self._moments = [0.0] * 5
        self._num_steps = 0
        self._plain_sums = StepSums()  # plain steps not learned yet (observe_plain_step)
        self._held: list[tuple] = []  # steps observe_step holds (see there)
        # the drafter learns the held steps itself once its step ran (flush_due, on the
        # union's background learning): observe_step only holds them
        self.deferred_flush = False
        self._warm_first_s: float | None = None  # first passes right after a draft step
        self._warm_passes = 0
        # weighted averages of 1, x, y, xx, xy over the other first passes: x their
        # catch-up tokens, y their seconds
        self._cold_moments = [0.0] * 5
        self._cold_passes = 0

    def forget(self) -> None:
        """Back to a fresh engine's model: nothing timed (see :meth:`StepCostModel.forget
        <specplugin.adaptive.cost.StepCostModel.forget>`)."""
        deferred = self.deferred_flush
        self.__init__(self.fallback, self.smoothing, self.warmup)
        self.deferred_flush = deferred

    def _ema(self, old: float | None, new: float, smoothing: float | None = None) -> float:
        weight = self.smoothing if smoothing is None else smoothing
        return new if old is None else old + weight * (new - old)

    def observe_forward(self, seconds: float) -> None:
        """One timed draft forward (see :data:`WARMUP_FORWARDS`, :data:`MAX_FORWARD_JUMP`)."""
        self._forwards_timed += 1
        measured = self._forwards_timed - WARMUP_FORWARDS
        if measured <= 0:
            return
        self.draft_forward_s = self._timed_price(self.draft_forward_s, seconds, measured,
                                                 self.smoothing)

    def _timed_price(self, old: float | None, seconds: float, count: int,
                     smoothing: float) -> float:
        """A running price after its ``count``-th timing ``seconds``: a plain mean over the
        first ones, then an exponential average; a timing counts at most
        :data:`MAX_FORWARD_JUMP` times the price so far."""
        if old is not None:
            seconds = min(seconds, MAX_FORWARD_JUMP * old)
        return self._ema(old, seconds, max(smoothing, 1.0 / count))

    def observe_first_pass(self, seconds: float, catch_up_tokens: int, warm: bool) -> None:
        """One draft run's first pass, timed whole; ``catch_up_tokens``: what its rows
        read beyond their newest tokens; ``warm``: the draft ran in the step before. A
        plain mean over the first ones of each kind, then an exponential average; none
        counts before :data:`WARMUP_FORWARDS` forwards were timed, and a later one at
        most :data:`MAX_FORWARD_JUMP` times its running price."""
        if seconds <= 0 or self._forwards_timed <= WARMUP_FORWARDS:
            return  # the engine's first draft runs pay one-time costs (see WARMUP_FORWARDS)
        if warm:
            self._warm_passes += 1
            self._warm_first_s = self._timed_price(self._warm_first_s, seconds,
                                                   self._warm_passes, FIRST_PASS_SMOOTHING)
            return
        x = float(catch_up_tokens)
        price = self.first_pass_price(False, 0.0)
        if price is not None:  # one stall must not price the draft out (MAX_FORWARD_JUMP)
            seconds = min(seconds, MAX_FORWARD_JUMP * (price[0] + price[1] * x))
        self._cold_passes += 1
        weight = max(FIRST_PASS_SMOOTHING, 1.0 / self._cold_passes)
        self._cold_moments = [m + weight * (v - m) for m, v in
                              zip(self._cold_moments, (1.0, x, seconds, x * x, x * seconds))]

    def first_pass_price(self, warm: bool, per_token_prior: float) -> tuple[float, float] | None:
        """(fixed seconds, seconds per catch-up token) of a first pass, as timed: the
        price per token is the slope of the line through the cold passes
        (``per_token_prior`` while their catch-ups are too alike in size to give one,
        the line then going through their mean); the fixed part is the warm passes'
        average if ``warm``, else the line's intercept. None before a pass of that kind
        was timed."""
        _, x, y, xx, xy = self._cold_moments
        slope = per_token_prior
        if self._cold_passes:
            variance = xx - x * x
            if variance > (0.25 * x) ** 2:
                slope = max(0.0, (xy - x * y) / variance)
        if warm:
            return None if self._warm_first_s is None else (self._warm_first_s, slope)
        return None if not self._cold_passes else (max(0.0, y - slope * x), slope)

    def observe_step(self, seconds: float, num_tokens: int, num_forwards: int,
                     num_draft_tokens: int) -> None:
        """One engine step: ``seconds`` of wall time, ``num_tokens`` emitted by the batch,
        ``num_forwards`` draft forwards, ``num_draft_tokens`` drafts verified; learned
        after the plain steps :meth:`observe_plain_step` still holds. A step over 20x the
        average time per token is an idle gap, not a step, and is ignored.

        Past ``warmup`` steps, held and learned :data:`~specplugin.adaptive.cost.LEARN_EVERY`
        at a time, in order, each with the draft forward's price of its own step (as the
        step cost model's, :meth:`StepCostModel.observe
        <specplugin.adaptive.cost.StepCostModel.observe>`: after the target's forward one
        update costs several times what it costs right after another)."""
        held = (seconds, num_tokens, num_forwards, num_draft_tokens, self.draft_forward_s)
        if self._num_steps < self.warmup:
            self._learn_sum(self._plain_sums.flush())
            self._observe_step(*held)
            return
        self._held.append(held)
        if len(self._held) >= LEARN_EVERY and not self.deferred_flush:
            self.flush()

    def flush_due(self) -> None:
        """Learn the held steps if :data:`~specplugin.adaptive.cost.LEARN_EVERY` of them
        are waiting (with :attr:`deferred_flush`, what :meth:`observe_step` leaves to the
        drafter)."""
        if len(self._held) >= LEARN_EVERY:
            self.flush()

    def flush(self) -> None:
        """Learn the steps :meth:`observe_step` holds, in order."""
        held, self._held = self._held, []
        for step in held:
            self._learn_sum(self._plain_sums.flush())
            self._observe_step(*step)

    def observe_plain_step(self, seconds: float, num_tokens: int) -> None:
        """A step in which the draft model neither ran nor had drafts verified: summed
        with the next such steps of its batch size and learned 8 at a time as their mean,
        weighted as 8 steps (:class:`~specplugin.adaptive.cost.StepSums`), after the steps
        :meth:`observe_step` holds."""
        if self._held:
            self.flush()
        self._learn_sum(self._plain_sums.add(num_tokens, seconds))

    def _learn_sum(self, summed: tuple | None) -> None:
        if summed is not None:
            num_tokens, seconds, count = summed
            self._observe_step(seconds, num_tokens, 0, 0, None, count)

    def _observe_step(self, seconds: float, num_tokens: int, num_forwards: int,
                      num_draft_tokens: int, forward_s: float | None,
                      count: int = 1) -> None:
        """``seconds``: the mean of ``count`` equal such steps, learned as that many;
        ``forward_s``: a draft forward's price when the step ran."""
        if num_tokens <= 0 or count < 1:
            return
        if self.token_s is not None and seconds / num_tokens > 20 * self.token_s:
            return
        # count equal steps move an exponential average as far as this one weight
        smoothing = 1.0 - (1.0 - self.smoothing) ** count
        # a ratio of averages: the average of per-step ratios would overweight slow steps
        self._step_s = self._ema(self._step_s, seconds, smoothing)
        self._step_tokens = self._ema(self._step_tokens, float(num_tokens), smoothing)
        self.token_s = self._step_s / self._step_tokens
        x = float(num_draft_tokens)
        y = seconds - (forward_s or 0.0) * num_forwards
        weight = smoothing if self._num_steps else 1.0
        self._moments = [m + weight * (v - m)
                         for m, v in zip(self._moments, (1.0, x, y, x * x, x * y))]
        self._num_steps += count

    @property
    def verify_s(self) -> float:
        _, x, y, xx, xy = self._moments  # the weight moment is always 1
        variance = xx - x * x
        return max(0.0, (xy - x * y) / variance) if variance > 1e-9 else 0.0

    def thresholds(self) -> tuple[float, float]:
        """(row_threshold, pass_threshold) = (v / t, c / t)."""
        if self._num_steps < self.warmup or self.draft_forward_s is None:
            return self.fallback
        return self.verify_s / self.token_s, self.draft_forward_s / self.token_s


class AcceptanceCalibration:
    """P(draft token accepted | its confidence, its position, all earlier drafts accepted),
    learned online.

    Confidence is cut into ``num_buckets`` equal bins and positions into
    ``num_position_groups`` (the last group holds every later position: a draft that
    runs on drifts from the target). Each cell of each table (0: greedy requests, 1:
    sampled requests) holds accepted and seen counts, starting from one
    pseudo-observation at the bin's middle confidence.
    """

    def __init__(self, num_buckets: int = 10, num_position_groups: int = 5, warmup: int = 64):
        self.num_buckets, self.num_position_groups, self.warmup = (
            num_buckets, num_position_groups, warmup)
        self.forget()

    def forget(self) -> None:
        """Back to a fresh engine's tables: one pseudo-observation per cell, none real.
        In place, so that every holder of this calibration (the drafter's outcome
        tracker, its draft runs) forgets with it. Why: ``specplugin bench`` warms an engine
        up before it times a cell, and kept, what the warm-up's verification taught these
        tables (on reversed text) shaped the cell's stop rule as no user's fresh engine
        is shaped (see :meth:`Union.forget_learned
        <specplugin.adaptive.union.Union.forget_learned>`)."""
        num_buckets, num_position_groups = self.num_buckets, self.num_position_groups
        mids = (np.arange(num_buckets) + 0.5) / num_buckets
        self.accepted = np.tile(mids, (2, num_position_groups, 1))  # [2, groups, num_buckets]
        self.seen = np.ones((2, num_position_groups, num_buckets))
        self.num_observed = np.zeros(2, dtype=np.int64)  # [2] real observations per table
        # accepted / seen, [2][groups][num_buckets], as Python lists, built once after each
        # update: the draft loop looks up a few rows per position, where each numpy call
        # costs several microseconds of cold caches
        self._rates: list | None = None

    def estimate_rows(
        self,
        confidence: list[float],  # [n] in [0, 1]
        sampled: list[int],  # [n] 1: the request samples (temperature > 0), 0: greedy
        position: int,  # draft position (0-based) of all n tokens
    ) -> list[float]:  # [n] in (0, 1]
        """Each token's cell's accepted / seen."""
        if self._rates is None:
            self._rates = (self.accepted / self.seen).tolist()
        rates = self._rates
        group = min(position, self.num_position_groups - 1)
        n, top = self.num_buckets, self.num_buckets - 1
        return [rates[s][group][min(max(int(c * n), 0), top)]
                for c, s in zip(confidence, sampled)]

    def warm_tables(self) -> list[bool]:  # [2]: greedy, sampled
        """Whether each table has seen ``warmup`` verified positions."""
        return [n >= self.warmup for n in self.num_observed.tolist()]

    def is_warm(self, sampled: np.ndarray) -> np.ndarray:  # [n] bool
        return np.asarray(self.warm_tables())[sampled.astype(np.int64)]

    def update(
        self,
        confidence: Sequence[float],  # [n] of verified draft positions
        accepted: Sequence[bool | float],  # [n] verdicts, or acceptance probabilities
        sampled: Sequence[bool],  # [n]
        position: Sequence[int],  # [n] draft position of each
    ) -> None:
        """Count ``n`` judged draft tokens into their cells (lists or arrays). One token
        at a time in Python: a step judges a few, where each of a dozen numpy calls
        (clip, add.at, bincount, ...) costs several microseconds of cold caches."""
        n, top, last = self.num_buckets, self.num_buckets - 1, self.num_position_groups - 1
        seen, total, observed = self.seen, self.accepted, self.num_observed
        for c, a, s, p in zip(as_list(confidence), as_list(accepted), as_list(sampled),
                              as_list(position)):
            cell = (int(bool(s)), min(int(p), last), min(max(int(c * n), 0), top))
            seen[cell] += 1.0
            total[cell] += float(a)
            observed[cell[0]] += 1
        self._rates = None


@dataclass(frozen=True)
class StopRule:
    """When each request stops drafting; see the module docstring for the formulas."""

    k: int  # default draft length (used until the calibration is warm)
    k_max: int  # longest draft (vLLM's num_speculative_tokens)
    row_threshold: float = 0.0  # v / t: one more draft token must be this likely used
    pass_threshold: float = 0.0  # c / t: what one more batched draft forward must bring

    def __post_init__(self):
        assert 1 <= self.k <= self.k_max, (self.k, self.k_max)
        assert self.row_threshold >= 0.0 and self.pass_threshold >= 0.0, self

    def keeps_drafting(self, position: int, cumulative: float, warm: bool) -> bool:
        """Whether a row drafts position j + 1 (``position`` j, 0-based, just drafted;
        ``cumulative`` P[r, j]; ``warm``: the calibrated rule, else the default length k)."""
        if position + 1 >= self.k_max:
            return False
        return cumulative >= self.row_threshold if warm else position + 1 < self.k

    def surplus(self, cumulative: float, warm: bool) -> float:
        """What a drafting row brings to one more batched forward beyond its own
        verification (a row in its default length counts as sure): the batch runs the
        forward while the drafting rows' surpluses reach ``pass_threshold``."""
        return (cumulative if warm else 1.0) - self.row_threshold


@dataclass
class DraftRun:
    """One engine step's drafting for a batch: tokens, probabilities, who is still active.

    The loop in the vLLM layer calls :meth:`add` once per position with the whole
    batch's sampled tokens; rows that already stopped still get computed (one batched
    forward is cheaper than regrouping) but their extra tokens are cut off by
    :meth:`lengths`.
    """

    rule: StopRule
    calibration: AcceptanceCalibration
    sampled: Sequence[bool]  # [num_reqs] (a list, or a numpy array)
    caps: Sequence[int] | None = None  # [num_reqs] most draft tokens per row (default k_max)
    token_ids: list[torch.Tensor] = field(default_factory=list)  # positions x [num_reqs]
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # positions x [num_reqs, vocab]
    confidences: list[list[float]] = field(default_factory=list)  # positions x [num_reqs]
    # [k_max, num_reqs, vocab]: where the draws wrote each position's probabilities, in
    # place of the list (draft_probs), when they wrote into one block for the run
    probs_block: torch.Tensor | None = None
    # Per-row bookkeeping is Python lists: it runs after every draft forward, for a few
    # rows, where each numpy call (let alone torch's) costs several microseconds of cold
    # caches (measured, batch 1, caches flushed between calls: 85 us for this
    # bookkeeping in numpy).
    _lengths: list[int] | None = None  # [num_reqs]
    _active: list[bool] | None = None  # [num_reqs]
    _cumulative: list[float] | None = None  # [num_reqs] P[:, j]
    _warm: list[bool] | None = None  # [num_reqs] calibrated (fixed for the step)
    _modes: list[int] | None = None  # [num_reqs] calibration table: 0 greedy, 1 sampled
    _caps: list[int] | None = None  # [num_reqs]

    @property
    def num_reqs(self) -> int:
        return len(self.sampled)

    def add(
        self,
        token_ids: torch.Tensor | np.ndarray,  # [num_reqs] drafted at this position
        confidence: list[float] | np.ndarray,  # [num_reqs] in [0, 1]
        draft_probs: torch.Tensor | None = None,  # [num_reqs, vocab_size] they were drawn from
    ) -> bool:
        """Record one position; returns whether the batch drafts another one."""
        position = len(self.token_ids)
        if self._active is None:
            self._start()
        confidence = confidence if isinstance(confidence, list) else confidence.tolist()
        self.token_ids.append(token_ids)
        self.confidences.append(confidence)
        if draft_probs is not None:
            self.draft_probs.append(draft_probs)
        calibration, rule = self.calibration, self.rule
        estimate = calibration.estimate_rows(confidence, self._modes, position)
        lengths, active, cumulative, warm = (self._lengths, self._active, self._cumulative,
                                             self._warm)
        surplus, any_active = 0.0, False
        for r, cap in enumerate(self._caps):
            cumulative[r] *= estimate[r]
            if not active[r]:
                continue
            lengths[r] += 1
            if rule.keeps_drafting(position, cumulative[r], warm[r]) and lengths[r] < cap:
                surplus += rule.surplus(cumulative[r], warm[r])
                any_active = True
            else:
                active[r] = False
        return any_active and surplus >= rule.pass_threshold

    def _start(self) -> None:
        if self.caps is None:
            self.caps = [self.rule.k_max] * self.num_reqs
        self._caps = [int(c) for c in self.caps]
        self._active = [c > 0 for c in self._caps]
        self._lengths = [0] * self.num_reqs
        self._cumulative = [1.0] * self.num_reqs
        # the calibration only learns between steps (OutcomeTracker.resolve)
        self._modes = [1 if s else 0 for s in self.sampled]
        warm = self.calibration.warm_tables()
        self._warm = [warm[m] for m in self._modes]

    @property
    def num_positions(self) -> int:
        return len(self.token_ids)

    def lengths(self) -> np.ndarray:  # [num_reqs] int: draft tokens kept per row
        return np.asarray(self.length_list(), dtype=np.int64)

    def length_list(self) -> list[int]:  # [num_reqs] draft tokens kept per row
        assert self._lengths is not None, "no position drafted yet"
        return list(self._lengths)

    def row_confidences(self, row: int, length: int) -> list[float]:  # [length]
        """Row ``row``'s confidences at its first ``length`` positions."""
        return [position[row] for position in self.confidences[:length]]

    def stacked_token_ids(self) -> torch.Tensor:  # [num_reqs, num_positions]
        if self.token_ids and isinstance(self.token_ids[0], np.ndarray):  # (host draws)
            return torch.from_numpy(np.stack(self.token_ids, axis=1))
        return torch.stack(self.token_ids, dim=1)

    def token_lists(self, lengths: Sequence[int]) -> list[list[int]]:  # [num_reqs][length]
        """Each row's first ``lengths[row]`` tokens as a list (the drafts vLLM's scheduler
        takes: handed back as lists, they skip vLLM's copy of a token tensor to the host
        and its read back, as its token-level methods' drafts do)."""
        positions = [t.tolist() for t in self.token_ids[:max(lengths, default=0)]]
        return [[p[r] for p in positions[:n]] for r, n in enumerate(lengths)]

    def stacked_confidences(self) -> np.ndarray:  # [num_reqs, num_positions]
        return np.asarray(self.confidences, dtype=np.float64).T

    def stacked_draft_probs(self) -> torch.Tensor | None:  # [num_reqs, num_positions, vocab]
        if self.probs_block is not None:  # (one row: a view, no copy)
            return self.probs_block[:self.num_positions].transpose(0, 1).contiguous()
        if not self.draft_probs:
            return None
        return torch.stack(self.draft_probs, dim=1).contiguous()


class OutcomeTracker:
    """Remembers each request's last draft until its verification result comes back.

    vLLM tells the drafter, one step later, how many draft tokens of each request were
    rejected; rows may have moved in between (finished requests leave the batch), so
    drafts are kept by request id. Of a draft of length n with r rejected, positions
    ``< n - r`` were accepted, position ``n - r`` (if any) was rejected, and later
    positions were never judged: only judged positions update the calibration.
    """

    def __init__(self, calibration: AcceptanceCalibration):
        self.calibration = calibration
        self._pending: dict[str, tuple[list[float], bool]] = {}  # req id -> (confidences [n], sampled)

    def record(self, req_ids: list[str], run: DraftRun,
               lengths: list[int] | None = None) -> None:
        """``lengths``: draft tokens sent per row, when not the run's own (0: the row
        verifies another proposer's candidate, so nothing of the draft's is judged)."""
        lengths = run.length_list() if lengths is None else lengths
        sampled = [bool(s) for s in run.sampled]
        self._pending = {
            req_id: (run.row_confidences(i, lengths[i]), sampled[i])
            for i, req_id in enumerate(req_ids) if lengths[i] > 0
        }

    def forget(self) -> None:
        """Drop pending drafts (their step failed: no verification result will match)."""
        self._pending = {}

    def take(self) -> dict:
        """The pending drafts, handed over (for :meth:`resolve` later, as ``pending``)."""
        pending, self._pending = self._pending, {}
        return pending

    def resolve(self, req_ids: list[str], num_scheduled: list[int],
                num_rejected: list[int] | None,
                expected: list[list[float]] | None = None, pending: dict | None = None) -> int:
        """Learn from the step just verified; returns its number of accepted draft tokens.

        ``num_scheduled[i]``: draft tokens the scheduler verified for row i in that step
        (it may cut a draft short of what was recorded); ``num_rejected[i]``: how many of
        those were rejected (``None``: no request had drafts). Only the scheduled
        positions up to the first rejection are judged; a sampled request's judged tokens
        teach their acceptance probabilities where the verifier computed them
        (``expected[i]``, one per verified draft token of row i: the same average as the
        verdicts, without their noise). Pending drafts are consumed either
        way: a result can only belong to the step right after the drafts were recorded
        (when vLLM skips drafting in between, the runner calls :meth:`forget`).
        ``pending``: drafts :meth:`take` handed over (the drafter learns a step once the
        next one ran, on the union's background); default the ones pending now."""
        if pending is None:
            pending = self.take()
        if num_rejected is None:
            return 0
        confs, accepted, sampled, positions = [], [], [], []
        total = 0
        for row, (req_id, scheduled, rejected) in enumerate(
                zip(req_ids, num_scheduled, num_rejected)):
            if req_id not in pending or scheduled <= 0:
                continue
            conf, is_sampled = pending[req_id]
            verified = min(len(conf), scheduled)
            num_accepted = max(0, verified - rejected)
            total += num_accepted
            judged = min(verified, num_accepted + 1)
            confs += conf[:judged]
            positions += range(judged)
            accepted += judged_outcomes(expected, row, is_sampled, judged, num_accepted)
            sampled += [is_sampled] * judged
        if confs:
            self.calibration.update(confs, accepted, sampled, positions)
        return total

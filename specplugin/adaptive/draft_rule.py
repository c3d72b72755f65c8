"""The draft model's stop rule: which requests keep drafting, and what drafting costs.

The draft model runs for the whole batch at once (:mod:`specplugin.proposers.draft`,
``vllm_layer/draft_proposer.py``); after every draft position this module decides which
rows keep drafting. (Whether the draft runs at all is the union's decision.)

**Signal.** ``conf``: the top probability of the distribution the draft drew from. It is
not an acceptance probability (a small draft is under-confident under greedy decoding,
nearly uninformative at temperature 1), so :class:`AcceptanceCalibration` maps it to one,
learned online from verification, greedy and sampled requests apart.

**Rule** (:class:`StopRule`). With ``P[r, j] = prod(a[r, :j + 1])`` (the chance all of
row r's drafts so far are accepted), row r drafts position j + 1 (up to ``k_max``) while
``P[r, j] >= row_threshold``, and the batch runs that forward only while
``sum over drafting rows of (P[r, j] - row_threshold) >= pass_threshold``. From
:class:`CostModel`: ``row_threshold = v / t``, ``pass_threshold = c / t`` (v: target
seconds per verified draft token, c: seconds per draft forward, t: seconds per emitted
token). Until a calibration table is warm its rows draft exactly ``k``. Stopping never
changes the output distribution, only the draft's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specplugin.adaptive.cost import LEARN_EVERY, GapFilter, StepCostModel, StepSums
from specplugin.adaptive.estimator import as_list, judged_outcomes
from specplugin.profiling import phase

# An engine's first draft forwards pay one-time costs (~2-4x a later one) and are left
# out of the price: a draft priced too dear never runs, so is never corrected.
WARMUP_FORWARDS = 8
# A later timed forward counts at most this many times the running price (one stall
# must not price the draft out).
MAX_FORWARD_JUMP = 4.0
# Weight of a new timing in the first passes' averages (at most one a step).
FIRST_PASS_SMOOTHING = 0.1


class CostModel:
    """What drafting costs on this engine, as moving averages of its own timings.

    ``draft_forward_s`` (c): one batched draft forward with sampling (None until
    :data:`WARMUP_FORWARDS` were timed). Per engine step: ``token_s`` (t), seconds per
    emitted token, and ``verify_s`` (v), the slope of ``step seconds - c * forwards``
    against verified draft tokens (weighted least squares). :meth:`thresholds` gives
    ``(v / t, c / t)``, ``fallback`` until ``warmup`` steps were seen.

    A run's first pass is priced apart (it costs several forwards after steps without the
    draft, when its weights went cold): an average after a draft step (``warm``), else a
    line in the catch-up tokens (:meth:`first_pass_price`).
    """

    def __init__(self, fallback: tuple[float, float] = (0.2, 0.0), smoothing: float = 0.05,
                 warmup: int = 16):
        self.fallback, self.smoothing, self.warmup = fallback, smoothing, warmup
        self.draft_forward_s: float | None = None
        self._forwards_timed = 0  # (see WARMUP_FORWARDS)
        self.token_s: float | None = None
        self._step_s: float | None = None
        self._step_tokens: float | None = None
        # weighted averages of 1, x, y, xx, xy (plain floats: updated every step)
        self._moments = [0.0] * 5
        self._num_steps = 0
        self._plain_sums = StepSums()  # plain steps not learned yet (observe_plain_step)
        self._gaps = GapFilter()
        self._held: list[tuple] = []  # steps observe_step holds (see there)
        # True: the drafter calls flush_due (background learning); observe_step only holds
        self.deferred_flush = False
        self._warm_first_s: float | None = None  # first passes right after a draft step
        self._warm_passes = 0
        # weighted averages of 1, x, y, xx, xy over cold first passes (x: catch-up tokens)
        self._cold_moments = [0.0] * 5
        self._cold_passes = 0

    def forget(self) -> None:
        """Back to a fresh engine's model: nothing timed."""
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
        """Running price after the ``count``-th timing: a plain mean, then an EMA; capped at
        :data:`MAX_FORWARD_JUMP` times the price so far."""
        if old is not None:
            seconds = min(seconds, MAX_FORWARD_JUMP * old)
        return self._ema(old, seconds, max(smoothing, 1.0 / count))

    def observe_first_pass(self, seconds: float, catch_up_tokens: int, warm: bool) -> None:
        """One draft run's first pass, timed whole; ``catch_up_tokens``: what its rows read
        beyond their newest tokens; ``warm``: the draft ran in the step before."""
        if seconds <= 0 or self._forwards_timed <= WARMUP_FORWARDS:
            return  # one-time costs (see WARMUP_FORWARDS)
        if warm:
            self._warm_passes += 1
            self._warm_first_s = self._timed_price(self._warm_first_s, seconds,
                                                   self._warm_passes, FIRST_PASS_SMOOTHING)
            return
        x = float(catch_up_tokens)
        price = self.first_pass_price(False, 0.0)
        if price is not None:  # capped, as in _timed_price
            seconds = min(seconds, MAX_FORWARD_JUMP * (price[0] + price[1] * x))
        self._cold_passes += 1
        weight = max(FIRST_PASS_SMOOTHING, 1.0 / self._cold_passes)
        self._cold_moments = [m + weight * (v - m) for m, v in
                              zip(self._cold_moments, (1.0, x, seconds, x * x, x * seconds))]

    def first_pass_price(self, warm: bool, per_token_prior: float) -> tuple[float, float] | None:
        """(fixed seconds, seconds per catch-up token) of a first pass: the slope of the
        cold passes' line (``per_token_prior`` while their sizes are too alike); fixed part
        the warm average if ``warm``, else the intercept. None before one was timed."""
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
        """One engine step: wall ``seconds``, ``num_tokens`` emitted, ``num_forwards`` draft
        forwards, ``num_draft_tokens`` verified. A step over 20x the time per token is an
        idle gap and is ignored. Past ``warmup`` steps, held and learned ``LEARN_EVERY`` at
        a time, as ``StepCostModel.observe`` does."""
        held = (seconds, num_tokens, num_forwards, num_draft_tokens, self.draft_forward_s)
        if self._num_steps < self.warmup:
            self._learn_sum(self._plain_sums.flush())
            self._observe_step(*held)
            return
        self._held.append(held)
        if len(self._held) >= LEARN_EVERY and not self.deferred_flush:
            self.flush()

    def flush_due(self) -> None:
        """Learn the held steps if ``LEARN_EVERY`` wait (with ``deferred_flush``)."""
        if len(self._held) >= LEARN_EVERY:
            self.flush()

    def flush(self) -> None:
        """Learn the steps :meth:`observe_step` holds, in order."""
        held, self._held = self._held, []
        for step in held:
            self._learn_sum(self._plain_sums.flush())
            self._observe_step(*step)

    def observe_plain_step(self, seconds: float, num_tokens: int) -> None:
        """A step without draft run or verified drafts, learned in sums of 8 (``StepSums``)."""
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
        """``seconds``: the mean of ``count`` steps; ``forward_s``: the forward's price then."""
        if num_tokens <= 0 or count < 1:
            return
        if self._gaps.is_gap(seconds / num_tokens, self.token_s):
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


@dataclass(slots=True)
class DraftPrices:
    """What running the draft model would cost this step (see ``Union.plan_draft``)."""

    forward_s: float  # one batched draft forward
    run_s: float  # a run's cost beyond its forwards (its first pass's inputs and draw)
    catch_up_s: list[float]  # [num_reqs] the first pass's extra reading per row
    warm_run_s: float | None  # run_s right after another run (None: this is one, or untimed)


@phase("plugin: plan")
def draft_prices(costs: CostModel, step_cost: StepCostModel, num_rows: int,
                 behind: Sequence[int], warm: bool, param_ratio: Callable[[], float]
                 ) -> DraftPrices:
    """The draft's prices for a run over ``num_rows`` rows: as ``costs`` timed them, and
    before that from the target's forward curve ``step_cost``: a forward at
    ``param_ratio()`` (draft / target parameters) of the target's for as many rows, a
    catch-up token at the curve's slope scaled by the forward ratio. ``behind``
    [num_reqs]: tokens each row's first pass reads beyond its newest; ``warm``: the
    draft ran in the step before."""
    if costs.draft_forward_s is not None:
        forward = costs.draft_forward_s
    elif step_cost.calibrated:
        forward = param_ratio() * step_cost.forward_one(max(1, num_rows))
    else:
        forward = 0.0
    total, per_token = sum(behind), 0.0
    if total and step_cost.calibrated and forward > 0.0:
        base = max(1, num_rows)
        target = step_cost.forward_one(base)  # F(rows)
        per_token = (forward / max(target, 1e-9)
                     * (step_cost.forward_one(base + total) - target) / total)
    fixed = 0.0
    price = costs.first_pass_price(warm, per_token)
    if price is not None:
        fixed, per_token = max(0.0, price[0] - forward), price[1]
    warm_run = None
    if not warm:  # what the same run would cost right after another
        warm_price = costs.first_pass_price(True, 0.0)
        warm_run = None if warm_price is None else max(0.0, warm_price[0] - forward)
    return DraftPrices(forward, fixed, [per_token * b for b in behind], warm_run)


class AcceptanceCalibration:
    """P(draft token accepted | confidence, position, all earlier drafts accepted), learned
    online: tables [greedy/sampled, position group, confidence bin] of accepted / seen
    counts, each cell starting from one pseudo-observation at its bin's middle.
    """

    def __init__(self, num_buckets: int = 10, num_position_groups: int = 5, warmup: int = 64):
        self.num_buckets, self.num_position_groups, self.warmup = (
            num_buckets, num_position_groups, warmup)
        self.forget()

    def forget(self) -> None:
        """Back to a fresh engine's tables, in place (every holder forgets with it)."""
        num_buckets, num_position_groups = self.num_buckets, self.num_position_groups
        mids = (np.arange(num_buckets) + 0.5) / num_buckets
        self.accepted = np.tile(mids, (2, num_position_groups, 1))  # [2, groups, num_buckets]
        self.seen = np.ones((2, num_position_groups, num_buckets))
        self.num_observed = np.zeros(2, dtype=np.int64)  # [2] real observations per table
        # accepted / seen [2][groups][num_buckets] as lists, rebuilt lazily after updates
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

    def update(
        self,
        confidence: Sequence[float],  # [n] of verified draft positions
        accepted: Sequence[bool | float],  # [n] verdicts, or acceptance probabilities
        sampled: Sequence[bool],  # [n]
        position: Sequence[int],  # [n] draft position of each
    ) -> None:
        """Count ``n`` judged draft tokens into their cells (plain Python: a step judges
        few, and numpy calls are slow with cold caches)."""
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
        """A drafting row's share toward ``pass_threshold`` (a row within its default
        length counts as sure)."""
        return (cumulative if warm else 1.0) - self.row_threshold


@dataclass
class DraftRun:
    """One engine step's drafting for a batch: tokens, probabilities, who is still active.

    :meth:`add` is called once per position with the whole batch; stopped rows are still
    computed (cheaper than regrouping) and cut off by :meth:`lengths`.
    """

    rule: StopRule
    calibration: AcceptanceCalibration
    sampled: Sequence[bool]  # [num_reqs] (a list, or a numpy array)
    caps: Sequence[int] | None = None  # [num_reqs] most draft tokens per row (default k_max)
    token_ids: list[torch.Tensor] = field(default_factory=list)  # positions x [num_reqs]
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # positions x [num_reqs, vocab]
    confidences: list[list[float]] = field(default_factory=list)  # positions x [num_reqs]
    # [k_max, num_reqs, vocab]: the probabilities when the draws wrote one block
    # (instead of draft_probs)
    probs_block: torch.Tensor | None = None
    # Per-row bookkeeping in plain lists: numpy is slow here with cold caches
    _lengths: list[int] | None = None  # [num_reqs]
    _active: list[bool] | None = None  # [num_reqs]
    _cumulative: list[float] | None = None  # [num_reqs] P[:, j]
    _warm: list[bool] | None = None  # [num_reqs] calibrated (fixed for the step)
    _modes: list[int] | None = None  # [num_reqs] calibration table: 0 greedy, 1 sampled
    _caps: list[int] | None = None  # [num_reqs]

    @property
    def num_reqs(self) -> int:
        return len(self.sampled)

    @phase("draft: stop rule")
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
        """Each row's first ``lengths[row]`` tokens, as the lists vLLM's scheduler takes
        (saves vLLM's device-host round trip of a token tensor)."""
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
    """Remembers each request's last draft, by request id (rows move), until vLLM reports
    its rejections a step later. Of n drafted with r rejected, positions ``< n - r`` were
    accepted, ``n - r`` rejected, later ones never judged (and not learned from).
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

        ``num_scheduled[i]``: draft tokens verified for row i (may be fewer than recorded);
        ``num_rejected[i]``: of them rejected (``None``: no drafts). Sampled rows learn the
        verifier's acceptance probabilities (``expected[i]``) where given. Pending drafts
        are consumed either way (a result belongs only to the next step); ``pending``:
        what :meth:`take` handed over, default the ones pending now."""
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

"""The cost model: seconds of one engine step as a function of the tokens it runs::

    T(n) = overhead + F(n)

``n``: query tokens the target runs (one per request plus every verified draft token).
``F``: the target's forward time, piecewise-linear between knots ``n = 1, 2, 4, ...``,
timed at engine start (:meth:`StepCostModel.calibrate`). ``overhead``: everything else a
step does (scheduling, sampling, drafting). Every observed step's residual
``wall - T(n)`` moves ``overhead`` and, scaled, the two knots around ``n``.

``spec_overhead_s``: what a step with any draft pays beyond a plain one (spec-decode
metadata, rejection sampler, planning), the difference of the bias-corrected residual
averages of speculative and plain steps (each residual clipped to one forward so a
compile cannot price speculation out). The residual averages move with the fixed part so
they stay residuals of the current model. The controller charges it once per step.

Warm start: a fresh model's first ``warmup`` plain steps are learned one at a time by
their running mean, into the fixed part only (F was timed; the fixed part was not);
otherwise early steps would look far cheaper than they are. Speculative steps price the
machinery from the :data:`FIRST_SPEC_STEPS`-th on (an engine's first one compiles),
against 0 before any plain step. (see docs/design.md)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from bisect import bisect_left, bisect_right

import numpy as np


def default_knots(max_tokens: int) -> np.ndarray:  # [num_knots] int
    knots = [1]
    while knots[-1] < max_tokens:
        knots.append(min(knots[-1] * 2, max_tokens))
    return np.array(knots)


def calibration_shapes(max_rows: int, max_query_len: int, max_tokens: int,
                       limit: int = 64) -> list[tuple[int, int]]:
    """``(rows, query_len)`` to time at start-up for knots ``n = 1, 2, 4, ... <= limit``:
    one row's query filled first (up to a power of two <= ``max_query_len = 1 + K``), then
    more rows, as a speculative step runs (timing rows of one token would make a batch-1
    engine price n verified tokens as n plain steps). Shapes this engine cannot run are
    left out."""
    query = 1
    while query * 2 <= max_query_len:
        query *= 2
    shapes, n = [], 1
    while n <= min(limit, max_tokens, max_rows * max_query_len):
        q = min(n, query)
        if n // q <= max_rows:
            shapes.append((n // q, q))
        n *= 2
    return shapes


class StepCostModel:
    def __init__(self, max_tokens: int = 512, smoothing: float = 0.05, warmup: int = 8):
        self.knots = default_knots(max_tokens)
        self._knot_list = self.knots.tolist()
        # F at each knot (NaN: not known yet); plain floats, read and nudged every step
        self._f: list[float] = [float("nan")] * len(self._knot_list)
        self.overhead_s = 0.0
        self.smoothing = smoothing
        self.warmup = warmup
        self.num_observed = 0
        self._taught = 0  # steps whose residual moved the fixed part and the knots
        self.calibrated = False  # F known at every knot (calibrate, or a first observation)
        self._residual = {False: 0.0, True: 0.0}  # plain / speculative steps (EMA, from 0)
        self._residual_weight = {False: 0.0, True: 0.0}  # the weight the EMA holds so far
        self._counts = {False: 0, True: 0}
        self._unseen = 0  # plain steps not aged yet (_age_unseen)
        self._gaps = GapFilter()
        self._spec_overhead = 0.0  # spec_overhead_s, kept from one observation to the next
        self._held: list[tuple[int, float, bool]] = []  # steps observe holds (see there)
        # True: the owner calls flush_due (background learning); observe only holds
        self.deferred_flush = False
        self._plain_sums = StepSums()  # plain steps not learned yet (observe_plain)
        self._forward_table: list[float] = []  # F(0), F(1), ... (step_times)
        # during flush: the first and last knot pairs moved
        self._moved: tuple[int, int] | None = None
        self._calibrated_f: list[float] | None = None  # F as calibrate set it (see forget)

    @property
    def _machinery_known(self) -> bool:
        """Both kinds of steps were seen ``warmup`` times."""
        return min(self._counts.values()) >= self.warmup

    @property
    def spec_overhead_s(self) -> float:
        """Speculative minus plain residual average (see the module docstring); cached."""
        return self._spec_overhead

    def _update_spec_overhead(self) -> None:
        if self._counts[True] < FIRST_SPEC_STEPS:
            self._spec_overhead = 0.0
            return
        spec = self._residual[True] / self._residual_weight[True]
        plain = (self._residual[False] / self._residual_weight[False]
                 if self._residual_weight[False] else 0.0)
        self._spec_overhead = max(0.0, spec - plain)

    @property
    def forward_s(self) -> np.ndarray:  # [num_knots] F at each knot (a copy)
        return np.array(self._f)

    def _set_forward(self, values) -> None:
        self._f = [float(v) for v in values]
        self.calibrated = not any(v != v for v in self._f)  # no NaN
        self._forward_table = []

    def forward_one(self, n: float) -> float:
        """F(n) for one n, in plain floats (numpy's per-call cost is ~1% of a step)."""
        knots, f = self._knot_list, self._f
        if n >= knots[-1]:
            slope = (f[-1] - f[-2]) / (knots[-1] - knots[-2])
            return f[-1] + slope * (n - knots[-1])
        i = bisect_right(knots, n)
        if i == 0:
            return f[0]
        lo, hi = knots[i - 1], knots[i]
        return f[i - 1] + (f[i] - f[i - 1]) * (n - lo) / (hi - lo)

    def calibrate(self, num_tokens: np.ndarray, seconds: np.ndarray) -> None:
        """Timed forwards at start-up: ``seconds[i]`` for ``num_tokens[i]`` query tokens,
        interpolated between points, extrapolated linearly beyond. A single point gives a
        flat F (a line through 0 would never draft); observed steps then teach the slope."""
        n, s = np.asarray(num_tokens, float), np.asarray(seconds, float)
        order = np.argsort(n)
        n, s = n[order], s[order]
        if n.size == 1:  # flat (see docstring)
            self._set_forward(np.full(self.knots.shape, s[0]))
        else:
            slope = max(0.0, (s[-1] - s[-2]) / (n[-1] - n[-2]))
            inside = np.interp(self.knots, n, s)
            beyond = s[-1] + slope * (self.knots - n[-1])
            self._set_forward(np.where(self.knots > n[-1], beyond, inside))
        self._calibrated_f = list(self._f)

    def forget(self) -> None:
        """Back to the calibrated forwards, no step observed (``bench`` after its warm-up,
        so a timed cell starts as a user's fresh engine does)."""
        calibrated, deferred = self._calibrated_f, self.deferred_flush
        self.__init__(max_tokens=int(self.knots[-1]), smoothing=self.smoothing,
                      warmup=self.warmup)
        self.deferred_flush = deferred
        if calibrated is not None:
            self._set_forward(calibrated)
            self._calibrated_f = calibrated

    def forward_seconds(self, num_tokens) -> np.ndarray:
        """F(n); linear beyond the last knot."""
        n = np.asarray(num_tokens, dtype=float)
        f_knots = self.forward_s
        f = np.interp(n, self.knots, f_knots)
        slope = (f_knots[-1] - f_knots[-2]) / (self.knots[-1] - self.knots[-2])
        return np.where(n > self.knots[-1], f_knots[-1] + slope * (n - self.knots[-1]), f)

    def step_seconds(self, num_tokens) -> np.ndarray:
        return self.overhead_s + self.forward_seconds(num_tokens)

    def step_one(self, num_tokens: int) -> float:
        """:meth:`step_seconds` for one n, as a float, without numpy."""
        if num_tokens < len(self._forward_table):
            return self.overhead_s + self._forward_table[num_tokens]
        return self.overhead_s + self.forward_one(num_tokens)

    def step_times(self, first: int, count: int) -> list[float]:
        """``[T(first), ..., T(first + count - 1)]`` as floats, from a table of F(n) kept
        until a knot moves."""
        end = first + count
        if end > len(self._forward_table):
            size = max(end, 2 * len(self._forward_table), 64)
            self._forward_table = [self.forward_one(n) for n in range(size)]
        overhead = self.overhead_s
        return [overhead + f for f in self._forward_table[first:end]]

    def observe(self, num_tokens: int, seconds: float, speculative: bool = False) -> None:
        """One engine step's wall time (``speculative``: it verified drafts). A step over
        20x the estimate is an idle gap and is ignored (:class:`GapFilter`). Once both kinds were seen
        ``warmup`` times, steps are held and learned :data:`LEARN_EVERY` at a time, in order
        (with cold caches one update costs ~35 us, four barely more): same result, later."""
        if not self._machinery_known:
            self._learn_sum(self._plain_sums.flush())
            self._observe(num_tokens, seconds, speculative)
            return
        held = self._held
        held.append((num_tokens, seconds, speculative))
        if len(held) >= LEARN_EVERY and not self.deferred_flush:
            self.flush()

    def flush_due(self) -> None:
        """Learn the held steps if :data:`LEARN_EVERY` wait (with ``deferred_flush``)."""
        if len(self._held) >= LEARN_EVERY:
            self.flush()

    def flush(self) -> None:
        """Learn the held steps in order (summed plain steps first); the forward table is
        refreshed once, after the last."""
        held, self._held = self._held, []
        self._moved = (len(self._knot_list), -1)
        try:
            for num_tokens, seconds, speculative in held:
                self._learn_sum(self._plain_sums.flush())
                self._observe(num_tokens, seconds, speculative)
        finally:
            first, last = self._moved
            self._moved = None
            if last >= 0:
                self._refresh_table(first, last)

    def observe_plain(self, num_tokens: int, seconds: float) -> None:
        """A plain step's wall time, learned in sums of 8 (:class:`StepSums`) after the held
        steps; at once while fewer than ``warmup`` steps were taught (a fresh engine's
        first plain steps price every step's fixed part)."""
        if self._held:
            self.flush()
        if self._taught < self.warmup:  # the fixed part only: F was timed at start
            self._learn_sum(self._plain_sums.flush())
            self._observe(num_tokens, seconds, False, knots=False)
            return
        self._learn_sum(self._plain_sums.add(num_tokens, seconds))

    def _learn_sum(self, summed: tuple | None) -> None:
        if summed is not None:
            num_tokens, seconds, count = summed
            self._observe(num_tokens, seconds, False, count)

    def _observe(self, num_tokens: int, seconds: float, speculative: bool,
                 count: int = 1, knots: bool = True) -> None:
        """``seconds``: the mean of ``count`` such steps, learned as that many; ``knots``:
        F's knots move too (else the fixed part alone takes the residual)."""
        if num_tokens <= 0 or seconds <= 0 or count < 1:
            return
        if not self.num_observed and not self.calibrated:  # first sight: a line through 0
            self._set_forward(seconds * self.knots / num_tokens)
        forward = self.forward_one(num_tokens)
        predicted = self.overhead_s + forward
        if self.num_observed and self._gaps.is_gap(seconds, predicted):
            return  # an idle gap, not a step
        self.num_observed += count
        # count equal steps move an exponential average as far as this one weight
        weight = self.smoothing if count == 1 else 1.0 - (1.0 - self.smoothing) ** count
        residual = seconds - predicted
        # clip compiles and host waits to one forward (two for a speculative step before
        # any plain one: it holds the fixed part too); the first spec step is not averaged
        bound = forward * (2.0 if speculative and not self._counts[False] else 1.0)
        clipped = min(max(residual, -forward), bound)
        if not speculative or self._counts[True] >= FIRST_SPEC_STEPS - 1:
            old = self._residual[speculative]
            self._residual[speculative] = old + weight * (clipped - old)
            held = self._residual_weight[speculative]
            self._residual_weight[speculative] = held + weight * (1.0 - held)
        self._counts[speculative] += count
        if not speculative:
            self._unseen += count
            if self._unseen >= AGE_EVERY:  # (a table refresh: not on every plain step)
                self._age_unseen(num_tokens, self._unseen)
                self._unseen = 0
        self._update_spec_overhead()
        if speculative:  # the fixed part and the knots learn from plain steps' terms only
            if not self._machinery_known:
                # machinery's share unknown: as fixed part it would overprice plain steps
                return
            residual -= self.spec_overhead_s
        # fixed part: the residual's average; knots: what varies with n. Early steps move
        # both by the running mean's share until the EMA weight is larger ("Warm start")
        self._taught += count
        weight = max(weight, count / (1.5 * self._taught))
        if not knots and self.calibrated:  # the fixed part takes the knots' share too
            self._move_fixed_part(min(1.0, 1.5 * weight) * residual)
            return
        self._move_fixed_part(weight * residual)
        self._nudge_knots(num_tokens, 0.5 * weight * residual)

    def _age_unseen(self, num_tokens: int, steps: int) -> None:
        """``steps`` plain steps of ``num_tokens`` tokens went by: the speculative residual
        drifts toward the plain one, and F above ``num_tokens`` toward its start-up
        timings (see :data:`UNSEEN_MEMORY`)."""
        keep = (1.0 - 1.0 / UNSEEN_MEMORY) ** steps
        residual, weight = self._residual, self._residual_weight
        if weight[True] and weight[False]:
            plain = residual[False] / weight[False]
            spec = residual[True] / weight[True]
            residual[True] = (plain + (spec - plain) * keep) * weight[True]
        timed, f, knots = self._calibrated_f, self._f, self._knot_list
        first = bisect_right(knots, num_tokens)
        if timed is None or first >= len(knots):
            return
        for i in range(first, len(f)):
            f[i] = max(f[i - 1] if i else 0.0, timed[i] + (f[i] - timed[i]) * keep)
        if self._moved is not None:  # flush: the table once, after all its steps
            self._moved = (min(self._moved[0], first), len(knots) - 1)
        else:
            self._refresh_table(first, len(knots) - 1)

    def _move_fixed_part(self, delta: float) -> None:
        """Move the fixed part by ``delta`` (floored at 0), and both residual averages with
        it, so their difference (the machinery's price) does not count the move."""
        new = max(0.0, self.overhead_s + delta)
        moved, self.overhead_s = new - self.overhead_s, new
        for kind in (False, True):
            self._residual[kind] -= moved * self._residual_weight[kind]
        self._update_spec_overhead()

    def _nudge_knots(self, num_tokens: int, delta: float) -> None:
        knots = self._knot_list
        i = min(max(bisect_left(knots, num_tokens), 1), len(knots) - 1)
        lo, hi = knots[i - 1], knots[i]
        w = min(max((num_tokens - lo) / (hi - lo), 0.0), 1.0)
        f = self._f
        f[i - 1] = max(1e-6, f[i - 1] + (1 - w) * delta)
        f[i] = max(f[i - 1], f[i] + w * delta)
        if self._moved is not None:  # flush: the table once, after all its steps
            self._moved = (min(self._moved[0], i), max(self._moved[1], i))
        else:
            self._refresh_table(i, i)

    def _refresh_table(self, first: int, last: int) -> None:
        """Recompute the forward table around knots ``first - 1`` .. ``last``, segment by
        segment."""
        knots, f, table = self._knot_list, self._f, self._forward_table
        if not table:
            return
        if first < 2:  # below the first knot F is the first knot's
            table[:min(knots[0], len(table))] = [f[0]] * min(knots[0], len(table))
        for j in range(max(first - 1, 1), min(last + 2, len(knots))):  # [knots[j-1], knots[j]]
            lo, hi = knots[j - 1], knots[j]
            end = min(hi + 1, len(table))
            if end <= lo:
                break
            f_lo, slope = f[j - 1], (f[j] - f[j - 1]) / (hi - lo)
            # one slice store: runs every speculative step
            table[lo:end] = [f_lo + slope * d for d in range(end - lo)]
        if last >= len(knots) - 2:  # past the last knot F follows the last two: it moved
            for n in range(knots[-1], len(table)):
                table[n] = self.forward_one(n)


# steps observe holds before it learns them (see there)
LEARN_EVERY = 4
# the speculative step from which residuals price the machinery (the first compiles)
FIRST_SPEC_STEPS = 2
# What only speculative steps teach (the machinery's price, F above a plain step's tokens)
# drifts back toward the start-up timings by 1 / UNSEEN_MEMORY per plain step: evidence
# that is not renewed ages, as the estimator's counts do. Without it a burst of slow
# speculative steps (a stalled host, a sampler stopping the worker) priced speculation out
# for good: no plan drafted, so no step measured it again.
UNSEEN_MEMORY = 500
AGE_EVERY = 32  # plain steps aged at once


@dataclass
class GapFilter:
    """Whether a step's wall time is an idle gap (the engine waited for requests), over
    ``factor`` times what is expected of it: a gap stands alone, so ``patience`` of them
    in a row are the new normal (a slower machine, a model that drifted) and count again.
    A filter that took every later step for a gap would never learn again."""

    factor: float = 20.0
    patience: int = 4
    _run: int = 0  # gaps in a row

    def is_gap(self, seconds: float, expected: float | None) -> bool:
        if not expected or seconds <= self.factor * expected:
            self._run = 0
            return False
        self._run += 1
        if self._run >= self.patience:
            self._run = 0
            return False
        return True


class StepSums:
    """Plain steps' wall times summed per shape, handed on ``size`` at a time as
    ``(key, mean seconds, count)``: one model update (~20 us) per ``size`` steps instead of
    one per step, same result a little later. A step over 20x its shape's last mean is an
    idle gap and is left out (:class:`GapFilter`)."""

    def __init__(self, size: int = 8):
        if size < 2:
            raise ValueError(f"StepSums needs size >= 2; got {size}")
        self.size = size
        self.key = None  # the shape being summed (e.g. query tokens per step)
        self.seconds = 0.0
        self.count = 0
        self._last_mean: dict = {}  # key -> the mean last handed on
        self._gaps = GapFilter()

    def add(self, key, seconds: float) -> tuple | None:
        """One plain step; returns a finished sum (this key's, or the previous key's when
        the shape changed), else None."""
        done = self.flush() if key != self.key else None
        if self._gaps.is_gap(seconds, self._last_mean.get(key)):
            return done
        self.key = key
        self.seconds += seconds
        self.count += 1
        if self.count >= self.size:
            return self.flush()
        return done

    def flush(self) -> tuple | None:
        """The running sum as (key, mean seconds, count), or None when empty."""
        if not self.count:
            self.key = None
            return None
        done = (self.key, self.seconds / self.count, self.count)
        self._last_mean[self.key] = done[1]
        self.key, self.seconds, self.count = None, 0.0, 0
        return done


class StepTimer:
    """One engine step's wall time as a drafter sees it: the time between its drafting
    calls."""

    def __init__(self):
        self._last: float | None = None  # perf_counter() of the previous lap

    def lap(self) -> float | None:
        """Seconds since the previous lap (None: the first, or the first after :meth:`reset`)."""
        now = time.perf_counter()
        seconds = None if self._last is None else now - self._last
        self._last = now
        return seconds

    def reset(self) -> None:
        """A drafting call failed: the next lap measures no step."""
        self._last = None

"""The cost model: seconds of one engine step as a function of the tokens it runs.

A step's wall time is modelled as::

    T(n) = overhead + F(n)

``n`` is the number of query tokens the target runs in the step (one per request
plus every draft token verified), ``F`` the target's forward time, piecewise-linear
between knots ``n = 1, 2, 4, ..., max_tokens`` and ``overhead`` everything else an
engine step does (scheduling, sampling, drafting). At engine start the vLLM layer
times a few forwards per knot (:meth:`StepCostModel.calibrate`): ``F`` is then known
before the first request. While serving, every step's wall time is observed
(:meth:`observe`): the residual ``wall - F(n)`` updates ``overhead`` (exponential
average) and, scaled, the two knots around ``n`` (so ``F`` follows a machine that
got busier or a model compiled after start). Without calibration the knots start
from the first observations (a line through the origin and the first step).

A step that verifies any draft at all also pays the engine's speculative machinery
(spec-decode metadata, the rejection sampler, the plugin's own planning), which a
step without drafts skips: ``spec_overhead_s`` is that difference, the exponential
average of wall-time residuals of steps with drafts minus that of steps without (each
residual clipped to one forward's time, so that a step that compiled a new shape cannot
make speculation look too dear to ever try again). The averages are bias-corrected
(divided by the weight their observations carry so far, as Adam's moments are): started
at 0 and moved 5% per step, they would say a fraction of the overhead for a fresh
engine's first hundred steps (measured: the union's speculative steps at batch 8,
temperature 1 cost ~8.5 ms against a predicted ~6, on a 4.2 ms plain step, and lost to
plain decoding all cell long). Both are residuals of the model as it is: when the fixed
part moves, they move with it (else a residual learned before the fixed part rose would
count the rise in the machinery's price). The controller charges it once per step, to
the first draft token.

**Warm start.** The start-up calibration times forwards alone; a step also schedules,
prepares inputs, samples and crosses processes, which at batch 8 on this CPU doubles
it (a trace on the validation pair: plain steps of 10-11 ms where T(8) said 5.5 before
the first steps were learned). Moved 5% per step from 0, ``overhead`` would say a
fraction of that for a fresh engine's first few dozen steps, and every speculative
step would look twice as cheap as it is exactly when the union decides what to try
first (measured in the server batch: its first speculative blocks predicted at
1,278-1,959 tok/s and measured at 549-765). So a fresh model learns its first
``warmup`` plain steps one at a time (later ones in sums of 8, :class:`StepSums`) and
gives their residuals to the fixed part alone (F was timed at start; the fixed part is
what nothing timed), by the running mean's share (``count / steps taught``); after them
the fixed part and the knots move together, by that share split 2:1 between them, and by
the exponential average's weight once that is larger: the model of a fresh engine is the
mean of what it saw, then follows the machine as before.

**First speculative steps.** Before a plain step was seen, a speculative step's
residual cannot be split into the fixed part and the machinery's, and taken as the
fixed part it would make a plain step look dearer than it is (see
:meth:`StepCostModel._observe`). Until 2026-12-03 it was then not counted at all (nor
until both kinds were seen ``warmup`` times), so a fresh engine that speculated from its
first step priced every speculative step at the target's forward alone (measured on the
validation pair, server/b8/t1, with no warm-up: the first speculative blocks' steps
13.3-16.1 ms against 6.2 predicted). Now the machinery is priced from the second
speculative step on, as the speculative steps' average residual over the plain steps'
(0 before the first plain step; the residual then clipped to two forwards, since it
holds the fixed part too): a speculative step costs what speculative steps measured, a
plain step what plain steps did. The first is left out (an engine's first speculative
step compiles and allocates).

What the controller asks: :meth:`step_seconds` (``T(n)``) and
:meth:`marginal_seconds` (``T(n + k) - T(n)``: what verifying ``k`` more tokens
costs). On a GPU ``F`` is flat until the batch stops being memory-bound; on a CPU it
grows from the first token: the same rule then drafts less.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right

import numpy as np


def default_knots(max_tokens: int) -> np.ndarray:  # [num_knots] int
    knots = [1]
    while knots[-1] < max_tokens:
        knots.append(min(knots[-1] * 2, max_tokens))
    return np.array(knots)


def calibration_shapes(max_rows: int, max_query_len: int, max_tokens: int,
                       limit: int = 64) -> list[tuple[int, int]]:
    """``(rows, query_len)`` to time at start-up for the knots ``n = 1, 2, 4, ... <= limit``:
    the shape a speculative step of ``n`` query tokens runs, one row's query filled first
    (up to the longest power of two within ``max_query_len = 1 + K``), then more rows.

    Why query first: a batch-1 job (``max_num_seqs=1``) runs every step as one row, and
    timed as rows of one token it would get a single knot, priced ``n`` verified tokens at
    ``n`` plain steps (``T(n) = n * T(1)``) and never drafted, where a memory-bound model
    verifies 8 tokens for 1.25x a plain step. Knots no step of this engine can run
    (more rows than ``max_rows``, more tokens than ``max_tokens``) are left out."""
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
        # F at each knot, as floats (NaN: not known yet): read and nudged every step, where
        # numpy's per-call and per-element costs would be most of the work
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
        self._spec_overhead = 0.0  # spec_overhead_s, kept from one observation to the next
        self._held: list[tuple[int, float, bool]] = []  # steps observe holds (see there)
        # the owner learns the held steps itself, once its step's plan is made
        # (flush_due, from the union's background learning): observe only holds them
        self.deferred_flush = False
        self._plain_sums = StepSums()  # plain steps not learned yet (observe_plain)
        self._forward_table: list[float] = []  # F(0), F(1), ... until a knot moves (step_times)
        # during flush: the first and last knot pairs moved (the table refreshed after it)
        self._moved: tuple[int, int] | None = None
        self._calibrated_f: list[float] | None = None  # F as calibrate set it (see forget)

    @property
    def _machinery_known(self) -> bool:
        """Both kinds of steps were seen ``warmup`` times."""
        return min(self._counts.values()) >= self.warmup

    @property
    def spec_overhead_s(self) -> float:
        """The difference of the bias-corrected averages (see the module docstring), from
        the :data:`FIRST_SPEC_STEPS`-th speculative step on (the plain steps' taken as 0
        before the first). Computed when they change (:meth:`_observe`), not each time
        it is read (several times a step)."""
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
        """F(n) for one n, in plain floats: :meth:`observe` runs on every plain step, where
        numpy's per-call overhead on scalars (~60 us) would be a percent of the step."""
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
        """Timed forwards (start-up): ``seconds[i]`` for ``num_tokens[i]`` query tokens.
        Knots between measured points are interpolated, beyond them extrapolated
        linearly from the last two. A single point says nothing of the slope: F is taken
        flat (verification as cheap as a plain step, as on a memory-bound model) and the
        steps observed while serving raise it where it is not; the other guess, a line
        through 0, prices every draft token as a whole plain step and never drafts."""
        n, s = np.asarray(num_tokens, float), np.asarray(seconds, float)
        order = np.argsort(n)
        n, s = n[order], s[order]
        if n.size == 1:  # flat: the observed steps then teach the slope (see docstring)
            self._set_forward(np.full(self.knots.shape, s[0]))
        else:
            slope = max(0.0, (s[-1] - s[-2]) / (n[-1] - n[-2]))
            inside = np.interp(self.knots, n, s)
            beyond = s[-1] + slope * (self.knots - n[-1])
            self._set_forward(np.where(self.knots > n[-1], beyond, inside))
        self._calibrated_f = list(self._f)

    def forget(self) -> None:
        """Back to what the engine knew at start: the calibrated forwards (if any), no
        step observed. Why: ``specplugin bench`` warms an engine up before it times a
        cell, and a model taught by those steps would price the cell's first steps as a
        user's fresh engine cannot (see :meth:`Union.forget_learned
        <specplugin.adaptive.union.Union.forget_learned>`)."""
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
        """T(n) for one n, as a float (what :meth:`step_seconds` gives, without numpy's
        per-call cost: asked several times every step)."""
        if num_tokens < len(self._forward_table):
            return self.overhead_s + self._forward_table[num_tokens]
        return self.overhead_s + self.forward_one(num_tokens)

    def step_times(self, first: int, count: int) -> list[float]:
        """``[T(first), ..., T(first + count - 1)]`` as floats, read from a table of F(n)
        kept until a knot moves (:meth:`calibrate`, :meth:`observe`) plus the fixed part:
        the controller asks for a range of T several times a step."""
        end = first + count
        if end > len(self._forward_table):
            size = max(end, 2 * len(self._forward_table), 64)
            self._forward_table = [self.forward_one(n) for n in range(size)]
        overhead = self.overhead_s
        return [overhead + f for f in self._forward_table[first:end]]

    def marginal_seconds(self, num_tokens: int, extra) -> np.ndarray:
        return self.forward_seconds(num_tokens + np.asarray(extra)) - self.forward_seconds(num_tokens)

    def observe(self, num_tokens: int, seconds: float, speculative: bool = False) -> None:
        """One engine step's wall time (``speculative``: it verified drafts), learned after
        the plain steps :meth:`observe_plain` still holds. A step over 20x the model's
        estimate is an idle gap (no requests), not a step, and is ignored.

        Once both kinds of steps were seen ``warmup`` times, steps are held and learned
        :data:`LEARN_EVERY` at a time, each as itself and in order (:meth:`flush`): the
        model runs right after the target's forward has swept the caches, where one update
        cost ~35 us (the union's core, batch 1, ``scripts/core_bench.py --cold``), and
        four updates in a row cost little more than one. What it learns is the same, at
        most ``LEARN_EVERY - 1`` steps late."""
        if not self._machinery_known:
            self._learn_sum(self._plain_sums.flush())
            self._observe(num_tokens, seconds, speculative)
            return
        held = self._held
        held.append((num_tokens, seconds, speculative))
        if len(held) >= LEARN_EVERY and not self.deferred_flush:
            self.flush()

    def flush_due(self) -> None:
        """Learn the held steps if :data:`LEARN_EVERY` of them are waiting (with
        :attr:`deferred_flush`, what :meth:`observe` then leaves to its owner)."""
        if len(self._held) >= LEARN_EVERY:
            self.flush()

    def flush(self) -> None:
        """Learn the steps :meth:`observe` holds, in order (the plain steps summed before
        them first); the forward table is brought up to date once, after the last of
        them (nothing in between reads it)."""
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
        """A plain step's wall time, summed with the next plain steps of its size and
        learned 8 at a time as their mean, weighted as 8 steps (see :class:`StepSums`),
        after the steps :meth:`observe` holds; learned at once while the model has been
        taught fewer than ``warmup`` steps (a fresh engine's first plain steps are what
        prices every step's fixed part: summed, they said nothing until the eighth, and
        the speculative blocks before it were predicted at the target's forward alone,
        measured on the validation pair, server/b8/t1, fresh engine: 4.6-5.0 ms a step
        predicted, 10-12 measured)."""
        if self._held:
            self.flush()
        if self._taught < self.warmup:  # (the fixed part only: F was timed at start)
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
        if self.num_observed and seconds > 20 * predicted:
            return
        self.num_observed += count
        # count equal steps move an exponential average as far as this one weight
        weight = self.smoothing if count == 1 else 1.0 - (1.0 - self.smoothing) ** count
        residual = seconds - predicted
        # a step that compiled a new shape or waited on the host says nothing about the
        # machinery's steady cost: each residual counts at most one forward's worth (two
        # for a speculative step before any plain one: it holds the fixed part too), and
        # an engine's first speculative step not at all (FIRST_SPEC_STEPS)
        bound = forward * (2.0 if speculative and not self._counts[False] else 1.0)
        clipped = min(max(residual, -forward), bound)
        if not speculative or self._counts[True] >= FIRST_SPEC_STEPS - 1:
            old = self._residual[speculative]
            self._residual[speculative] = old + weight * (clipped - old)
            held = self._residual_weight[speculative]
            self._residual_weight[speculative] = held + weight * (1.0 - held)
        self._counts[speculative] += count
        self._update_spec_overhead()
        if speculative:  # the fixed part and the knots learn from plain steps' terms only
            if not self._machinery_known:
                # the machinery's part of this residual is not known yet: taken as the
                # fixed part, it would make a plain step look dearer than it is (measured:
                # a fresh engine at batch 1, temperature 1 speculated nearly every step at
                # 0.81x the rate of no speculation, judged against a plain rate so priced)
                return
            residual -= self.spec_overhead_s
        # the fixed part takes the residual's average; the knots take what varies with n.
        # A fresh model's first steps move both together by the running mean's share
        # (count / steps taught), until that is below the average's own weight: see the
        # module docstring, "Warm start"
        self._taught += count
        weight = max(weight, count / (1.5 * self._taught))
        if not knots and self.calibrated:  # the fixed part takes the knots' share too
            self._move_fixed_part(min(1.0, 1.5 * weight) * residual)
            return
        self._move_fixed_part(weight * residual)
        self._nudge_knots(num_tokens, 0.5 * weight * residual)

    def _move_fixed_part(self, delta: float) -> None:
        """The fixed part by ``delta`` (at least 0); the residual averages of both kinds
        of steps move with it, so that they stay residuals of the model as it is now:
        the speculative machinery's price is their difference, and residuals learned
        against an older fixed part would put its change into that price (a fresh model
        whose fixed part rose from 0 after its first plain step priced speculative steps
        at 0.0155 s where they took 0.014, the fixed part counted twice)."""
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
        """The forward table's entries again where F moved: around knots ``first - 1``
        .. ``last`` (the pairs :meth:`_nudge_knots` moved), segment by segment (F is
        linear between two knots)."""
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
            # (one slice, not one store per entry: this runs on every speculative step)
            table[lo:end] = [f_lo + slope * d for d in range(end - lo)]
        if last >= len(knots) - 2:  # past the last knot F follows the last two: it moved
            for n in range(knots[-1], len(table)):
                table[n] = self.forward_one(n)


# steps observe holds before it learns them (see there)
LEARN_EVERY = 4
# speculative steps seen before their residual prices the machinery (see the module
# docstring, "First speculative steps"): an engine's very first one may compile a shape
FIRST_SPEC_STEPS = 2


class StepSums:
    """Plain steps' wall times, summed per shape and handed on ``size`` steps at a time as
    one mean (``(key, mean seconds, count)``), for the models that learn from every step.

    Why: a plain step must cost what it costs in an engine without speculation, and one
    model update in Python costs tens of microseconds (measured in an engine at batch 1:
    ~17 us for :meth:`StepCostModel.observe`, ~20 us for the draft's cost model, on a 5
    ms step). Learning the mean of ``size`` steps at once, weighted as ``size`` steps,
    changes what the models learn by nothing but a delay of at most ``size`` steps.
    A step over 20x the last handed-on mean of its shape is an idle gap (no requests,
    a new batch arriving), not a step, and is left out (summed, it would hide in the
    mean from the models' own filters)."""

    def __init__(self, size: int = 8):
        if size < 2:
            raise ValueError(f"StepSums needs size >= 2; got {size}")
        self.size = size
        self.key = None  # the shape being summed (e.g. query tokens per step)
        self.seconds = 0.0
        self.count = 0
        self._last_mean: dict = {}  # key -> the mean last handed on

    def add(self, key, seconds: float) -> tuple | None:
        """One plain step; returns a finished sum (this key's, or the previous key's when
        the shape changed), else None."""
        done = self.flush() if key != self.key else None
        last = self._last_mean.get(key)
        if last is not None and seconds > 20 * last:
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
    """The wall time of one engine step, as a drafter sees it: the time between its
    drafting calls (it holds the drafting the last call decided and the verification of
    those drafts). Both drafters read it through here."""

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

    def restart(self) -> None:
        """A step the drafter did not see just ended (``specplugin profile --step-ab``
        ran it as vLLM's own): the next lap measures the step after it alone."""
        self._last = time.perf_counter()

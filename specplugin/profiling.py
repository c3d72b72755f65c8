"""Where an engine step's time goes: a phase clock and its ledger (vLLM-free).

The timers of ``specplugin profile`` (:mod:`specplugin.vllm_layer.profiling`) report here.

Time is **exclusive**: a phase is charged its time minus its nested phases', so the
phases sum to the step's wall time by construction. The outermost phase, :data:`REST`,
holds what no inner timer claims (vLLM's glue), as a visible column.

Counters (draft forwards, query tokens, host syncs) count only inside a timed step.

The plugin names its phases where they are written: ``@phase("plugin: plan")`` marks a
function or method and returns it unchanged, so a normal engine pays nothing; ``specplugin
profile``'s engines wrap every marked one when the window opens. Only vLLM's own methods
are named in a table (:mod:`specplugin.vllm_layer.profiling`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REST = "rest"  # the step's own time: whatever no inner timer claims
DRAFT_FORWARD = "draft forward"  # the draft model's compute: its forwards and LM heads
PHASE_MARK = "__specplugin_phase__"  # (phase, counter or None) on a marked function

# counters the summary turns into per-step figures
DRAFT_FORWARDS = "draft_forwards"
QUERY_TOKENS = "query_tokens"  # tokens the target ran (prefill, decode and drafts)
DRAFT_TOKENS = "draft_tokens"  # draft tokens the scheduler sent for verification
DRAFTED = "drafted"  # the step handed drafts (maybe empty) to the scheduler: drafting ran
SYNC_PREFIX = "syncs:"  # + phase: .cpu()/.item()/.tolist() calls made inside that phase
BACKGROUND = "background_s"  # seconds the held learning ran in a worker's wait
BACKGROUND_WAIT = "background_wait_s"  # seconds that learning ran on a step instead
TIMER_CALLS = "timer_calls"  # phases closed (to estimate the timers' own cost)
# "1": each worker answers the memory probe before every bench cell
PROBE_ENV = "SPECPLUGIN_MEMORY_PROBE"


def phase(name: str, count: str | None = None) -> Callable:
    """Mark a function as phase ``name`` of a profiled step (``count``: a counter each call
    adds one to, e.g. :data:`DRAFT_FORWARDS`). The function is returned as it is."""

    def mark(func: Callable) -> Callable:
        setattr(func, PHASE_MARK, (name, count))
        return func

    return mark


class PhaseClock:
    """A stack of open phases; each closed phase adds its exclusive time to the step.

    ``sync`` runs before every reading (on CUDA ``torch.cuda.synchronize``; None on CPU).
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.enabled = False  # steps are timed only while enabled (profile's window)
        # open phases, innermost last: [phase, start, seconds of closed nested phases]
        self._stack: list[list[Any]] = []
        # the thread that runs the steps: other threads see no open step (untimed)
        self._owner: int | None = None
        self._phases: dict[str, float] = {}  # this step's exclusive seconds per phase
        self._counts: dict[str, int] = {}
        self._num_exits = 0
        self._is_step = True
        self.ledger = Ledger()

    def begin_step(self, phase: str = REST, step: bool = True) -> None:
        """Open a root phase. ``step=False``: another root of the same engine step."""
        self._phases, self._counts, self._num_exits, self._is_step = {}, {}, 0, step
        self._owner = threading.get_ident()
        self.enter(phase)

    def end_step(self) -> None:
        wall = self.exit()
        self._counts[TIMER_CALLS] = self._num_exits
        self.ledger.add(wall, self._phases, self._counts, step=self._is_step)
        if self._is_step and QUERY_TOKENS in self._counts:  # the engine core's steps
            self.ledger.steps.append((wall, self._counts[QUERY_TOKENS],
                                      self._counts.get(DRAFT_TOKENS, 0),
                                      self._counts.get(DRAFTED, 0)))

    @property
    def stack(self) -> list[list[Any]] | tuple:
        """The open phases (empty for any thread but the one running the steps)."""
        return self._stack if threading.get_ident() == self._owner else ()

    def enter(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        self._stack.append([phase, time.perf_counter(), 0.0])

    def exit(self) -> float:
        """Close the innermost phase; its inclusive seconds."""
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        phase, start, nested = self._stack.pop()
        self._num_exits += 1
        elapsed = now - start
        self._phases[phase] = self._phases.get(phase, 0.0) + elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed
        return elapsed

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter of the step being timed (nothing outside a step)."""
        if self.stack:
            self._counts[name] = self._counts.get(name, 0) + n

    def count_sync(self) -> None:
        """A host-device sync, charged to the innermost open phase."""
        if self.stack:
            key = SYNC_PREFIX + self._stack[-1][0]
            self._counts[key] = self._counts.get(key, 0) + 1

    def take(self) -> Ledger:
        """The ledger so far; the clock starts a new one."""
        ledger, self.ledger = self.ledger, Ledger()
        return ledger


@dataclass
class Ledger:
    """Sums over the timed steps: wall time, exclusive seconds per phase, counters."""

    num_steps: int = 0
    wall_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    # per engine-core step: (wall seconds, query tokens, draft tokens, drafted 0/1)
    steps: list[tuple] = field(default_factory=list)

    def add(self, wall_s: float, phases_s: Mapping[str, float], counts: Mapping[str, int],
            step: bool = True) -> None:
        self.num_steps += int(step)
        self.wall_s += wall_s
        self.add_phases(phases_s, counts)

    def add_phases(self, phases_s: Mapping[str, float], counts: Mapping[str, int]) -> None:
        """Seconds per phase and counters, summed into this ledger's."""
        for name, seconds in phases_s.items():
            self.phases_s[name] = self.phases_s.get(name, 0.0) + seconds
        for name, n in counts.items():
            self.counts[name] = self.counts.get(name, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "wall_s": self.wall_s,
                "phases_s": dict(self.phases_s), "counts": dict(self.counts),
                "steps": [list(s) for s in self.steps]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Ledger:
        return cls(int(d["num_steps"]), float(d["wall_s"]), dict(d["phases_s"]), dict(d["counts"]),
                   [tuple(s) for s in d.get("steps", [])])


WORKER = "worker"  # the engine core waiting on its workers (replaced by theirs in combine)
IPC = "executor (IPC)"  # that wait minus the workers' own timed work


def combine(engine: Ledger, worker: Ledger | None) -> Ledger:
    """One ledger from the engine core's (which times its :data:`WORKER` wait) and a
    worker process's (rank 0's): the wait becomes the worker's phases plus :data:`IPC`,
    the untimed rest, so the sum stays the engine core's step wall time.
    """
    out = Ledger(engine.num_steps, engine.wall_s, dict(engine.phases_s), dict(engine.counts),
                 list(engine.steps))
    wait = out.phases_s.pop(WORKER, 0.0)
    if worker is None:
        out.phases_s[IPC] = wait
        return out
    out.add_phases(worker.phases_s, worker.counts)
    out.phases_s[IPC] = wait - worker.wall_s
    return out


def is_plugin_phase(phase: str) -> bool:
    """Phases of the plugin's own work (draft model's forwards included)."""
    return phase.split(":", 1)[0] in ("plugin", "propose", "draft", "scorer")


def plain_steps_ms(ledger: Ledger, batch_size: int, skipped: bool = False,
                   planned: bool = False) -> list[float]:
    """Wall ms of the steps that decoded the whole batch plainly (``batch_size`` query
    tokens, no draft). ``skipped``: only those where no drafting ran either (bound:
    within 3% of an engine without speculation). ``planned``: only those where drafting
    ran but verified nothing (they cost more, and the overall median hides them)."""
    if skipped and planned:
        raise ValueError("a plain step is either skipped or planned, not both")
    out = []
    for s in ledger.steps:
        drafted = len(s) > 3 and bool(s[3])
        if (s[1] == batch_size and s[2] == 0 and not (skipped and drafted)
                and not (planned and not drafted)):
            out.append(s[0] * 1e3)
    return out


def summarize(ledger: Ledger, num_output_tokens: int, seconds: float,
              batch_size: int | None = None) -> dict[str, Any]:
    """Per-step figures of one method's timed window. ``num_output_tokens`` / ``seconds``:
    the front end's totals. ``phases_ms`` sums to ``step_ms``; ``own_ms``: the plugin's
    work without draft forwards (budget: under 10% of the step)."""
    steps = max(ledger.num_steps, 1)
    step_ms = ledger.wall_s * 1e3 / steps
    phases_ms = {name: s * 1e3 / steps for name, s in ledger.phases_s.items()}
    syncs = {k[len(SYNC_PREFIX):]: n for k, n in ledger.counts.items() if k.startswith(SYNC_PREFIX)}
    plugin_ms = sum(ms for name, ms in phases_ms.items() if is_plugin_phase(name))
    forward_ms = phases_ms.get("draft: forward", 0.0)
    return {
        "num_steps": ledger.num_steps,
        "step_ms": step_ms,
        "tok_s": num_output_tokens / seconds if seconds > 0 else 0.0,
        "emitted_per_step": num_output_tokens / steps,
        "query_tokens_per_step": ledger.counts.get(QUERY_TOKENS, 0) / steps,
        "draft_tokens_per_step": ledger.counts.get(DRAFT_TOKENS, 0) / steps,
        "draft_forwards_per_step": ledger.counts.get(DRAFT_FORWARDS, 0) / steps,
        "plugin_syncs_per_step": sum(n for p, n in syncs.items() if is_plugin_phase(p)) / steps,
        "drafting_syncs_per_step": sum(n for p, n in syncs.items()
                                       if is_plugin_phase(p) or p == "drafting") / steps,
        "syncs_by_phase": {p: n / steps for p, n in sorted(syncs.items())},
        "phases_ms": phases_ms,
        "shares": {name: ms / step_ms for name, ms in phases_ms.items()} if step_ms else {},
        "plugin_ms": plugin_ms,
        "own_ms": plugin_ms - forward_ms,
        "busy_share": ledger.wall_s / seconds if seconds > 0 else 0.0,
        "timer_calls_per_step": ledger.counts.get(TIMER_CALLS, 0) / steps,
        # learning run in the worker's wait, off the step: not in step_ms or own_ms
        "background_ms": ledger.counts.get(BACKGROUND, 0.0) * 1e3 / steps,
        "background_wait_ms": ledger.counts.get(BACKGROUND_WAIT, 0.0) * 1e3 / steps,
        **_plain_summary(ledger, batch_size),
    }


def _plain_summary(ledger: Ledger, batch_size: int | None) -> dict[str, Any]:
    plain = plain_steps_ms(ledger, batch_size) if batch_size else []
    skipped = plain_steps_ms(ledger, batch_size, skipped=True) if batch_size else []
    planned = plain_steps_ms(ledger, batch_size, planned=True) if batch_size else []
    return {"num_plain_steps": len(plain),
            "plain_step_ms": float(statistics.median(plain)) if plain else None,
            "num_skipped_steps": len(skipped),
            "skipped_step_ms": float(statistics.median(skipped)) if skipped else None,
            "num_planned_steps": len(planned),
            "planned_step_ms": float(statistics.median(planned)) if planned else None}

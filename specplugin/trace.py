"""The union's decision trace: one JSON line per step, block and plan, for ``specplugin
profile --trace`` (vLLM-free; off unless the environment asks for it).

Shows why the union chose what it did (e.g. decoded plainly for a hundred steps), which
the profile's averages cannot. With ``SPECPLUGIN_TRACE`` set to a directory, each process
running a union appends to ``<dir>/trace-<pid>.jsonl`` (line-buffered: a killed worker
loses at most one line). Record kinds (``kind``):

- ``step``: a step the union observed (``ms`` None: prompts or the first step);
  ``unrated``: excluded from the step arbiter's rate;
- ``block``: a block the step arbiter closed (``choice`` ``spec``/``plain``, measured
  ``rate`` and ``predicted`` tok/s; ``counted`` False: not measured);
- ``peek``: a plain step's peek as the step arbiter judged it;
- ``draft_plan``: the union's call on the draft model (``forwards`` 0: not run);
- ``first_pass`` / ``decode_pass``: a draft run's passes, timed whole;
- ``plan``: ``sources`` [num_reqs], the proposer each row verifies (None: none);
- ``recheck_empty``: a re-check of speculation ended by a step that planned nothing;
- ``warmup_choice``: whether a bucket's unmeasured plain warm-up blocks run;
- ``forget``: the union forgot what it learned (after bench/profile warm-up).

Call sites test one module attribute, :data:`TRACE` (None when off).
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "SPECPLUGIN_TRACE"


class Trace:
    """One process's trace file in ``directory``; :meth:`write` appends one record."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._file = None  # opened by the first record: processes that write none leave none

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            # line-buffered (see the module docstring)
            self._file = open(self.directory / f"trace-{os.getpid()}.jsonl", "a", buffering=1)
        self._file.write(json.dumps({"kind": kind, **fields}) + "\n")


def _from_environment() -> Trace | None:
    directory = os.environ.get(ENV)
    return Trace(directory) if directory else None


TRACE: Trace | None = _from_environment()


def read(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one engine's trace in ``directory`` (the largest file: with tensor
    parallelism every rank writes the same decisions)."""
    files = sorted(Path(directory).glob("trace-*.jsonl"), key=lambda p: p.stat().st_size)
    if not files:
        return []
    with open(files[-1]) as f:
        return [json.loads(line) for line in f if line.strip()]


def after_last_forget(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records after the last ``forget`` (all of them if there is none)."""
    last = max((i for i, r in enumerate(records) if r["kind"] == "forget"), default=-1)
    return list(records[last + 1:])


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def run_lengths(choices: Sequence[str]) -> str:
    """``["spec", "spec", "plain"]`` -> ``"S2 P1"``: the blocks in the order they ran."""
    out: list[str] = []
    for choice in choices:
        letter = "S" if choice == "spec" else "P"
        if out and out[-1][0] == letter:
            out[-1] = f"{letter}{int(out[-1][1:]) + 1}"
        else:
            out.append(f"{letter}1")
    return " ".join(out)


def _most_common(names: Iterable[str]) -> str | None:
    """The most frequent of ``names``, ties to the alphabetically first (None: none)."""
    counts = Counter(sorted(names))  # (ties keep the order first seen: sorted)
    return counts.most_common(1)[0][0] if counts else None


# Steps in the windows :func:`steps_to_steady` slides over the run.
STEADY_WINDOW = 8


def step_choices(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """[steps] per observed step: the proposer most of its rows verified (ties to the
    earlier name), or ``"plain"``. A step's plan record precedes its step record."""
    choices: list[str] = []
    chosen = "plain"
    for record in records:
        if record["kind"] == "plan":
            chosen = _most_common(name for name in record["sources"] if name is not None)
            chosen = "plain" if chosen is None else chosen
        elif record["kind"] == "step":
            choices.append(chosen if record["speculative"] else "plain")
    return choices


def steps_to_steady(choices: Sequence[str],
                    window: int = STEADY_WINDOW) -> tuple[str | None, int]:
    """(steady choice, steps to reach it). Steady: the most frequent choice of the second
    half; reached at the first step from which every ``window``-step window holds it at
    least half the time (never settling: all steps)."""
    if not choices:
        return None, 0
    steady = _most_common(choices[len(choices) // 2:])
    hits = [c == steady for c in choices]
    reached = len(choices)
    for start in range(len(choices) - window, -1, -1):  # the windows, last first
        if 2 * sum(hits[start:start + window]) < window:
            break
        reached = start
    if len(choices) < window:  # no whole window: steady from the first step that is
        reached = next((i for i, h in enumerate(hits) if h), len(choices))
    return steady, reached


def summarize(records: Sequence[Mapping[str, Any]],
              max_steps: int | None = None) -> dict[str, Any]:
    """One run's summary: median step times by kind, draft runs, blocks in order and
    draft plans. ``max_steps``: only the first that many steps (and records among them)."""
    kept: list[Mapping[str, Any]] = []
    steps = 0
    for record in records:
        if record["kind"] == "step":
            if max_steps is not None and steps >= max_steps:
                break
            steps += 1
        kept.append(record)
    timed = [r for r in kept if r["kind"] == "step" and r["ms"] is not None]
    spec = [r for r in timed if r["speculative"]]
    plain = [r for r in timed if not r["speculative"] and not r["draft_ms"]]
    blocks = [r for r in kept if r["kind"] == "block"]
    plans = [r for r in kept if r["kind"] == "draft_plan"]
    steady, steps_to = steps_to_steady(step_choices(kept))
    return {
        "steps": steps,
        "spec_steps": len(spec),
        "spec_ms": _median(r["ms"] for r in spec),
        "spec_draft_ms": _median(r["draft_ms"] for r in spec),
        "spec_rest_ms": _median(r["ms"] - r["draft_ms"] for r in spec),
        "spec_emitted": (statistics.fmean(r["emitted"] / max(1, r["num_reqs"])
                                          for r in spec) if spec else None),
        # steps in which the draft model ran (its tokens verified or not)
        "draft_run_steps": sum(1 for r in timed if r["draft_ms"]),
        "draft_run_ms": _median(r["draft_ms"] for r in timed if r["draft_ms"]),
        "plain_steps": len(plain),
        "plain_ms": _median(r["ms"] for r in plain),
        "blocks": run_lengths([b["choice"] for b in blocks]),
        "spec_block_rate": _median(b["rate"] for b in blocks
                                   if b["choice"] == "spec" and b["counted"]),
        "plain_block_rate": _median(b["rate"] for b in blocks if b["choice"] == "plain"),
        "draft_plans": len(plans),
        "draft_runs_planned": sum(1 for p in plans if p["forwards"]),
        # what the union settled on, and after how many of the steps (steps_to_steady)
        "steady_choice": steady,
        "steps_to_steady": steps_to,
    }

"""The union's decision trace: one JSON line per step, block and plan, for ``specplugin
profile --trace`` (vLLM-free; off unless the environment asks for it).

Why: the profile's ledger says where a step's time goes on average; it cannot say why
the union decoded plainly for a hundred steps, or what its speculative steps cost next to
its plain ones. A fresh engine's first minutes are decided by a handful of measured blocks
and estimated prices, and the one way to see them is to write them down as they happen.

With ``SPECPLUGIN_TRACE`` set to a directory, each process that runs a union appends to
``<dir>/trace-<pid>.jsonl`` (line-buffered: a worker that is killed at shutdown loses at
most one line). The records (``kind``):

- ``step``: a step the union observed: ``ms`` its wall time (None: it read prompts, or the
  engine's first), ``query_tokens``, ``emitted``, ``speculative`` (it verified drafts),
  ``draft_ms`` (the draft model's run inside it), ``unrated`` (its time is not in the
  step arbiter's rate: one of the draft's optimistic trials, or the draft's catch-up
  right after plain steps);
- ``block``: a block the step arbiter closed: ``choice`` (``spec`` or ``plain``),
  ``num_reqs``, ``sampled``, ``steps``, ``rate`` (tok/s measured), ``predicted`` (mean
  tok/s the union predicted for its steps, None for plain blocks), ``counted`` (False: an
  engine's first speculative blocks, not measured), ``tokens`` and ``ms`` (a counted
  step's, mean), ``predicted_tokens`` and ``predicted_ms`` (a planned step's, mean; None
  for plain blocks);
- ``peek``: a plain step's peek as the step arbiter judged it: ``predicted`` (tok/s),
  ``correction``, ``plain`` (the measured plain rate), ``pays``;
- ``draft_plan``: the union's call on the draft model for a step: ``forwards`` (0: it
  does not run), ``rate`` and ``rate_without`` (predicted tok/s with and without it),
  ``trial``, ``catch_up`` (the run catches up right after plain steps), and the prices in
  ms (``forward_ms``, ``run_ms``, ``overhead_ms``);
- ``first_pass``: a draft run's first pass, timed whole: ``ms``, ``catch_up`` (tokens its
  rows read beyond their newest), ``since`` (engine steps since the draft last ran: 1,
  the step before), ``warm`` (the draft ran in the step before: priced and
  timed as warm);
- ``decode_pass``: one of a draft run's later passes, timed whole: ``ms``, ``cold`` (the
  first one of a cold run, whose excess is priced with the run's first pass, not as a
  forward);
- ``plan``: a speculative step's plan, as the controller chose it: ``sources`` [num_reqs]
  the proposer whose candidate each row verifies (None: none);
- ``recheck_empty``: a re-check of speculation ended at its step that planned nothing
  (:meth:`StepArbiter.nothing_to_verify
  <specplugin.adaptive.arbiter.StepArbiter.nothing_to_verify>`): ``num_reqs``, ``steps``
  (of the block so far);
- ``warmup_choice``: a bucket's warm-up, with its plain blocks not yet measured, decides
  whether they run: ``num_reqs``, ``spec`` (the measured speculative rate), ``plain``
  (the measured plain rate so far, None before its first block), ``modelled`` (the cost
  model's plain rate, which the speculative rate must beat ``MODEL_MARGIN`` times to skip
  them), ``plain_blocks``;
- ``forget``: the union forgot what it learned (``specplugin bench`` and ``profile`` do so
  after their warm-up; what follows is what a fresh engine decides).

Nothing here runs unless ``SPECPLUGIN_TRACE`` is set: the call sites test one module
attribute (:data:`TRACE`, None otherwise).
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
    """The records of one engine's trace in ``directory`` (with tensor parallelism each
    rank writes its own file, every rank deciding alike: the largest is read)."""
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
    """[steps] what the union chose for each step it observed: the proposer whose
    candidates most of the step's drafting rows verified (ties to the earlier name), or
    ``"plain"`` for a step that verified no draft. A step's plan record precedes it (its
    own record is written when its time is learned, at the next step)."""
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
    """(the steady choice, the steps the run took to reach it). The steady choice is the
    most frequent of the run's second half (ties to the earlier name); it is reached at
    the first step from which every window of ``window`` steps holds it at least half of
    the time (a run's last partial window is not judged). A run that never settles took
    all its steps; an empty one has no choice."""
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
    """What a trace says about one run: its steps by kind (median ms; for speculative
    steps also the draft model's run inside them and the rest; plain steps are those
    that neither verified drafts nor ran the draft), the steps in which the draft model
    ran, its blocks in order, and the draft plans. ``records``: one run's (see
    :func:`after_last_forget`); ``max_steps``: only the first that many steps, and the
    blocks and plans among them (a profile's timed cell, before the checks that follow
    it)."""
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

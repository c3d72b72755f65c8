"""Run a list of configurations over rounds, interleaved, with a progress display.

Round r runs every configuration once in an order rotated by r (machine drift lands on
all alike) and seeds its engines with r (so temperature-1 rounds differ in text, not only
timing). One engine per configuration and round runs every cell, unless ``fresh_engine``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specplugin.bench.methods import MethodSpec, Models
from specplugin.bench.runner import (EngineFailure, EngineJob, cells_payload, max_num_seqs,
                                    run_job)
from specplugin.bench.workloads import CellPrompts


@dataclass(frozen=True)
class Entry:
    """One configuration to run: a method with settings, under a label unique in the run."""

    label: str
    spec: MethodSpec
    settings: Mapping[str, Any]


@dataclass
class SuiteResult:
    runs: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)  # (label, cell key)
    startup_s: dict[str, list[float]] = field(default_factory=dict)  # by label
    failures: list[str] = field(default_factory=list)
    failed_labels: set[str] = field(default_factory=set)
    warnings: set[str] = field(default_factory=set)
    # by cell key (runner.max_num_seqs)
    max_num_seqs: dict[str, int] = field(default_factory=dict)

    def cell_runs(self, label: str, key: str) -> list[dict[str, Any]]:
        return self.runs.get((label, key), [])


def rotated(entries: Sequence[Entry], round_index: int) -> list[Entry]:
    shift = round_index % max(1, len(entries))
    return list(entries[shift:]) + list(entries[:shift])


def run_suite(entries: Sequence[Entry], models: Models, cells: Sequence[CellPrompts],
              rounds: int, workdir: Path, console=None, eager: bool = False,
              fresh_engine: bool = False, dtype: str | None = None) -> SuiteResult:
    """Every entry runs every cell once per round, one engine at a time."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    result = SuiteResult()
    payload = cells_payload(cells)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("cells"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=rounds * len(entries) * len(cells))
        for r in range(rounds):
            # fresh engines: per cell, every entry in turn (rotated), cell after cell
            groups = [[c] for c in payload] if fresh_engine else [payload]
            for group in groups:
                result.max_num_seqs.update({c["key"]: max_num_seqs(group) for c in group})
                for entry in rotated(entries, r):
                    if entry.label in result.failed_labels:  # failures so far were not flukes
                        progress.update(task, advance=len(group))
                        continue
                    name = f"r{r + 1}-{entry.label}" + (f"-{group[0]['key']}" if fresh_engine
                                                        else "")
                    where = f"round {r + 1}/{rounds} · {entry.label}"
                    progress.update(task, description=f"{where} · starting engine")
                    job = EngineJob(label=name, model=models.target,
                                    engine_kwargs=_engine_kwargs(entry, models, group, r, dtype),
                                    cells=tuple(group), eager=eager)
                    _run_entry(entry, job, workdir, result,
                               lambda e: _on_event(progress, task, where, e))
    return result


def _engine_kwargs(entry: Entry, models: Models, group: Sequence[Mapping[str, Any]],
                   round_index: int, dtype: str | None) -> dict[str, Any]:
    """One engine's vLLM arguments: the round's seed, ``max_num_seqs``, dtype, the method's."""
    return {"seed": round_index, "max_num_seqs": max_num_seqs(group),
            **({"dtype": dtype} if dtype else {}),
            **entry.spec.engine_kwargs(models, entry.settings)}


def _on_event(progress, task, where: str, event: Mapping[str, Any]) -> None:
    if event["event"] == "ready":
        progress.update(task, description=f"{where} · engine up in {event['startup_s']:.0f} s")
    elif event["event"] == "cell":
        progress.update(task, advance=1, description=f"{where} · {event['key']} done")


def _run_entry(entry: Entry, job: EngineJob, workdir: Path, result: SuiteResult,
               on_event) -> None:
    try:
        job_result = run_job(job, workdir, on_event)
    except EngineFailure as failure:
        result.failures.append(str(failure))
        result.failed_labels.add(entry.label)
        return
    result.startup_s.setdefault(entry.label, []).append(job_result.startup_s)
    result.warnings.update(job_result.warnings)
    for key, cell in job_result.cells.items():
        result.runs.setdefault((entry.label, key), []).append(cell)

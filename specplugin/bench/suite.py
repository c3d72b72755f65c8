"""Run a list of configurations over rounds, interleaved, with a progress display.

Round r runs every configuration once, in an order rotated by r, so slow drift of
a shared machine (another job starting, thermal throttling) lands on all
configurations alike instead of on whichever ran last.

By default one engine per configuration and round runs every cell, one after another:
the cells after the first find what the earlier ones taught the plugin (its estimates,
its suffix store). ``fresh_engine`` starts an engine for every cell instead, as a
user's offline job starts one: each cell then measures the plugin from its first step.

Round r seeds its engines with r (vLLM's ``seed``, which its sampler and the plugin's
draws follow): with one seed for every round, each round of a temperature-1 cell replayed
the same random draws and so the same text (measured: the same acceptance counts to the
token), so the rounds averaged the machine's timing noise but not the text's, which at
temperature 1 moves a cell's tokens per step more. On the validation pair, complete batch
1 temperature 1, vLLM's ``draft_model`` at K = 2 emitted 2.17-2.32 tokens a step over
five prompt seeds, the plugin's draft 2.19-2.27: a 0.1-0.2 gap seen
between the two, one seed each, is within that spread.
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
    # by cell key: vLLM's max_num_seqs of the engines that ran it (runner.max_num_seqs)
    max_num_seqs: dict[str, int] = field(default_factory=dict)

    def cell_runs(self, label: str, key: str) -> list[dict[str, Any]]:
        return self.runs.get((label, key), [])


def rotated(entries: Sequence[Entry], round_index: int) -> list[Entry]:
    shift = round_index % max(1, len(entries))
    return list(entries[shift:]) + list(entries[:shift])


def run_suite(entries: Sequence[Entry], models: Models, cells: Sequence[CellPrompts],
              rounds: int, workdir: Path, console=None, eager: bool = False,
              fresh_engine: bool = False, dtype: str | None = None) -> SuiteResult:
    """Every entry runs every cell once per round, one engine at a time (``eager``: see
    ``runner.engine_kwargs``; ``fresh_engine``: an engine per cell, see the module doc;
    ``dtype``: vLLM's, default the runner's). Each engine's ``max_num_seqs`` is the
    largest batch size among its cells (``runner.max_num_seqs``): with ``fresh_engine``
    the cell's own."""
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
    """One engine's vLLM arguments over the runner's defaults: the round's seed, the
    largest batch of its cells as ``max_num_seqs``, the dtype, then the method's own."""
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

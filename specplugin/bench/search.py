"""``specplugin bench --search-builtins``: how ``BUILTIN_SETTINGS`` was chosen, rerunnable.

Each built-in among ``--methods`` runs every point of its ``search_space`` on
``SEARCH_CELLS`` (``adversarial`` left out: it would only reward the smallest K). A
setting's score is the geometric mean of its tok/s over those cells, so no single cell
dominates; the best per built-in is printed as a dict to paste into ``BUILTIN_SETTINGS``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specplugin.bench.methods import BUILTIN, MethodSpec, Models
from specplugin.bench.suite import Entry, SuiteResult, run_suite
from specplugin.bench.workloads import Cell, CellPrompts

EXCLUDED_WORKLOADS = ("adversarial",)
SEARCH_CELLS = (Cell("edit", 1, 0.0), Cell("complete", 1, 1.0), Cell("mixed", 8, 0.0),
                Cell("mixed", 8, 1.0))


def search_cells(cells: Sequence[CellPrompts], quick: bool) -> list[CellPrompts]:
    """The run's cells among ``SEARCH_CELLS`` (all but adversarial with ``quick``, or when
    none match, as for an instruct pair)."""
    kept = [cp for cp in cells if cp.cell.workload not in EXCLUDED_WORKLOADS]
    return kept if quick else [cp for cp in kept if cp.cell in SEARCH_CELLS] or kept


def search_entries(specs: Sequence[MethodSpec]) -> list[Entry]:
    """One entry per grid point of every built-in in ``specs``."""
    return [Entry(f"{spec.name} {_short(settings)}", spec, settings)
            for spec in specs if spec.family == BUILTIN for settings in spec.search_grid()]


def _short(settings: Mapping[str, Any]) -> str:
    names = {"num_speculative_tokens": "K", "prompt_lookup_min": "min",
             "prompt_lookup_max": "max", "draft_sample_method": "draft"}
    return ",".join(f"{names.get(k, k)}={v}" for k, v in settings.items())


def median_tok_s(runs: Sequence[Mapping[str, Any]]) -> float:
    return statistics.median(r["num_output_tokens"] / r["seconds"] for r in runs)


def score(result: SuiteResult, label: str, cells: Sequence[CellPrompts]) -> float | None:
    """Geometric mean over cells of the median tok/s; None if a cell is missing."""
    runs = [result.cell_runs(label, cp.cell.key) for cp in cells]
    if not all(runs):
        return None
    return math.exp(sum(math.log(median_tok_s(r)) for r in runs) / len(runs))


def best_settings(entries: Sequence[Entry], scores: Mapping[str, float | None]) -> dict[str, dict]:
    best: dict[str, tuple[float, dict]] = {}
    for entry in entries:
        s = scores[entry.label]
        if s is not None and s > best.get(entry.spec.name, (-1.0, {}))[0]:
            best[entry.spec.name] = (s, dict(entry.settings))
    return {name: settings for name, (_, settings) in best.items()}


def search(specs: Sequence[MethodSpec], models: Models, cells: Sequence[CellPrompts],
           rounds: int, out_dir: Path, args, console) -> int:
    from specplugin.bench.report import stdout_console

    cells = search_cells(cells, args.quick)
    entries = search_entries(specs)
    if not entries or not cells:
        console.print("[red]--search-builtins needs a built-in in --methods and a workload "
                      "other than adversarial[/red]")
        return 2
    result = run_suite(entries, models, cells, rounds, out_dir / "search-logs", console,
                       eager=args.eager, dtype=args.dtype)
    scores = {e.label: score(result, e.label, cells) for e in entries}
    _print_scores(entries, cells, result, scores, stdout_console())
    best = best_settings(entries, scores)
    print("BUILTIN_SETTINGS = " + json.dumps(best, indent=4))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"best": best, "scores": scores, "cells": [cp.cell.key for cp in cells]}, indent=2))
    for failure in result.failures:
        console.print(f"[red]FAILED {failure}[/red]")
    return 1 if result.failures else 0


def _print_scores(entries, cells, result: SuiteResult, scores, console) -> None:
    from rich.table import Table

    table = Table(title="built-in settings search: median tok/s per cell, geometric mean")
    table.add_column("method and settings")
    for cp in cells:
        table.add_column(cp.cell.key, justify="right")
    table.add_column("score", justify="right")
    for entry in entries:
        cols = []
        for cp in cells:
            runs = result.cell_runs(entry.label, cp.cell.key)
            cols.append(f"{median_tok_s(runs):.1f}" if runs else "-")
        s = scores[entry.label]
        table.add_row(entry.label, *cols, "-" if s is None else f"{s:.1f}")
    console.print(table)

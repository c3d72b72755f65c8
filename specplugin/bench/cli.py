"""``specplugin bench``: vLLM without speculation, its built-ins and the plugin, side by side.

    specplugin bench                      # every method, every cell, 3 rounds, vLLM compiled
    specplugin bench --quick --eager      # CI smoke test (< 5 min): 1 round, 3 cells

The pair decides workloads, default cells and dtype (``families.py``). Exit status 0
when every engine ran, 1 when any failed (the rest is still reported).
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT_DIR = "bench-out"  # ignored by .gitignore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options only: importing this module must stay cheap (no vLLM, no torch)."""
    from specplugin.bench.families import add_dtype_argument, workloads_help
    from specplugin.bench.methods import METHODS, listed_names
    from specplugin.bench.runner import add_eager_argument
    from specplugin.cli import int_option
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of: {', '.join(METHODS)} "
                             f"(default: {', '.join(listed_names())}; those needing a draft "
                             "model are left out for a pair without one)")
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated workloads, all cells of each ({workloads_help()}; "
                             "default: every cell of the token windows, the instruct headline)")
    parser.add_argument("--rounds", type=int_option("--rounds", 1), default=None,
                        help="rounds over all methods; tok/s is the median (default 3, --quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 round, 3 cells, short outputs (< 5 min with --eager)")
    parser.add_argument("--headline", action="store_true",
                        help="the pair's headline cells (docs/benchmarks.md), full sizes")
    parser.add_argument("--cells", metavar="KEYS",
                        help="comma-separated cell keys (workload/bN/tT, e.g. complete/b1/t1) "
                             "to keep of those chosen: one cell measured over more rounds")
    parser.add_argument("--fresh-engine", action="store_true",
                        help="start an engine for every cell (as a user's offline job starts "
                             "one) instead of one per method and round running every cell")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--markdown", metavar="PATH",
                        help="write the results as a Markdown table headed by this command")
    parser.add_argument("--plot", metavar="PATH",
                        help=f"throughput PNG (default {DEFAULT_OUT_DIR}/throughput.png)")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                        help="folder for the plot and the engines' logs")
    parser.add_argument("--search-builtins", action="store_true",
                        help="sweep K (and n-gram lookup sizes, draft sampling) of the built-ins "
                             "among --methods and print the best settings")
    add_eager_argument(parser)
    add_dtype_argument(parser)


def csv_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def zoo_models(zoo: str | None):
    """The target and draft folders of ``zoo`` (default: the committed pair)."""
    from specplugin.bench.methods import Models
    from specplugin.zoo import pair_root, zoo_path

    root = pair_root(zoo)
    draft = root / "draft"
    return root, Models(target=str(zoo_path("target", root)),
                        draft=str(draft) if (draft / "config.json").exists() else None)


def build_cells(zoo_root: Path, workloads: list[str], quick: bool, headline: bool = False,
                keys: list[str] | None = None):
    """The run's cells with their prompts, the same for every method. ``workloads``: all
    their cells (empty: the pair's defaults); ``keys``: keep only these cells."""
    from specplugin.bench.families import family_for
    from specplugin.bench.workloads import grid

    family = family_for(zoo_root)
    family.check_workloads(workloads)
    if quick and headline:
        raise ValueError("--quick and --headline choose different cells; give one of them.")
    if quick or headline or (not workloads and family.default_is_headline):
        chosen = family.quick if quick else family.headline
        cells = [c for c in chosen if not workloads or c.workload in workloads]
    else:
        cells = grid(family.workloads, workloads)
    if keys:
        available = [c.key for c in cells]
        unknown = [k for k in keys if k not in available]
        if unknown:
            raise ValueError(f"--cells: no cell {', '.join(unknown)} among the chosen ones "
                             f"({', '.join(available)}); pick keys from these, or choose "
                             "other cells with --headline, --quick or --workloads.")
        cells = [c for c in cells if c.key in keys]
    sizes = family.quick_sizes if quick else family.sizes
    source = family.load_source(zoo_root)
    return [family.build(source, sizes, c, 0) for c in cells], sizes


def method_names(methods: str | None, models, console, default: str | None = None) -> list[str]:
    """``--methods`` as given, else those of ``default`` (None: the listed methods) the
    pair can run; methods needing a missing draft model are left out, with a note."""
    from specplugin.bench.methods import listed_names, runnable

    if methods:
        return csv_list(methods)
    names, dropped = runnable(csv_list(default) if default else listed_names(), models)
    if dropped:
        console.print(f"no draft model beside {models.target}: leaving out "
                      f"{', '.join(dropped)}")
    return names


def length_note(cells) -> str:
    """How long the cells' requests are, for a title: one fixed length, or EOS and caps."""
    if all(cp.ignore_eos for cp in cells) and len({cp.max_tokens for cp in cells}) == 1:
        return f"{cells[0].max_tokens} tokens per request"
    caps = dict.fromkeys(f"{cp.cell.workload} {cp.max_tokens}" for cp in cells)
    return f"stop at EOS, max_tokens {', '.join(caps)}"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specplugin.bench.families import family_for
    from specplugin.bench.methods import resolve

    console = Console(stderr=True)  # progress and messages; the table goes to stdout
    try:
        zoo_root, models = zoo_models(args.zoo)
        specs = resolve(method_names(args.methods, models, console))
        args.dtype = args.dtype or family_for(zoo_root).dtype
        cells, sizes = build_cells(zoo_root, csv_list(args.workloads or ""), args.quick,
                                   args.headline, csv_list(args.cells or ""))
        for spec in specs:
            spec.engine_kwargs(models)  # fails now, not after an hour, if a draft is missing
    except (ValueError, FileNotFoundError) as err:
        console.print(f"[red]specplugin bench: {err}[/red]")
        return 2
    rounds = args.rounds or (1 if args.quick else 3)
    out_dir = Path(args.out_dir)
    if args.search_builtins:
        from specplugin.bench.search import search

        return search(specs, models, cells, rounds, out_dir, args, console)
    return _bench(specs, models, cells, sizes, rounds, out_dir, args, console)


def _bench(specs, models, cells, sizes, rounds, out_dir, args, console) -> int:
    from specplugin.bench import report
    from specplugin.bench.suite import Entry, run_suite

    entries = [Entry(s.name, s, s.settings) for s in specs]
    result = run_suite(entries, models, cells, rounds, out_dir / "logs", console,
                       eager=args.eager, fresh_engine=args.fresh_engine, dtype=args.dtype)
    rows = report.with_speedups([
        report.make_row(e.label, cp.cell, result.cell_runs(e.label, cp.cell.key), e.settings)
        for cp in cells for e in entries if result.cell_runs(e.label, cp.cell.key)
    ])
    report.print_table(rows, title=f"specplugin bench ({rounds} round(s), "
                                   f"{length_note(cells)}, "
                                   f"{'eager' if args.eager else 'compiled'}, {args.dtype}, "
                                   f"{'fresh engine per cell' if args.fresh_engine else 'one engine per method and round'})")
    report.print_endings(rows, [cp.cell.key for cp in cells if not cp.ignore_eos])
    report.print_attribution(rows)
    plot_path = report.plot(rows, Path(args.plot or out_dir / "throughput.png")) if rows else None
    meta = _meta(models, cells, sizes, rounds, args, result, entries)
    if args.json:
        report.write_json(rows, meta, Path(args.json))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(report.markdown(rows, meta))
    console.print(f"plot: {plot_path}  logs: {out_dir / 'logs'}"
                  + (f"  json: {args.json}" if args.json else ""))
    for warning in sorted(result.warnings):
        console.print(f"[yellow]WARNING: {warning}; temperature > 0 cells of speculative "
                      "methods are not trustworthy[/yellow]")
    for failure in result.failures:
        console.print(f"[red]FAILED {failure}[/red]")
    return 1 if result.failures or not rows else 0


def _meta(models, cells, sizes, rounds, args, result, entries) -> dict:
    from dataclasses import asdict

    from specplugin.bench.runner import engine_kwargs, run_environment

    return {
        **run_environment(),
        "models": asdict(models), "rounds": rounds, "quick": args.quick, "eager": args.eager,
        "fresh_engine": args.fresh_engine, "dtype": args.dtype,
        "engine_defaults": engine_kwargs({"dtype": args.dtype}, args.eager),
        # by cell key (runner.max_num_seqs)
        "max_num_seqs": result.max_num_seqs,
        "sizes": asdict(sizes), "cells": [cp.cell.key for cp in cells],
        "cell_sizes": {cp.cell.key: {"num_requests": len(cp.prompts),
                                     "max_tokens": cp.max_tokens, "ignore_eos": cp.ignore_eos}
                       for cp in cells},
        "settings": {e.label: dict(e.settings) for e in entries},
        "startup_s": result.startup_s, "failures": result.failures,
        "warnings": sorted(result.warnings),
    }

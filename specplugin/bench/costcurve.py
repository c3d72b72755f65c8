"""``specplugin cost-curve``: the target's forward time against query tokens per row.

Verifying K drafts per row runs the target over ``rows x (1 + K)`` query tokens; on CPU
each extra token costs compute, which accepted tokens must outweigh. One engine times
forwards of every shape (``PluginRunnerMixin.time_forward``, fastest of ``--repeats``)
and prints a table, a PNG and optionally JSON. Exit status 0 on success, 1 on failure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROWS = (1, 8)
DEFAULT_QUERY_LENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_CONTEXT_LEN = 256
DEFAULT_REPEATS = 5
DEFAULT_OUT_DIR = "bench-out/cost-curve"  # ignored by .gitignore
# plugin on only for its worker (which times forwards); no request runs, so K doesn't matter
PLUGIN_OPTIONS = {"proposers": ["ngram"]}
NUM_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class Point:
    """One timed shape."""

    rows: int
    query_len: int  # query tokens per row (1 + drafts verified per row)
    seconds: float  # the fastest forward

    @property
    def num_tokens(self) -> int:
        return self.rows * self.query_len

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def ms_per_extra_token(point: Point, points: Sequence[Point]) -> float | None:
    """``(ms(q) - ms(1)) / (rows * (q - 1))``; None at ``q == 1`` or without the q=1 point."""
    base = next((p for p in points if p.rows == point.rows and p.query_len == 1), None)
    if base is None or point.query_len == 1:
        return None
    return (point.ms - base.ms) / (point.rows * (point.query_len - 1))


def shape_key(rows: int, query_len: int) -> str:
    return f"r{rows}-q{query_len}"


def shape_cells(rows: Sequence[int], query_lens: Sequence[int], context_len: int,
                repeats: int) -> tuple[dict[str, Any], ...]:
    """The child's cells (``engine.run_forward_times``): every rows x query length."""
    return tuple({"key": shape_key(r, q), "rows": r, "query_len": q, "context_len": context_len,
                  "repeats": repeats} for r in rows for q in query_lens)


def points_from(cells: Mapping[str, Mapping[str, Any]], rows: Sequence[int],
                query_lens: Sequence[int]) -> list[Point]:
    """The shapes the child reported, in table order (rows, then query length)."""
    return [Point(r, q, cells[shape_key(r, q)]["seconds"])
            for r in rows for q in query_lens if shape_key(r, q) in cells]


# ---------------------------------------------------------------- report


def point_records(points: Sequence[Point]) -> list[dict[str, Any]]:
    """The table's rows as plain JSON."""
    return [{**asdict(p), "num_tokens": p.num_tokens, "ms": p.ms,
             "ms_per_extra_token": ms_per_extra_token(p, points)} for p in points]


def print_table(points: Sequence[Point], title: str, console=None) -> None:
    from rich.table import Table

    from specplugin.bench.report import stdout_console

    console = console or stdout_console()
    table = Table(title=title)
    for name in ("rows", "query tokens/row", "total tokens", "ms", "ms/extra token"):
        table.add_column(name, justify="right", no_wrap=True)
    previous = None
    for p in points:
        if previous is not None and p.rows != previous:
            table.add_section()
        previous = p.rows
        extra = ms_per_extra_token(p, points)
        table.add_row(str(p.rows), str(p.query_len), str(p.num_tokens), f"{p.ms:.2f}",
                      "-" if extra is None else f"{extra:.3f}")
    console.print(table)
    console.print("ms/extra token: (ms - ms at 1 query token/row) / "
                  "(rows x (query tokens/row - 1))")


def plot(points: Sequence[Point], title: str, path: Path) -> Path:
    """x = query tokens per row, y = ms per forward, one line per row count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rows in sorted({p.rows for p in points}):
        line = sorted((p for p in points if p.rows == rows), key=lambda p: p.query_len)
        ax.plot([p.query_len for p in line], [p.ms for p in line], marker="o",
                label=f"{rows} row{'s' if rows > 1 else ''}")
    ax.set_xlabel("query tokens per row (1 + drafts verified)")
    ax.set_ylabel("target forward, ms (fastest of repeats)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(points: Sequence[Point], meta: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": dict(meta), "points": point_records(points)}, indent=2)
                    + "\n")
    return path


def title_of(meta: Mapping[str, Any]) -> str:
    return (f"zoo target forward time, context {meta['context_len']} tokens\n"
            f"{meta['machine']['processor']}, {meta['machine']['cpu_count']} cores, "
            f"vLLM {'eager' if meta['eager'] else 'compiled'}")


# ---------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options only: importing this module must stay cheap (no vLLM, no torch)."""
    from specplugin.bench.runner import add_eager_argument
    from specplugin.cli import int_list_option, int_option
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--rows", type=int_list_option("--rows", 1), default=list(DEFAULT_ROWS),
                        help="comma-separated row (request) counts (default "
                             f"{','.join(map(str, DEFAULT_ROWS))})")
    parser.add_argument("--query-lens", type=int_list_option("--query-lens", 1),
                        default=list(DEFAULT_QUERY_LENS),
                        help="comma-separated query tokens per row (default "
                             f"{','.join(map(str, DEFAULT_QUERY_LENS))}); include 1 for the "
                             "ms/extra token column")
    parser.add_argument("--context-len", type=int_option("--context-len", 0),
                        default=DEFAULT_CONTEXT_LEN,
                        help=f"tokens each row attends over before its query tokens "
                             f"(default {DEFAULT_CONTEXT_LEN})")
    parser.add_argument("--repeats", type=int_option("--repeats", 1), default=DEFAULT_REPEATS,
                        help=f"timed runs per shape after one discarded; the fastest is kept "
                             f"(default {DEFAULT_REPEATS})")
    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--json", metavar="PATH", help="write the points as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help=f"PNG of the curve (default {DEFAULT_OUT_DIR}/cost-curve.png)")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                        help="folder for the plot and the engine's log")
    add_eager_argument(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specplugin.bench.runner import EngineFailure, EngineJob, plugin_engine_kwargs, run_job
    from specplugin.zoo import pair_root, zoo_path

    console = Console(stderr=True)  # progress and messages; the table goes to stdout
    try:
        target = zoo_path("target", pair_root(args.zoo))
    except (ValueError, FileNotFoundError) as err:
        console.print(f"[red]specplugin cost-curve: {err}[/red]")
        return 2
    out_dir = Path(args.out_dir)
    job = EngineJob(label="cost-curve", model=str(target), kind="forward_times",
                    engine_kwargs=plugin_engine_kwargs(NUM_SPECULATIVE_TOKENS, PLUGIN_OPTIONS),
                    cells=shape_cells(args.rows, args.query_lens, args.context_len, args.repeats),
                    eager=args.eager)
    console.print(f"specplugin cost-curve: {len(job.cells)} shapes, context {args.context_len}, "
                  f"{args.repeats} repeats, vLLM {'eager' if args.eager else 'compiled'}, "
                  f"target {target}; log {out_dir / 'cost-curve.log'}")

    def progress(event: dict[str, Any]) -> None:
        if event["event"] == "ready":
            console.print(f"engine ready in {event['startup_s']:.0f} s")
        elif event["event"] == "cell":
            console.print(f"  {event['key']}: {event['seconds'] * 1e3:.2f} ms")

    try:
        result = run_job(job, out_dir, on_event=progress)
    except EngineFailure as failure:
        console.print(f"specplugin cost-curve: {failure}", markup=False, style="red")
        return 1
    points = points_from(result.cells, args.rows, args.query_lens)
    meta = _meta(args, job, result.startup_s)
    title = title_of(meta)
    print_table(points, title=title.replace("\n", "; "))
    plot_path = plot(points, title, Path(args.plot or out_dir / "cost-curve.png"))
    if args.json:
        write_json(points, meta, Path(args.json))
    console.print(f"plot: {plot_path}" + (f"  json: {args.json}" if args.json else ""))
    return 0


def _meta(args: argparse.Namespace, job, startup_s: float) -> dict[str, Any]:
    from specplugin.bench.runner import engine_kwargs, run_environment

    return {
        **run_environment(),
        "model": job.model, "eager": args.eager, "context_len": args.context_len,
        "repeats": args.repeats, "rows": args.rows, "query_lens": args.query_lens,
        "engine_kwargs": engine_kwargs(job.engine_kwargs, job.eager),
        "startup_s": startup_s,
    }

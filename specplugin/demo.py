"""``specplugin demo``: offline batch inference through stock ``vllm.LLM``, with and without the plugin.

The prompts come from stdlib files the zoo's models never saw in training. Each is a
window of a file that ends on a ``def``/``class`` signature line, so what the model
writes next is code (the body); half quote that window and then restart it (an edit,
where n-gram drafting copies long spans), half are the window alone (a continuation).

Each configuration runs in its own engine through the project's one runner
(``specplugin.bench.runner``, the benchmark's: same defaults, warm-up and timing); the
batch sizes run one after the other in that engine (its proposer learns nothing across
requests). The table shows output tokens/s, the speedup over plain decoding and vLLM's
own acceptance counters; then one output is printed: the one with the most distinct
tokens, a rule that skips the loops a small model falls into without looking at files.
vLLM's own logging goes to log files unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

COPY_SEPARATOR = "\n\n# ----- the same code, copied -----\n"
RESTART_CHARS = 80  # at most, of the quoted window's first lines, repeated after the separator
# a def/class signature that ends on its own line (multi-line signatures do not match)
SIGNATURE = re.compile(r"(?m)^[ \t]*(?:async def|def|class) [^\n]*:[ \t]*$")


@dataclass(frozen=True)
class DemoPrompt:
    kind: str  # "edit" or "continuation"
    file: str  # relative to the stdlib root
    text: str


def signature_window(text: str, max_chars: int) -> str | None:
    """The ``max_chars`` (at most, whole lines) that end with the first signature line
    past the file's first third; None if there is none or too little text before it.

    The window ends without the signature's newline: the zoo's tokenizer writes a newline
    and the next line's indentation as one token, so a prompt ending in a bare newline
    tells the model the next line starts at column 0 and it starts a new top-level def."""
    match = SIGNATURE.search(text, len(text) // 3)
    if match is None or match.end() < max_chars:
        return None
    window = text[match.end() - max_chars : match.end()]
    return window[window.find("\n") + 1 :].rstrip()


def restart_of(window: str) -> str:
    """The window's first whole lines within ``RESTART_CHARS`` (at least one), without the
    newline after them: an edit restarts its copy on a token boundary, not mid-word."""
    lines = window.split("\n")
    head = lines[0]
    for line in lines[1:]:
        if len(head) + 1 + len(line) > RESTART_CHARS:
            break
        head += "\n" + line
    return head


def demo_prompts(zoo_root: Path | None, num_prompts: int, max_chars: int = 900) -> list[DemoPrompt]:
    """Up to ``num_prompts`` prompts, one per held-out file in the zoo's order, edits and
    continuations alternating."""
    from specplugin.zoo import heldout_files

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[DemoPrompt] = []
    for rel in heldout_files(zoo_root):
        path = stdlib / rel
        window = signature_window(path.read_text(encoding="utf-8", errors="replace"),
                                  max_chars) if path.is_file() else None
        if window is None:
            continue
        if len(prompts) % 2 == 0:
            prompts.append(DemoPrompt("edit", rel, window + COPY_SEPARATOR + restart_of(window)))
        else:
            prompts.append(DemoPrompt("continuation", rel, window))
        if len(prompts) == num_prompts:
            break
    return prompts


def _int_option(name: str, lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]``, or an error naming ``name``."""
    bounds = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer {bounds}; "
                                             f"got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{name} must be an integer {bounds}; got {value}")
        return value

    return parse


def batch_sizes(text: str) -> list[int]:
    """--batch-sizes: comma-separated positive integers, e.g. ``1,8``."""
    one = _int_option("every --batch-sizes entry", 1)
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"--batch-sizes must be comma-separated integers of at least 1, e.g. 1,8; got {text!r}")
    return [one(p) for p in parts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specplugin.bench.runner import add_eager_argument
    from specplugin.config import MAX_NUM_SPECULATIVE_TOKENS
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--num-prompts", type=_int_option("--num-prompts", 1), default=8,
                        help="held-out prompts, one per file (default 8)")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 8],
                        help="comma-separated (default 1,8); batch 1 runs the prompts one "
                             "after the other")
    parser.add_argument("--max-tokens", type=_int_option("--max-tokens", 1), default=128,
                        help="greedy tokens per prompt, all generated (default 128)")
    parser.add_argument("-k", "--num-speculative-tokens", default=8,
                        type=_int_option("--num-speculative-tokens", 1, MAX_NUM_SPECULATIVE_TOKENS),
                        help="vLLM's num_speculative_tokens for the plugin (default 8)")
    parser.add_argument("--out-dir", default="bench-out/demo", help="folder for vLLM's logs")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's own logging instead of writing it to --out-dir")
    add_eager_argument(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specplugin.bench.runner import EngineFailure, plugin_engine_kwargs
    from specplugin.zoo import pair_root, zoo_path

    console = Console()
    root = pair_root(args.zoo)
    target = zoo_path("target", root)
    prompts = demo_prompts(root, args.num_prompts)
    if len(prompts) < args.num_prompts:
        console.print(f"[red]specplugin demo: --num-prompts must be at most {len(prompts)}: "
                      f"only {len(prompts)} held-out files have a def/class line to end a "
                      f"prompt on; got {args.num_prompts}.[/red]")
        return 2
    # the README's recommended configuration: every proposer, K chosen per request and step
    union = {"proposers": ["draft", "ngram", "suffix"], "draft_model": str(zoo_path("draft", root))}
    configs = {
        "no speculation": {},
        f"specplugin draft+ngram+suffix (K<={args.num_speculative_tokens})":
            plugin_engine_kwargs(args.num_speculative_tokens, union),
    }
    mode = "eager" if args.eager else "compiled"
    console.print(f"[bold]specplugin demo[/]: {len(prompts)} held-out prompts, {args.max_tokens} "
                  f"greedy tokens each, batch sizes {args.batch_sizes}, vLLM {mode}, "
                  f"target {target}")
    try:
        runs = {name: _run_config(name, target, kwargs, prompts, args, console)
                for name, kwargs in configs.items()}
    except EngineFailure as failure:
        console.print(f"specplugin demo: {failure}", markup=False, style="red")
        return 1
    all_same = _print_table(runs, args.batch_sizes, mode, console)
    _print_sample(prompts, runs[list(configs)[1]][args.batch_sizes[0]], console)
    if not args.verbose:
        console.print(f"vLLM's logs: {args.out_dir}/")
    return 0 if all_same else 1


def _run_config(name: str, target: Path, kwargs: dict, prompts: list[DemoPrompt],
                args: argparse.Namespace, console) -> dict:
    """One engine, one cell per batch size: {batch_size: EngineRun}."""
    from specplugin.bench.runner import EngineJob, EngineRun, prompt_cell, run_job

    texts = [p.text for p in prompts]
    cells = tuple(prompt_cell(texts, args.max_tokens, 0.0, b, key=f"b{b}")
                  for b in args.batch_sizes)
    job = EngineJob(label=f"demo-{name}", model=str(target), engine_kwargs=kwargs, cells=cells,
                    eager=args.eager, return_token_ids=True, return_texts=True)
    with console.status(f"running vLLM: {name}, batch sizes {args.batch_sizes} ..."):
        result = run_job(job, Path(args.out_dir), verbose=args.verbose)
    return {b: EngineRun.from_job(result, f"b{b}") for b in args.batch_sizes}


def _print_table(runs: dict, sizes: list[int], mode: str, console) -> bool:
    """The README's table; True when every configuration made the same tokens as plain decoding."""
    from rich.table import Table

    table = Table(title=f"offline batch inference, vllm.LLM, {mode} "
                        "(each configuration: its own engine)")
    for col in ("configuration", "batch", "output tok/s", "speedup", "mean acceptance length",
                "same tokens as no speculation"):
        table.add_column(col)
    all_same = True
    for batch in sizes:
        base = runs["no speculation"][batch]
        for name, by_batch in runs.items():
            r = by_batch[batch]
            same = r.token_ids == base.token_ids
            all_same &= same
            table.add_row(name, str(batch), f"{r.tok_s:.1f}", f"{r.tok_s / base.tok_s:.2f}x",
                          f"{r.mean_acceptance_length:.2f}" if r.num_drafts else "-",
                          "yes" if same else "[red]NO[/]")
    console.print(table)
    return all_same


def _print_sample(prompts: list[DemoPrompt], run, console, num_tail_lines: int = 4) -> None:
    """The output with the most distinct tokens, under the last lines of its prompt."""
    i = max(range(len(prompts)), key=lambda j: len(set(run.token_ids[j])))
    tail = "\n".join(prompts[i].text.splitlines()[-num_tail_lines:])
    console.rule(f"prompt {i} ({prompts[i].kind} of {prompts[i].file}), its last "
                 f"{num_tail_lines} lines")
    console.print(tail, markup=False, highlight=False)
    console.rule(f"the model's output ({len(run.token_ids[i])} tokens, "
                 f"{len(set(run.token_ids[i]))} distinct)")
    console.print(run.texts[i], markup=False, highlight=False)
    console.rule()

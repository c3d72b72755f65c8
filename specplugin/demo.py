"""``specplugin demo``: offline batch inference through stock ``vllm.LLM``, with and without the plugin.

The prompts come from stdlib files the zoo's models never saw in training: half ask
the model to write a file's code again after quoting it (an edit, where n-gram
drafting copies long spans), half ask it to continue a file's opening (fresh code).
Each configuration runs in its own engine process; the table shows output tokens/s,
the speedup over plain decoding and vLLM's own acceptance counters.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path


def demo_prompts(zoo_root: Path | None, num_prompts: int, max_chars: int = 900) -> list[str]:
    from specplugin.zoo import heldout_files

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[str] = []
    for rel in heldout_files(zoo_root):
        path = stdlib / rel
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < max_chars:
            continue
        chunk = text[len(text) // 3 :][:max_chars]
        chunk = chunk[chunk.find("\n") + 1 : chunk.rfind("\n") + 1]
        if len(prompts) % 2 == 0:
            prompts.append(chunk + "\n\n# ----- the same code, copied -----\n" + chunk[:80])
        else:
            prompts.append(text[:max_chars])
        if len(prompts) == num_prompts:
            break
    return prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zoo", help="zoo folder (default: the committed pair)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,8",
                        help="comma-separated; batch 1 runs the prompts one after the other")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=8)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specplugin.engine import plugin_engine_kwargs, run_engine
    from specplugin.zoo import zoo_path

    console = Console()
    root = Path(args.zoo) if args.zoo else None
    target = zoo_path("target", root)
    prompts = demo_prompts(root, args.num_prompts)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    configs = {
        "no speculation": {},
        f"specplugin ngram (K={args.num_speculative_tokens})":
            plugin_engine_kwargs(args.num_speculative_tokens, {"proposers": ["ngram"]}),
    }
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    console.print(f"[bold]specplugin demo[/]: {len(prompts)} held-out prompts, {args.max_tokens} "
                  f"greedy tokens each, batch sizes {batch_sizes}, target {target}")
    table = Table(title="offline batch inference, vllm.LLM (each row: its own engine)")
    for col in ("configuration", "batch", "output tok/s", "speedup", "mean acceptance length",
                "same tokens as no speculation"):
        table.add_column(col)
    runs, all_same = {}, True
    for batch in batch_sizes:
        for name, kwargs in configs.items():
            with console.status(f"running vLLM: {name}, batch {batch} ..."):
                runs[name] = run_engine(target, kwargs, prompts, sampling, batch_size=batch)
        base = runs["no speculation"]
        for name, r in runs.items():
            same = r.token_ids == base.token_ids
            all_same &= same
            table.add_row(name, str(batch), f"{r.tok_s:.1f}", f"{r.tok_s / base.tok_s:.2f}x",
                          f"{r.mean_acceptance_length:.2f}" if r.num_drafts else "-",
                          "yes" if same else "[red]NO[/]")
    console.print(table)
    sample = runs[list(runs)[1]].texts[0]
    console.print("[bold]first output (edit prompt):[/]\n" + sample[:400])
    return 0 if all_same else 1

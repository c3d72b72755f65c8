"""``specplugin zoo report``: the figures the README gives for the zoo pair, measured under vLLM.

Parameters and held-out loss (nats/token, from ``zoo.json``); each model's batch-1 greedy
decode speed; mean acceptance length of vLLM's ``draft_model`` with this pair (K=4,
greedy) on held-out ``complete`` prompts. Compiled mode unless ``--eager``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def measure(zoo_root: Path, num_prompts: int, max_tokens: int, k: int, eager: bool = False,
            workdir: Path | None = None) -> dict:
    import numpy as np

    from specplugin.bench.runner import run_engine
    from specplugin.bench.workloads import FULL_SIZES, complete_prompts, source_from_zoo
    from specplugin.zoo import zoo_path

    report = json.loads((zoo_root / "zoo.json").read_text())
    source = source_from_zoo(zoo_root)
    prompts = complete_prompts(source, FULL_SIZES, num_prompts, np.random.default_rng(0))
    common = {"max_tokens": max_tokens, "eager": eager, "workdir": workdir}  # greedy: the default
    for name in ("target", "draft"):
        single = run_engine(zoo_path(name, zoo_root), {}, prompts[:1], label=name, **common)
        report[name]["vllm_batch1_tok_s"] = round(single.tok_s, 1)
    spec = {"method": "draft_model", "model": str(zoo_path("draft", zoo_root)),
            "num_speculative_tokens": k}
    run = run_engine(zoo_path("target", zoo_root), {"speculative_config": spec}, prompts,
                     label="draft_model", **common)
    report["execution_mode"] = "eager" if eager else "compiled"
    report["vllm_draft_model"] = {
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "mean_acceptance_length": round(run.mean_acceptance_length, 3),
        "accepted_per_pos": run.accepted_per_pos,
        "num_drafts": run.num_drafts,
    }
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specplugin.bench.runner import add_eager_argument
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--out-dir", default="bench-out/zoo-report", help="folder for vLLM's logs")
    add_eager_argument(parser)


def run(args: argparse.Namespace) -> int:
    from specplugin.zoo import pair_root

    root = pair_root(args.zoo)
    r = measure(root, args.num_prompts, args.max_tokens, args.k, args.eager, Path(args.out_dir))
    for name in ("target", "draft"):
        m = r[name]
        print(f"{name}: {m['params'] / 1e6:.2f}M params, held-out loss {m['heldout_loss']:.3f} "
              f"nats/token, vLLM ({r['execution_mode']}) batch 1: "
              f"{m['vllm_batch1_tok_s']:.1f} tok/s")
    d = r["vllm_draft_model"]
    print(f"vLLM draft_model, K={d['num_speculative_tokens']}, greedy, {d['num_prompts']} held-out "
          f"complete prompts: mean acceptance length {d['mean_acceptance_length']:.2f} "
          f"(accepted per position {d['accepted_per_pos']} of {d['num_drafts']} drafts)")
    return 0

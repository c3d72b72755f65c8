"""The ``specplugin`` command: ``zoo``, ``demo``, ``bench``, ``check-lossless``."""

from __future__ import annotations

import argparse
import sys


def _zoo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specplugin import zoo

    if args.zoo_command == "path":
        print(zoo.zoo_path(args.name, Path(args.root) if args.root else None))
        return 0
    if args.zoo_command == "report":
        from specplugin.zoo import report

        return report.run(args)
    report = zoo.build(Path(args.out) if args.out else None, quick=args.quick,
                       time_budget_s=args.time_budget)
    for name in ("target", "draft"):
        r = report[name]
        print(f"{name}: {r['params'] / 1e6:.2f}M params, held-out loss {r['heldout_loss']:.3f}, "
              f"{r['steps_done']} steps")
    print(f"seconds: {report['seconds']}")
    return 0


def _add_zoo(sub) -> None:
    p = sub.add_parser("zoo", help="the project's own target/draft model pair")
    zsub = p.add_subparsers(dest="zoo_command", required=True)
    b = zsub.add_parser("build", help="train tokenizer, target and draft (deterministic)")
    b.add_argument("--quick", action="store_true", help="tiny pair in seconds (for tests)")
    b.add_argument("--out", help="output folder (default: the package's committed weights)")
    b.add_argument("--time-budget", type=float, default=None,
                   help="stop training after this many seconds (breaks bit-exact reproduction)")
    q = zsub.add_parser("path", help="print the folder of a zoo model")
    q.add_argument("name", choices=["target", "draft"])
    q.add_argument("--root", help="zoo folder (default: the committed weights)")
    from specplugin.zoo import report

    report.add_arguments(zsub.add_parser("report", help="measure the pair under vLLM (README figures)"))
    p.set_defaults(func=_zoo)


def _lazy(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).run(args)

    return run


def _add_lazy(sub, name: str, module: str, help_text: str) -> None:
    import importlib

    p = sub.add_parser(name, help=help_text)
    importlib.import_module(module).add_arguments(p)
    p.set_defaults(func=_lazy(module))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specplugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_zoo(sub)
    _add_lazy(sub, "demo", "specplugin.demo", "offline batch inference with and without the plugin")
    _add_lazy(sub, "bench", "specplugin.bench.cli", "vLLM's speculative methods and the plugin, side by side")
    _add_lazy(sub, "check-lossless", "specplugin.bench.lossless", "speculation leaves outputs exactly the target's")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``specplugin`` command: ``zoo``, ``demo``, ``bench``, ``check-lossless``,
``profile``, ``cost-curve``, ``load``.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args)``; only the
one being run is imported, so a broken module breaks only its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "zoo": ("specplugin.bench.zoo_cli", "the project's own target/draft model pair"),
    "demo": ("specplugin.demo", "offline batch inference with and without the plugin"),
    "bench": ("specplugin.bench.cli", "vLLM's speculative methods and the plugin, side by side"),
    "check-lossless": ("specplugin.bench.lossless",
                       "speculation leaves outputs exactly the target's"),
    "profile": ("specplugin.bench.profile",
                "where each engine step's time goes, method beside method"),
    "cost-curve": ("specplugin.bench.costcurve",
                   "the target's forward time against query tokens per row"),
    "load": ("specplugin.bench.load",
             "vllm serve under vLLM's own serving benchmark"),
}


def int_option(name: str, lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]``; the error names ``name``."""
    bounds = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{name} must be an integer {bounds}; got {text!r}")
        return value

    return parse


def int_list_option(name: str, lo: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers >= ``lo``, repeats dropped."""
    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if not all(p.strip().isdigit() and int(p) >= lo for p in parts):
            raise argparse.ArgumentTypeError(f"{name} must be comma-separated integers of at "
                                             f"least {lo}, e.g. 1,8; got {text!r}")
        return list(dict.fromkeys(int(p) for p in parts))

    return parse


def requested(argv: Sequence[str]) -> str | None:
    """The subcommand in ``argv``: its first non-option argument."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Every subcommand gets a parser for ``--help``; only the requested one its arguments."""
    parser = argparse.ArgumentParser(
        prog="specplugin", description="Speculative decoding for vLLM as a plugin: commands.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = requested(argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

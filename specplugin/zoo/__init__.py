"""The project's own small models: a target and a distilled draft sharing a tokenizer.

Nothing can be downloaded on the machines this project runs on, and speculative
decoding means nothing on random weights, so the pair is trained here from the
Python standard library (see ``train.py``) and committed as fp16 safetensors.

``zoo_path("target")`` / ``zoo_path("draft")`` give the committed folders;
``build(...)`` retrains (``specplugin zoo build``).
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
MODEL_NAMES = ("target", "draft")


def zoo_path(name: str, root: Path | None = None) -> Path:
    """Folder of a zoo model in Hugging Face format, loadable by ``vllm.LLM(model=...)``."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    path = (root or WEIGHTS_DIR) / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"zoo model {name!r} not found at {path}; run `specplugin zoo build` to train it"
        )
    return path


def heldout_files(root: Path | None = None) -> list[str]:
    """Stdlib files (relative paths) that the zoo's models never saw in training."""
    return (root or WEIGHTS_DIR).joinpath("heldout_files.txt").read_text().split()


def build(out_dir: Path | None = None, quick: bool = False, time_budget_s: float | None = None):
    from specplugin.zoo.train import FULL, QUICK, build as _build

    return _build(Path(out_dir or WEIGHTS_DIR), QUICK if quick else FULL, time_budget_s)

"""Which workloads a model pair is measured on, and in which dtype it runs.

**code windows** (``workloads.py``, pairs trained here, float32) or **instruct**
(``instruct.py``, real instruct models, vLLM's ``auto`` dtype): a target tokenizer with a
chat template makes an instruct pair (:func:`family_for`). Nothing else branches on the pair.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specplugin.bench import instruct, workloads
from specplugin.bench.workloads import Cell, CellPrompts


@dataclass(frozen=True)
class Family:
    """A set of workloads, the cells a run picks from them, and the pairs' dtype."""

    name: str
    workloads: Mapping[str, Any]  # name -> workload (its batch_sizes and temperatures)
    headline: tuple[Cell, ...]
    quick: tuple[Cell, ...]
    # default cells: the headline's (True) or every cell of every workload (False)
    default_is_headline: bool
    sizes: Any  # workloads.Sizes or instruct.InstructSizes
    quick_sizes: Any
    dtype: str  # vLLM's dtype for the family's pairs unless --dtype says otherwise
    load_source: Callable[[Path], Any]  # pair folder -> what build reads prompts from
    build: Callable[[Any, Any, Cell, int], CellPrompts]  # (source, sizes, cell, seed)

    def check_workloads(self, names: Sequence[str]) -> None:
        unknown = [w for w in names if w not in self.workloads]
        if unknown:
            raise ValueError(f"unknown workload(s) {unknown} for this pair, whose workloads "
                             f"are {self.name}: {', '.join(self.workloads)}.")


CODE_WINDOWS = Family(
    "code windows", workloads.WORKLOADS, workloads.HEADLINE_CELLS, workloads.QUICK_CELLS,
    default_is_headline=False, sizes=workloads.FULL_SIZES, quick_sizes=workloads.QUICK_SIZES,
    dtype="float32", load_source=workloads.source_from_zoo, build=workloads.cell_prompts)
INSTRUCT = Family(
    "instruct", instruct.INSTRUCT_WORKLOADS, instruct.INSTRUCT_HEADLINE, instruct.INSTRUCT_QUICK,
    default_is_headline=True, sizes=instruct.INSTRUCT_SIZES,
    quick_sizes=instruct.INSTRUCT_QUICK_SIZES, dtype="auto",
    load_source=lambda root: instruct.source_from_folder(Path(root) / "target"),
    build=instruct.cell_prompts)
FAMILIES = (CODE_WINDOWS, INSTRUCT)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype's choices (vLLM's names)


def family_for(pair_root: Path) -> Family:
    """``INSTRUCT`` when the pair's target tokenizer has a chat template, else ``CODE_WINDOWS``."""
    return INSTRUCT if instruct.has_chat_template(Path(pair_root) / "target") else CODE_WINDOWS


def workloads_help() -> str:
    return "; ".join(f"{f.name} pairs: {', '.join(f.workloads)}" for f in FAMILIES)


def add_dtype_argument(parser) -> None:
    """``--dtype`` with one help text for every command that takes it."""
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="vLLM's dtype (default: float32 for the pairs trained here, "
                             "auto, vLLM's own default, bf16 on CPU, for instruct pairs such "
                             "as smollm2)")

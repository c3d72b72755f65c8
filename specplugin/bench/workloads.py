"""The small pairs' workloads as token-id prompts, built without vLLM.

**edit** (a code chunk, a separator, its first tokens again: the answer copies),
**complete** (fresh code), **mixed** (both alternating), **adversarial** (random ids:
speculation can only cost), **server** (mixed, half greedy), **revisit** (windows asked
again behind new headers: cross-request drafting pays; batch 1).

Prompts are windows at random offsets of the zoo's held-out stdlib files as one token
stream. A **cell** is (workload, batch size, temperature) with its own seed, so cells
never share prompts.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEPARATOR_TEXT = "\n\n"  # between an edit's chunk and its restart


@dataclass(frozen=True)
class PromptSource:
    """Held-out code as one token stream, and the ids random prompts may use."""

    stream: np.ndarray  # [num_stream_tokens] int64: held-out files, joined
    separator_ids: tuple[int, ...]
    vocab_size: int
    special_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.stream.size == 0:
            raise ValueError("the held-out token stream is empty; the zoo's held-out files "
                             "were not found under the stdlib root")


@dataclass(frozen=True)
class Sizes:
    """How big a run is: prompt shapes, output length, requests per cell."""

    max_tokens: int  # output tokens per request, the same for every method (ignore_eos)
    edit_chunk_len: int  # tokens of code an edit prompt quotes
    edit_restart_len: int  # tokens of the chunk repeated after the separator
    complete_prompt_len: int
    random_prompt_len: int
    min_requests: int  # per cell; batch 1 runs this many requests one after the other

    def num_batches(self, batch_size: int) -> int:
        return max(1, -(-self.min_requests // batch_size))


FULL_SIZES = Sizes(max_tokens=128, edit_chunk_len=192, edit_restart_len=16,
                   complete_prompt_len=128, random_prompt_len=64, min_requests=4)
QUICK_SIZES = Sizes(max_tokens=32, edit_chunk_len=96, edit_restart_len=8,
                    complete_prompt_len=64, random_prompt_len=32, min_requests=1)


def _window_starts(num_stream: int, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct offsets when the stream allows, else offsets may repeat."""
    num_offsets = max(1, num_stream - length + 1)
    return rng.choice(num_offsets, size=count, replace=count > num_offsets)


def code_windows(source: PromptSource, length: int, count: int,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` windows of ``length`` tokens; a stream shorter than that is repeated."""
    stream = source.stream if source.stream.size >= length else np.resize(source.stream, length)
    return [stream[s : s + length] for s in _window_starts(stream.size, length, count, rng)]


def edit_prompts(source: PromptSource, sizes: Sizes, count: int,
                 rng: np.random.Generator) -> list[list[int]]:
    sep = np.array(source.separator_ids, dtype=np.int64)
    return [np.concatenate([chunk, sep, chunk[: sizes.edit_restart_len]]).tolist()
            for chunk in code_windows(source, sizes.edit_chunk_len, count, rng)]


def complete_prompts(source: PromptSource, sizes: Sizes, count: int,
                     rng: np.random.Generator) -> list[list[int]]:
    return [w.tolist() for w in code_windows(source, sizes.complete_prompt_len, count, rng)]


def mixed_prompts(source: PromptSource, sizes: Sizes, count: int,
                  rng: np.random.Generator) -> list[list[int]]:
    """Even requests edit, odd ones complete: every batch of two or more holds both."""
    edits = edit_prompts(source, sizes, (count + 1) // 2, rng)
    completes = complete_prompts(source, sizes, count // 2, rng)
    return [edits[i // 2] if i % 2 == 0 else completes[i // 2] for i in range(count)]


def adversarial_prompts(source: PromptSource, sizes: Sizes, count: int,
                        rng: np.random.Generator) -> list[list[int]]:
    allowed = np.setdiff1d(np.arange(source.vocab_size),  # [num_allowed]: no special tokens
                           np.array(source.special_ids, dtype=np.int64))
    return rng.choice(allowed, size=(count, sizes.random_prompt_len)).tolist()


def revisit_prompts(source: PromptSource, sizes: Sizes, count: int,
                    rng: np.random.Generator) -> list[list[int]]:
    """Request i continues window ``i % num_windows`` (``count // 4`` windows, each asked
    four times) behind its own 8-token header."""
    windows = code_windows(source, sizes.complete_prompt_len, max(1, count // 4), rng)
    headers = code_windows(source, 8, count, rng)
    return [np.concatenate([headers[i], windows[i % len(windows)]]).tolist()
            for i in range(count)]


PromptBuilder = Callable[[PromptSource, Sizes, int, np.random.Generator], list[list[int]]]


def same_temperature(count: int, temperature: float) -> list[float]:
    return [temperature] * count


def half_greedy(count: int, temperature: float) -> list[float]:
    """Requests 0, 1 greedy, 2, 3 at ``temperature``, and so on (see ``server``)."""
    return [0.0 if (i // 2) % 2 == 0 else temperature for i in range(count)]


@dataclass(frozen=True)
class Workload:
    name: str
    build: PromptBuilder
    batch_sizes: tuple[int, ...]
    temperatures: tuple[float, ...]
    # per-request temperatures from the cell's: (count, temperature) -> [count]
    request_temperatures: Callable[[int, float], list[float]] = same_temperature


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("edit", edit_prompts, (1, 8), (0.0, 1.0)),
        Workload("complete", complete_prompts, (1, 8), (0.0, 1.0)),
        Workload("mixed", mixed_prompts, (1, 8), (0.0, 1.0)),
        Workload("adversarial", adversarial_prompts, (16,), (1.0,)),
        Workload("server", mixed_prompts, (8,), (1.0,), half_greedy),
        Workload("revisit", revisit_prompts, (1,), (0.0,)),
    )
}


@dataclass(frozen=True)
class Cell:
    """One measured setting; every method runs every cell of a run."""

    workload: str
    batch_size: int
    temperature: float

    @property
    def key(self) -> str:
        return f"{self.workload}/b{self.batch_size}/t{self.temperature:g}"

    def seed(self, base_seed: int) -> int:
        """Stable across runs and machines (crc32, not ``hash``), distinct across cells."""
        return zlib.crc32(self.key.encode()) ^ base_seed


def grid(workloads: Mapping[str, Any], names: Sequence[str] = ()) -> list[Cell]:
    """Every cell of the workloads ``names`` (default: all): batch sizes times temperatures."""
    return [Cell(w, b, t) for w in names or workloads for b in workloads[w].batch_sizes
            for t in workloads[w].temperatures]


# --quick: one cell that copies, one mixed batch sampled, and the adversarial one.
QUICK_CELLS = (Cell("edit", 1, 0.0), Cell("mixed", 8, 1.0), Cell("adversarial", 16, 1.0))


# --headline: copying and fresh code at b1, fresh code batched, a server's mix, sampling, noise
HEADLINE_CELLS = (Cell("edit", 1, 0.0), Cell("complete", 1, 0.0), Cell("complete", 8, 0.0),
                  Cell("server", 8, 1.0), Cell("complete", 1, 1.0), Cell("adversarial", 16, 1.0))


@dataclass(frozen=True)
class CellPrompts:
    cell: Cell
    prompts: tuple[tuple[int, ...], ...]  # [num_batches * batch_size][prompt_len]
    max_tokens: int  # every request's output length (ignore_eos), else its cap
    temperatures: tuple[float, ...] | None = None  # [num_prompts]; None: the cell's, for all
    # True: exactly max_tokens per request; False: stop at EOS (instruct workloads)
    ignore_eos: bool = True


def cell_prompts(source: PromptSource, sizes: Sizes, cell: Cell, base_seed: int = 0) -> CellPrompts:
    count = sizes.num_batches(cell.batch_size) * cell.batch_size
    rng = np.random.default_rng(cell.seed(base_seed))
    workload = WORKLOADS[cell.workload]
    prompts = workload.build(source, sizes, count, rng)
    temperatures = tuple(workload.request_temperatures(count, cell.temperature))
    return CellPrompts(cell, tuple(tuple(int(t) for t in p) for p in prompts), sizes.max_tokens,
                       None if set(temperatures) == {cell.temperature} else temperatures)


def source_from_zoo(zoo_root: Path, stdlib_root: Path | None = None) -> PromptSource:
    """Tokenize the zoo's held-out files with the zoo's tokenizer."""
    import sysconfig

    from tokenizers import Tokenizer

    from specplugin.zoo import heldout_files
    from specplugin.zoo.data import EOS_TOKEN

    tokenizer = Tokenizer.from_file(str(Path(zoo_root) / "target" / "tokenizer.json"))
    root = Path(stdlib_root or sysconfig.get_paths()["stdlib"])
    files = [root / f for f in heldout_files(Path(zoo_root)) if (root / f).is_file()]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return source_from_texts(texts, tokenizer.encode, tokenizer.get_vocab_size(),
                             [tokenizer.token_to_id(EOS_TOKEN)])


def source_from_texts(texts: Sequence[str], encode: Callable, vocab_size: int,
                      special_ids: Sequence[int | None] = ()) -> PromptSource:
    """``encode(text)`` returns ids (a list, or an object with ``.ids`` as ``tokenizers`` does)."""
    def ids(text: str) -> list[int]:
        out = encode(text)
        return list(getattr(out, "ids", out))

    sep = ids(SEPARATOR_TEXT)
    parts = [np.array(ids(t) + sep, dtype=np.int64) for t in texts if t]
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return PromptSource(stream, tuple(sep), vocab_size,
                        tuple(sorted({i for i in special_ids if i is not None})))

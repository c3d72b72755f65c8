"""Corpora and tokenizer for the model zoo.

The zoo pair trains on the Python stdlib's source; the validation pair on the system's
C headers (so it reproduces on this kind of machine, not bit for bit everywhere). Files
split into train and held-out by a hash of their path, independent of which other files
exist. Test suites and ``site-packages`` are left out: large, repetitive, unlike user code.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
HELDOUT_EVERY = 20  # one file in 20 is held out (by path hash)

_EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    root: Path
    train_files: tuple[str, ...]  # paths relative to root, sorted
    heldout_files: tuple[str, ...]

    def texts(self, split: str) -> list[str]:
        files = self.train_files if split == "train" else self.heldout_files
        return [(self.root / f).read_text(encoding="utf-8", errors="replace") for f in files]


def is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha1(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_EVERY == 0


def stdlib_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """All ``.py`` files of the stdlib, split into train and held-out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if not _EXCLUDED_PARTS.intersection(p.relative_to(root).parts)
    )
    if max_files is not None:
        files = files[:max_files]
    train = tuple(f for f in files if not is_heldout(f))
    heldout = tuple(f for f in files if is_heldout(f))
    return Corpus(root=root, train_files=train, heldout_files=heldout)


# /usr/include trees that are C++ or a vendored copy of another project
_C_EXCLUDED_TOP = {"c++", "node", "llvm-14", "llvm-c-14", "boost", "unicode", "qt5", "qt6"}


def c_headers_corpus(roots: tuple[Path, ...] | None = None) -> Corpus:
    """Every ``.h`` under the system include roots, split by path hash; paths are
    absolute (``Corpus.root`` is ``/``) so the held-out list works from anywhere."""
    if roots is None:
        roots = (Path("/usr/include"), Path(sysconfig.get_paths()["include"]))
    found: set[str] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for p in root.rglob("*.h"):
            rel = p.relative_to(root).parts
            if rel[0] in _C_EXCLUDED_TOP or not p.is_file():
                continue
            found.add(str(p.resolve()).lstrip("/"))
    if not found:
        raise FileNotFoundError(f"no C headers under {', '.join(map(str, roots))}; the "
                                "validation pair needs gcc's and Python's headers installed")
    files = sorted(found)
    return Corpus(root=Path("/"), train_files=tuple(f for f in files if not is_heldout(f)),
                  heldout_files=tuple(f for f in files if is_heldout(f)))


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer: every string round-trips, no unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save as a ``PreTrainedTokenizerFast`` folder that vLLM and transformers load."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.model_max_length = 2048
    fast.save_pretrained(str(out_dir))

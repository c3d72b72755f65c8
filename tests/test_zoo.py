"""The zoo: tokenizer round trip, deterministic --quick builds, the committed pair's files."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from specplugin.zoo import heldout_files, zoo_path
from specplugin.zoo.data import is_heldout, stdlib_corpus

TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "\tclass A(B, metaclass=M):\n\t\tpass\r\n",
    "print('héllo wörld, 你好, здравствуй 🙂')",
    "",
    " leading and trailing spaces  ",
    "\x00\x01 control bytes \x7f",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_any_text(zoo_root, text):
    tok = AutoTokenizer.from_pretrained(str(zoo_path("target", zoo_root)))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_target_and_draft_share_the_tokenizer(zoo_root):
    target, draft = zoo_path("target", zoo_root), zoo_path("draft", zoo_root)
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    t_cfg = json.loads((target / "config.json").read_text())
    d_cfg = json.loads((draft / "config.json").read_text())
    assert t_cfg["vocab_size"] == d_cfg["vocab_size"]


@pytest.mark.vllm
def test_quick_build_is_deterministic(quick_zoo, tmp_path):
    subprocess.run([sys.executable, "-m", "specplugin.cli", "zoo", "build", "--quick", "--out",
                    str(tmp_path)], check=True, capture_output=True, timeout=300)
    for name in ("target", "draft"):
        for f in ("model.safetensors", "tokenizer.json", "config.json"):
            a = (quick_zoo / name / f).read_bytes()
            assert a == (tmp_path / name / f).read_bytes(), f"{name}/{f} differs between builds"


def test_zoo_path_command_prints_the_folders(quick_zoo):
    for name in ("target", "draft"):
        out = subprocess.run([sys.executable, "-m", "specplugin.cli", "zoo", "path", name,
                              "--root", str(quick_zoo)], check=True, capture_output=True,
                             text=True)
        assert out.stdout.strip() == str(quick_zoo / name)


def test_heldout_files_were_never_trained_on(zoo_root):
    held = heldout_files(zoo_root)
    assert held and all(is_heldout(f) for f in held)
    corpus = stdlib_corpus()
    assert not set(held) & set(corpus.train_files)


def test_committed_weights_are_fp16_and_small(zoo_root):
    from safetensors import safe_open

    total = 0
    for name in ("target", "draft"):
        path = zoo_path(name, zoo_root) / "model.safetensors"
        total += path.stat().st_size
        with safe_open(str(path), "pt") as f:
            assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.float16"}
    assert total < 60e6

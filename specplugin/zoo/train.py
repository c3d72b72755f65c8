"""Train a zoo pair: a target and a draft sharing one byte-level BPE tokenizer.

``FULL`` is the zoo pair (Llama, Python stdlib) the project benchmarks on; ``VALIDATION``
a pair never tuned on (Qwen2, C headers). The target learns next-token cross entropy; the
draft is distilled with full-vocabulary KL(target || draft), since acceptance is 1 - TV
and KL bounds TV. Seeded: same recipe, corpus and threads give identical weights.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specplugin.zoo.data import (EOS_TOKEN, c_headers_corpus, save_tokenizer, stdlib_corpus,
                                 train_tokenizer)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int


@dataclass(frozen=True)
class Recipe:
    name: str
    vocab_size: int
    seq_len: int
    batch_size: int
    target: ModelShape
    draft: ModelShape
    target_steps: int
    draft_steps: int
    lr: float = 2e-3
    warmup_steps: int = 20
    seed: int = 1234
    max_files: int | None = None  # None: the whole stdlib
    num_eval_windows: int = 32
    max_position_embeddings: int = 2048
    corpus: str = "python"  # "python": the stdlib's .py files; "c": the system's C headers
    architecture: str = "llama"  # "llama" or "qwen2"


FULL = Recipe(
    name="full",
    vocab_size=4096,
    seq_len=512,
    batch_size=8,
    target=ModelShape(hidden_size=384, num_layers=6, intermediate_size=1024, num_heads=6),
    draft=ModelShape(hidden_size=128, num_layers=2, intermediate_size=384, num_heads=2),
    target_steps=800,
    draft_steps=400,
)

VALIDATION = Recipe(
    name="validation",
    vocab_size=6144,
    seq_len=384,
    batch_size=8,
    target=ModelShape(hidden_size=320, num_layers=5, intermediate_size=896, num_heads=5),
    draft=ModelShape(hidden_size=128, num_layers=2, intermediate_size=352, num_heads=2),
    target_steps=700,
    draft_steps=350,
    seed=4321,
    corpus="c",
    architecture="qwen2",
)

QUICK = Recipe(
    name="quick",
    vocab_size=384,
    seq_len=64,
    batch_size=4,
    target=ModelShape(hidden_size=64, num_layers=2, intermediate_size=128, num_heads=2),
    draft=ModelShape(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=1),
    target_steps=30,
    draft_steps=20,
    lr=3e-3,
    warmup_steps=3,
    max_files=40,
    num_eval_windows=4,
    max_position_embeddings=512,
)


def model_config(shape: ModelShape, recipe: Recipe, eos_id: int):
    """A Hugging Face config of ``recipe.architecture`` with ``shape``."""
    from transformers import LlamaConfig, Qwen2Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[recipe.architecture](
        vocab_size=recipe.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def _lr_at(step: int, recipe: Recipe, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, total_steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _sample_windows(
    stream: torch.Tensor,  # [num_tokens] int64
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [batch_size, seq_len + 1]
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def _eval_windows(stream: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Evenly spaced, non-overlapping held-out windows: [num_windows, seq_len + 1]."""
    span = recipe.seq_len + 1
    n = min(recipe.num_eval_windows, stream.numel() // span)
    step = stream.numel() // n
    return torch.stack([stream[i * step : i * step + span] for i in range(n)])


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=w[None, :-1], labels=w[None, :-1]).loss for w in windows]
    model.train()
    # labels are shifted inside the model; equal lengths so a plain mean is exact
    return float(torch.stack(losses).mean())


def _train_loop(model, loss_fn, recipe: Recipe, steps: int, next_batch, deadline, desc: str):
    """AdamW under ``_lr_at``'s schedule; ``next_batch(generator)`` draws each step's batch,
    ``loss_fn(batch)`` scores it. Returns the number of steps done before ``deadline``."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(recipe.seed + len(desc))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.1)
    done = 0
    bar = tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True)
    for step in bar:
        if time.monotonic() > deadline:
            bar.write(f"{desc}: time budget reached after {step} of {steps} steps")
            break
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe, steps)
        batch = next_batch(gen)
        loss = loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
    return done


def mark_float32(out_dir: Path) -> None:
    """``dtype: float32`` in config.json so vLLM runs fp32 on CPU; no generation_config.json,
    from which vLLM would take sampling defaults."""
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").unlink(missing_ok=True)


def _save_model(model, out_dir: Path) -> None:
    """fp16 safetensors on disk, run in fp32 (``mark_float32``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(str(out_dir), safe_serialization=True)
    model.to(torch.float32)
    mark_float32(out_dir)


def build(out_dir: Path, recipe: Recipe, time_budget_s: float | None = None) -> dict:
    """Train tokenizer, target and draft into ``out_dir/{target,draft}``; return the report."""
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    deadline = start + (time_budget_s if time_budget_s else float("inf"))
    torch.manual_seed(recipe.seed)
    corpus = (c_headers_corpus() if recipe.corpus == "c"
              else stdlib_corpus(max_files=recipe.max_files))
    train_texts = corpus.texts("train")
    tokenizer = train_tokenizer(train_texts, recipe.vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)

    def to_stream(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for enc in tokenizer.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.long)

    train_stream = to_stream(train_texts)
    eval_windows = _eval_windows(to_stream(corpus.texts("heldout")), recipe)

    torch.manual_seed(recipe.seed)
    target = AutoModelForCausalLM.from_config(model_config(recipe.target, recipe, eos_id))
    target_budget = start + (deadline - start) * 0.7 if time_budget_s else deadline

    def ce_loss(batch):
        return target(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss

    def windows(gen: torch.Generator) -> torch.Tensor:
        return _sample_windows(train_stream, recipe.batch_size, recipe.seq_len, gen)

    target_done = _train_loop(target, ce_loss, recipe, recipe.target_steps, windows,
                              target_budget, "target")
    target.eval()

    torch.manual_seed(recipe.seed + 1)
    draft = AutoModelForCausalLM.from_config(model_config(recipe.draft, recipe, eos_id))

    def kl_loss(batch):
        with torch.no_grad():
            target_logprobs = F.log_softmax(target(input_ids=batch[:, :-1]).logits, dim=-1)
        draft_logprobs = F.log_softmax(draft(input_ids=batch[:, :-1]).logits, dim=-1)
        # KL(target || draft), averaged over positions: [batch, seq, vocab] -> scalar
        return F.kl_div(draft_logprobs.flatten(0, 1), target_logprobs.flatten(0, 1),
                        log_target=True, reduction="batchmean")

    draft_done = _train_loop(draft, kl_loss, recipe, recipe.draft_steps, windows,
                             deadline, "draft (distilled)")

    report = {
        "recipe": asdict(recipe),
        "seed": recipe.seed,
        "torch_threads": torch.get_num_threads(),
        "train_tokens_available": int(train_stream.numel()),
        "target": {
            "params": sum(p.numel() for p in target.parameters()),
            "steps_done": target_done,
            "train_tokens_seen": target_done * recipe.batch_size * recipe.seq_len,
            "heldout_loss": heldout_loss(target, eval_windows),
        },
        "draft": {
            "params": sum(p.numel() for p in draft.parameters()),
            "steps_done": draft_done,
            "train_tokens_seen": draft_done * recipe.batch_size * recipe.seq_len,
            "heldout_loss": heldout_loss(draft, eval_windows),
        },
        "num_train_files": len(corpus.train_files),
        "num_heldout_files": len(corpus.heldout_files),
        "seconds": round(time.monotonic() - start, 1),
    }
    for name, model in (("target", target), ("draft", draft)):
        _save_model(model, out_dir / name)
        save_tokenizer(tokenizer, out_dir / name)
    # absolute paths for a corpus outside the stdlib: the benchmarks read them back
    listed = [f if corpus.root != Path("/") else f"/{f}" for f in corpus.heldout_files]
    (out_dir / "heldout_files.txt").write_text("\n".join(listed) + "\n")
    (out_dir / "zoo.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report

"""A tiny-vocabulary Llama pair for the sampled losslessness check.

With a dozen tokens a few thousand draws fill every histogram cell, so a chi-square test
sees a sampler off by a few percent. Random weights suffice; logits are scaled (std ~2) so
drafts are both accepted and rejected often. No tokenizer: prompts are token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int = 12
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2  # head_dim 32: a size vLLM's CPU attention supports
    logit_std: float = 2.0
    seed: int = 0


TINY_TARGET = TinyShape()
TINY_DRAFT = TinyShape(num_layers=1, seed=1)  # for draft-model methods: same vocab, other weights


def build_tiny_llama(out_dir: Path, shape: TinyShape) -> Path:
    """Save a seeded random Llama with ``shape`` to ``out_dir``; return the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from specplugin.zoo.train import mark_float32

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in the check's report

    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=2 * shape.hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # final hidden states have unit RMS: logit std = w_std * sqrt(hidden)
        weight = model.lm_head.weight
        weight.normal_(0.0, shape.logit_std / shape.hidden_size ** 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    mark_float32(out_dir)
    return out_dir


def repetitive_prompts(vocab_size: int, num_prompts: int, length: int) -> list[list[int]]:
    """Prompt j repeats a period-(j + 2) pattern of distinct ids, so n-gram and suffix
    proposers find matches and draft from the very first decoding step."""
    prompts = []
    for j in range(num_prompts):
        period = j + 2
        pattern = [1 + (3 * j + i) % (vocab_size - 1) for i in range(period)]  # id 0 is eos
        prompts.append([pattern[i % period] for i in range(length)])
    return prompts

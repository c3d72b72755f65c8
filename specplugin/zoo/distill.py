"""Distil a small draft for a real instruct target (SmolLM2-135M-Instruct) by imitation.

Expected acceptance is sum_x min(target_probs[x], draft_probs[x]) = 1 - TV(target, draft),
which KL(target || draft) bounds (Pinsker). So: chats (``distill_prompts``) answered by
the target with its top-k log-probabilities at every position (vLLM in a child, or
transformers for tests); a draft of the target's config at a smaller shape, its tied
embedding the target's projected on its top principal directions; a top-k KL loss
(``prompt_weight`` on prompt positions); held-out greedy agreement and expected
acceptance per kind. See docs/zoo.md.

Dimensions: ``V`` vocabulary, ``H`` hidden size, ``T`` tokens of a sequence, ``k``
``recipe.top_k``, ``N`` positions scored in a batch. Everything is seeded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specplugin.zoo.distill_prompts import (HELDOUT_MODULES, KINDS, TRAIN_MODULES, Chat,
                                            build_chats)
from specplugin.zoo.train import _save_model, _train_loop

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")
GENERATORS = ("vllm", "transformers")


@dataclass(frozen=True)
class Recipe:
    name: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    num_train: dict  # kind -> number of training chats
    num_heldout: int  # held-out chats per kind
    max_new_tokens: int
    steps: int
    batch_size: int  # sequences per step
    lr: float = 2e-3
    warmup_steps: int = 20
    seed: int = 1234
    sampled_fraction: float = 0.3  # share of training answers sampled, not greedy
    temperature: float = 0.8
    top_k: int = 20
    prompt_weight: float = 0.2  # loss weight of a prompt position (answer positions: 1)
    max_seq_len: int = 768
    generator: str = "vllm"
    generation_dtype: str = "float32"
    train_modules: tuple[str, ...] = TRAIN_MODULES
    heldout_modules: tuple[str, ...] = HELDOUT_MODULES

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must divide into num_heads "
                             f"{self.num_heads}, and num_heads into num_kv_heads "
                             f"{self.num_kv_heads}; change the recipe's shape")
        if self.generator not in GENERATORS:
            raise ValueError(f"generator must be one of {', '.join(GENERATORS)}; "
                             f"got {self.generator!r}")
        if set(self.num_train) - set(KINDS) or min(self.num_train.values(), default=0) < 0:
            raise ValueError(f"num_train maps kinds {', '.join(KINDS)} to counts >= 0; "
                             f"got {self.num_train}")
        if not 0.0 <= self.sampled_fraction <= 1.0 or self.temperature <= 0:
            raise ValueError("sampled_fraction must be in [0, 1] and temperature > 0; got "
                             f"{self.sampled_fraction} and {self.temperature}")
        shared = set(self.train_modules) & set(self.heldout_modules)
        if shared:
            raise ValueError(f"modules {', '.join(sorted(shared))} are both trained on and "
                             "held out; remove them from one list")


FULL = Recipe(
    name="full", hidden_size=192, num_layers=4, intermediate_size=512, num_heads=3,
    num_kv_heads=3, num_train={"edit": 230, "explain": 190, "chat": 180}, num_heldout=16,
    max_new_tokens=256, steps=480, batch_size=4, lr=2e-3, warmup_steps=20,
)
QUICK = Recipe(
    name="quick", hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2,
    num_kv_heads=1, num_train={"edit": 2, "explain": 2, "chat": 2}, num_heldout=1,
    max_new_tokens=12, steps=8, batch_size=2, lr=3e-3, warmup_steps=2, top_k=8,
    max_seq_len=512, generator="transformers",
)


@dataclass
class Sequence:
    """A chat and the target's answer, with the target's top-k at every position."""

    token_ids: torch.Tensor  # [T] int64: prompt then answer
    prompt_len: int
    kind: str
    temperature: float  # 0: greedy
    topk_ids: torch.Tensor  # [T - 1, k] int64: row i predicts token i + 1
    topk_logprobs: torch.Tensor  # [T - 1, k] float32


# ---------------------------------------------------------------- the draft


def principal_embedding(
    embedding: torch.Tensor,  # [V, H_target]
    rank: int,
) -> torch.Tensor:  # [V, rank]
    """The embedding's coordinates on its top ``rank`` right singular vectors (U_r S_r):
    the best rank-``rank`` approximation of token-token inner products (tied logits), via
    the H x H Gram matrix in float64."""
    if rank > embedding.shape[1]:
        raise ValueError(f"draft hidden_size {rank} exceeds the target's {embedding.shape[1]}")
    emb = embedding.double()
    eigvals, eigvecs = torch.linalg.eigh(emb.T @ emb)  # ascending
    top = eigvecs[:, eigvals.argsort(descending=True)[:rank]]  # [H_target, rank]
    return (emb @ top).to(embedding.dtype)


def draft_config(target_config, recipe: Recipe):
    """The target's config (vocabulary, special ids, RoPE, norms) with the recipe's shape."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.hidden_size = recipe.hidden_size
    config.num_hidden_layers = recipe.num_layers
    config.intermediate_size = recipe.intermediate_size
    config.num_attention_heads = recipe.num_heads
    config.num_key_value_heads = recipe.num_kv_heads
    config.head_dim = recipe.hidden_size // recipe.num_heads
    config.tie_word_embeddings = True
    return config


def init_draft(target, recipe: Recipe):
    """A fresh draft whose tied embedding is the target's, projected (``principal_embedding``)."""
    from transformers import LlamaForCausalLM

    if not getattr(target.config, "tie_word_embeddings", False):
        raise ValueError("the target's embeddings are not tied; the draft's projected "
                         "embedding assumes one matrix serves as input and LM head")
    torch.manual_seed(recipe.seed)
    draft = LlamaForCausalLM(draft_config(target.config, recipe))
    with torch.no_grad():
        projected = principal_embedding(target.get_input_embeddings().weight.float(),
                                        recipe.hidden_size)
        draft.get_input_embeddings().weight.copy_(projected)
    draft.tie_weights()
    return draft


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the loss


def topk_kl(
    draft_logits: torch.Tensor,  # [N, V]
    topk_ids: torch.Tensor,  # [N, k]
    topk_logprobs: torch.Tensor,  # [N, k]: the target's, raw
) -> torch.Tensor:  # [N]
    """KL(target || draft) over the target's top k plus one bucket for the rest:
    sum_topk p log(p/q) + p_rest log(p_rest/q_rest), draft normalised over the vocabulary.
    A lower bound on the full KL."""
    draft_logprobs = (draft_logits.gather(1, topk_ids)
                      - torch.logsumexp(draft_logits, dim=-1, keepdim=True))  # [N, k]
    target_probs = topk_logprobs.exp()
    head = (target_probs * (topk_logprobs - draft_logprobs)).sum(-1)
    target_rest = (1.0 - target_probs.sum(-1)).clamp_min(0.0)
    draft_in = torch.logsumexp(draft_logprobs, dim=-1).clamp(max=-1e-6)
    draft_rest_log = torch.log(-torch.expm1(draft_in))
    rest = torch.xlogy(target_rest, target_rest) - target_rest * draft_rest_log
    return head + rest


def _pad(seqs: list[Sequence], max_len: int):
    """Right-padded ids [B, T] and mask [B, T] of the sequences, cut at ``max_len``."""
    length = min(max_len, max(s.token_ids.numel() for s in seqs))
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for row, s in enumerate(seqs):
        n = min(length, s.token_ids.numel())
        ids[row, :n], mask[row, :n] = s.token_ids[:n], 1
    return ids, mask


def batch_loss(draft, seqs: list[Sequence], recipe: Recipe) -> torch.Tensor:
    """Weighted mean of ``topk_kl`` over the batch's positions (LM head on real rows only)."""
    ids, mask = _pad(seqs, recipe.max_seq_len)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    rows, topk_ids, topk_logprobs, weights = [], [], [], []
    for b, s in enumerate(seqs):
        n = int(mask[b].sum()) - 1  # positions with a next token
        rows.append(hidden[b, :n])
        topk_ids.append(s.topk_ids[:n])
        topk_logprobs.append(s.topk_logprobs[:n])
        w = torch.full((n,), recipe.prompt_weight)
        w[max(0, s.prompt_len - 1):] = 1.0  # row prompt_len - 1 predicts the first answer token
        weights.append(w)
    logits = draft.lm_head(torch.cat(rows))  # [N, V]
    kl = topk_kl(logits, torch.cat(topk_ids), torch.cat(topk_logprobs))
    weights = torch.cat(weights)
    return (kl * weights).sum() / weights.sum()


# ---------------------------------------------------------------- the target's answers


@dataclass(frozen=True)
class Request:
    """One chat to answer: its prompt ids and how to sample (temperature 0: greedy)."""

    kind: str
    prompt_ids: tuple[int, ...]
    temperature: float
    seed: int  # transformers samples with it; vLLM with its engine seed (see _vllm_worker)


def plan_requests(chats: list[Chat], tokenizer, recipe: Recipe, sampled: bool) -> list[Request]:
    """Chats through the target's chat template; with ``sampled``, a ``sampled_fraction``
    spread evenly over the list samples at ``recipe.temperature``, the rest are greedy."""
    num_sampled = round(recipe.sampled_fraction * len(chats)) if sampled else 0
    sampled_at = {int((j + 0.5) * len(chats) / num_sampled) for j in range(num_sampled)}
    requests = []
    for i, chat in enumerate(chats):
        ids = tokenizer.apply_chat_template(chat.messages(), add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        temperature = recipe.temperature if i in sampled_at else 0.0
        requests.append(Request(chat.kind, tuple(int(t) for t in ids), temperature,
                                recipe.seed + i))
    return requests


@torch.no_grad()
def answer_with_transformers(target, requests: list[Request], recipe: Recipe,
                             eos_id: int) -> list[Sequence]:
    """The target answers in transformers, one request at a time (tests, ``--quick``); a
    forward pass gives the top-k at every position."""
    seqs = []
    for req in requests:
        prompt = torch.tensor([req.prompt_ids])
        torch.manual_seed(req.seed)
        sample = {"do_sample": True, "temperature": req.temperature, "top_k": 0, "top_p": 1.0}
        out = target.generate(prompt, max_new_tokens=recipe.max_new_tokens, eos_token_id=eos_id,
                              pad_token_id=eos_id, attention_mask=torch.ones_like(prompt),
                              **(sample if req.temperature else {"do_sample": False}))
        token_ids = out[0]
        logits = target(input_ids=token_ids[None, :-1]).logits[0]  # [T - 1, V]
        logprobs, ids = torch.log_softmax(logits.float(), dim=-1).topk(recipe.top_k, dim=-1)
        seqs.append(Sequence(token_ids, len(req.prompt_ids), req.kind, req.temperature,
                             ids, logprobs))
    return seqs


def _flat_topk(flat, k: int, num_rows: int, first: int):
    """vLLM's FlatLogprobs rows ``first..first+num_rows-1`` as ids [R, k], logprobs [R, k]
    (ranks 1..k only; a sampled token outside them is dropped)."""
    import numpy as np

    starts = np.asarray(flat.start_indices[first:first + num_rows])
    ends = np.asarray(flat.end_indices[first:first + num_rows])
    row = np.repeat(np.arange(num_rows), ends - starts)
    index = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
    ranks = np.asarray(flat.ranks, dtype=np.int64)[index]
    keep = (ranks >= 1) & (ranks <= k)
    ids = np.zeros((num_rows, k), dtype=np.int64)
    logprobs = np.full((num_rows, k), np.nan, dtype=np.float32)
    ids[row[keep], ranks[keep] - 1] = np.asarray(flat.token_ids, dtype=np.int64)[index[keep]]
    logprobs[row[keep], ranks[keep] - 1] = np.asarray(flat.logprobs, dtype=np.float32)[index[keep]]
    assert not np.isnan(logprobs).any(), "vLLM returned fewer than top_k log-probabilities"
    return ids, logprobs


def _vllm_worker(target_dir: str, requests: list[Request], recipe: Recipe) -> list[tuple]:
    """In a spawned child: vLLM answers every request with top-k rows (picklable numpy)."""
    import os

    for key, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=target_dir, dtype=recipe.generation_dtype, max_num_seqs=32,
              gpu_memory_utilization=0.1, enforce_eager=True, seed=recipe.seed,
              max_logprobs=recipe.top_k, max_model_len=recipe.max_seq_len + recipe.max_new_tokens)
    # no per-request seed: vLLM 0.32 CPU fails with "CPU Generator does not use offset";
    # the engine's seed keeps the run repeatable
    params = [SamplingParams(temperature=r.temperature, max_tokens=recipe.max_new_tokens, logprobs=recipe.top_k,
                             prompt_logprobs=recipe.top_k, flat_logprobs=True, detokenize=False)
              for r in requests]
    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
    rows = []
    for req, out in zip(requests, llm.generate(prompts, params, use_tqdm=True)):
        answer = list(out.outputs[0].token_ids)
        prompt_ids, prompt_lp = _flat_topk(out.prompt_logprobs, recipe.top_k,
                                           len(req.prompt_ids) - 1, 1)
        answer_ids, answer_lp = _flat_topk(out.outputs[0].logprobs, recipe.top_k, len(answer), 0)
        rows.append((answer, prompt_ids, prompt_lp, answer_ids, answer_lp))
    return rows


def answer_with_vllm(target_dir: Path, requests: list[Request], recipe: Recipe) -> list[Sequence]:
    """``_vllm_worker`` in a spawned process, apart from this one's torch state (the
    caller must be under ``if __name__ == "__main__"``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = pool.submit(_vllm_worker, str(target_dir), requests, recipe).result()
    seqs = []
    for req, (answer, prompt_ids, prompt_lp, answer_ids, answer_lp) in zip(requests, rows):
        token_ids = torch.tensor([*req.prompt_ids, *answer], dtype=torch.long)
        topk_ids = torch.cat([torch.from_numpy(prompt_ids), torch.from_numpy(answer_ids)]).long()
        topk_lp = torch.cat([torch.from_numpy(prompt_lp), torch.from_numpy(answer_lp)])
        assert topk_ids.shape[0] == token_ids.numel() - 1  # P - 1 prompt rows, A answer rows
        seqs.append(Sequence(token_ids, len(req.prompt_ids), req.kind, req.temperature,
                             topk_ids, topk_lp))
    return seqs


# ---------------------------------------------------------------- measuring


@torch.no_grad()
def heldout_measures(target, draft, seqs: list[Sequence]) -> dict:
    """Per kind, over the answer positions of ``seqs`` (teacher-forced): greedy agreement
    and expected acceptance sum_x min(target_probs, draft_probs), token-weighted."""
    sums: dict[str, list[float]] = {}
    for s in seqs:
        inputs = s.token_ids[None, :-1]
        rows = slice(s.prompt_len - 1, None)  # the answer's predictions
        target_probs = torch.softmax(target(input_ids=inputs).logits[0, rows].float(), -1)
        draft_probs = torch.softmax(draft(input_ids=inputs).logits[0, rows].float(), -1)
        agree = (target_probs.argmax(-1) == draft_probs.argmax(-1)).float().sum()
        accept = torch.minimum(target_probs, draft_probs).sum(-1).sum()
        total = sums.setdefault(s.kind, [0.0, 0.0, 0.0])
        total[0] += target_probs.shape[0]
        total[1] += float(agree)
        total[2] += float(accept)
    return {kind: {"positions": int(n), "greedy_agreement": round(a / n, 4),
                   "expected_acceptance": round(x / n, 4)}
            for kind, (n, a, x) in sums.items() if n}


@torch.no_grad()
def forward_ms(model, context_len: int = 256, repeats: int = 20) -> float:
    """Median milliseconds of one batch-1 decode step (KV cache of ``context_len``)."""
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, context_len + 1))
    cache = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(context_len)
    return round(sorted(times[3:])[repeats // 2] * 1e3, 3)


# ---------------------------------------------------------------- the whole run


def _answers(target_dir: Path, target, tokenizer, recipe: Recipe) -> dict[str, list[Sequence]]:
    """Training and held-out sequences: chats built, then answered by the target."""
    train_chats = build_chats(recipe.train_modules, recipe.num_train, False, recipe.seed)
    heldout_chats = build_chats(recipe.heldout_modules, dict.fromkeys(KINDS, recipe.num_heldout),
                                True, recipe.seed + 1)
    train = plan_requests(train_chats, tokenizer, recipe, sampled=True)
    heldout = plan_requests(heldout_chats, tokenizer, recipe, sampled=False)
    if recipe.generator == "vllm":
        seqs = answer_with_vllm(target_dir, train + heldout, recipe)
    else:
        seqs = answer_with_transformers(target, train + heldout, recipe,
                                        _eos_id(target, tokenizer))
    return {"train": seqs[: len(train)], "heldout": seqs[len(train):]}


def _eos_id(target, tokenizer) -> int:
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else int(eos)


def _save_draft(draft, target_dir: Path, out_dir: Path) -> None:
    """fp16 weights, plus the target's tokenizer files and generation_config.json (special
    ids only, so vLLM takes no sampling defaults) copied byte for byte."""
    _save_model(draft, out_dir)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out_dir / name)


def distill(target_dir: Path, out_dir: Path, recipe: Recipe = FULL,
            data_path: Path | None = None, time_budget_s: float | None = None) -> dict:
    """Answer, train, save and measure a draft of ``target_dir`` into ``out_dir``; return
    the report (also ``out_dir/distill.json``). ``data_path``: the target's answers, reused
    when present (they depend only on the target and the recipe's data fields)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {target_dir} (config.json missing)")
    start = time.monotonic()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if data_path is not None and Path(data_path).is_file():
        data = torch.load(data_path, weights_only=False)
    else:
        data = _answers(target_dir, target, tokenizer, recipe)
        if data_path is not None:
            torch.save(data, data_path)
    answered = time.monotonic()

    draft = init_draft(target, recipe)
    init_measures = heldout_measures(target, draft, data["heldout"])
    train_seqs = data["train"]

    def next_batch(gen: torch.Generator) -> list[Sequence]:
        return [train_seqs[i] for i in torch.randint(len(train_seqs), (recipe.batch_size,),
                                                     generator=gen).tolist()]

    deadline = time.monotonic() + (time_budget_s or float("inf"))
    trained = time.monotonic()
    steps_done = _train_loop(draft, lambda batch: batch_loss(draft, batch, recipe), recipe,
                             recipe.steps, next_batch, deadline, "draft (distilled)")
    trained = time.monotonic() - trained
    draft.eval()
    _save_draft(draft, target_dir, out_dir)  # fp16 on disk: measured as saved
    report = _report(recipe, target, draft, data, steps_done, init_measures,
                     {"answers_s": round(answered - start, 1), "training_s": round(trained, 1)})
    report["seconds"]["total_s"] = round(time.monotonic() - start, 1)
    (out_dir / "distill.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _report(recipe: Recipe, target, draft, data: dict, steps_done: int, init_measures: dict,
            seconds: dict) -> dict:
    train = data["train"]
    answer_tokens = sum(s.token_ids.numel() - s.prompt_len for s in train)
    prompt_tokens = sum(s.prompt_len for s in train)
    mean_len = (answer_tokens + prompt_tokens) / max(1, len(train))
    return {
        "recipe": asdict(recipe),
        "seed": recipe.seed,
        "torch_threads": torch.get_num_threads(),
        "shape": {"hidden_size": recipe.hidden_size, "num_layers": recipe.num_layers,
                  "intermediate_size": recipe.intermediate_size, "num_heads": recipe.num_heads,
                  "num_kv_heads": recipe.num_kv_heads, "vocab_size": draft.config.vocab_size},
        "params": {"draft": num_params(draft), "target": num_params(target),
                   "ratio": round(num_params(draft) / num_params(target), 4)},
        "train_sequences": {k: sum(s.kind == k for s in train) for k in KINDS},
        "sampled_sequences": sum(s.temperature > 0 for s in train),
        "train_tokens": {"answer": answer_tokens, "prompt": prompt_tokens,
                         "seen_approx": int(steps_done * recipe.batch_size * mean_len)},
        "steps_done": steps_done,
        "heldout": {"init": init_measures,
                    "trained": heldout_measures(target, draft, data["heldout"])},
        "forward_ms_transformers_b1": {"draft": forward_ms(draft), "target": forward_ms(target)},
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the target's HF folder")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the draft to")
    parser.add_argument("--quick", action="store_true", help="a tiny draft in seconds (tests)")
    parser.add_argument("--data", type=Path, default=None,
                        help="file keeping the target's answers; reused when it exists")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of training at most (stops early, not bit-repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = distill(args.target, args.out, QUICK if args.quick else FULL, args.data,
                     args.time_budget)
    print(json.dumps({k: report[k] for k in ("params", "heldout", "seconds")}, indent=2))
    return report


if __name__ == "__main__":
    main()

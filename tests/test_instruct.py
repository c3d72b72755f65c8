"""Instruct workloads (``specplugin.bench.instruct``) and the pair families that pick them:
chats through a chat template, built without vLLM. A stand-in tokenizer with a chat
template (byte-level, built here in milliseconds) plays the real model's; one test
renders with SmolLM2's own when ``specplugin zoo fetch smollm2`` has run."""

import json
import re

import pytest

from specplugin.bench.engine import sampling_kwargs
from specplugin.bench.families import CODE_WINDOWS, INSTRUCT, family_for
from specplugin.bench.instruct import (DEAL_ORDER, INSTRUCT_HEADLINE, INSTRUCT_QUICK,
                                       INSTRUCT_SIZES, INSTRUCT_WORKLOADS, InstructSource,
                                       cell_messages, cell_prompts, chat_renderer,
                                       material_from_stdlib)
from specplugin.bench.runner import cell_payload
from specplugin.bench.workloads import Cell

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERATION_PROMPT = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level tokenizer with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([], trainers.BpeTrainer(
        vocab_size=260, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core, chat_template=TEMPLATE,
                                   eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def material():
    return material_from_stdlib()


@pytest.fixture(scope="module")
def source(material, tokenizer):
    return InstructSource(material, chat_renderer(tokenizer))


def _contents(material, cell, seed=0, sizes=INSTRUCT_SIZES):
    return [chat[-1]["content"] for chat in cell_messages(material, sizes, cell, seed)]


@pytest.mark.parametrize("workload", list(INSTRUCT_WORKLOADS))
def test_every_prompt_is_one_user_turn_through_the_chat_template(source, tokenizer, workload):
    cell = Cell(workload, 8, 0.0)
    cp = cell_prompts(source, INSTRUCT_SIZES, cell)
    chats = cell_messages(source.material, INSTRUCT_SIZES, cell)
    assert len(cp.prompts) == len(chats) == 8
    for ids, chat in zip(cp.prompts, chats):
        text = tokenizer.decode(list(ids))
        assert text == f"<|im_start|>user\n{chat[0]['content']}{GENERATION_PROMPT}"
        # the template's special tokens are single ids, as the model was trained on them
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert ids.count(tokenizer.eos_token_id) == 1


def test_code_edit_quotes_a_whole_stdlib_function_and_asks_for_one_change(material):
    functions = {f.code: f for f in material.functions}
    contents = _contents(material, Cell("code-edit", 32, 0.0))
    kinds = set()
    for content in contents:
        (code,) = re.findall(r"```python\n(.*?)```", content, re.S)
        function = functions[code]  # quoted whole, as ast found it
        assert 8 <= len(code.splitlines()) <= 40
        assert "whole" in content or "complete" in content or "full" in content
        rename = re.search(r"Rename the (parameter|local variable) `(\w+)` to `(\w+)`", content)
        if rename:
            kind, old, new = rename.groups()
            assert old in (function.params if kind == "parameter" else function.local_names)
            assert not re.search(rf"\b{new}\b", code)  # a name the function does not use
            kinds.add("rename")
        elif "type hints" in content:
            assert not function.annotated
            kinds.add("type-hints")
        else:
            assert "docstring" in content and not function.has_docstring
            kinds.add("docstring")
    assert kinds == {"rename", "type-hints", "docstring"}


def test_explain_alternates_code_and_documentation_and_chat_asks_the_questions(material):
    explain = _contents(material, Cell("explain", 8, 0.0))
    assert ["```python" in c for c in explain] == [True, False] * 4
    assert all("documentation" in c for c in explain[1::2])
    chat = _contents(material, Cell("chat", 8, 0.0))
    assert set(chat) <= set(material.questions) and len(set(chat)) == 8


def test_chat_mix_interleaves_the_kinds_half_greedy(source):
    cp = cell_prompts(source, INSTRUCT_SIZES, Cell("chat-mix", 8, 1.0))
    contents = _contents(source.material, Cell("chat-mix", 8, 1.0))
    kinds = ["code-edit" if "Rename" in c or "type hints" in c or "Add a docstring" in c
             else "chat" if c in source.material.questions else "explain" for c in contents]
    assert kinds == ["code-edit", "explain", "chat"] * 2 + ["code-edit", "explain"]
    assert cp.temperatures == (0.0, 0.0, 1.0, 1.0) * 2


def test_prompts_are_deterministic_by_seed_and_differ_across_seeds_and_cells(source):
    cell = Cell("code-edit", 1, 0.0)
    assert cell_prompts(source, INSTRUCT_SIZES, cell) == cell_prompts(source, INSTRUCT_SIZES, cell)
    assert (cell_prompts(source, INSTRUCT_SIZES, cell, base_seed=1).prompts
            != cell_prompts(source, INSTRUCT_SIZES, cell).prompts)
    assert (cell_prompts(source, INSTRUCT_SIZES, Cell("code-edit", 1, 1.0)).prompts
            != cell_prompts(source, INSTRUCT_SIZES, cell).prompts)

    def quoted(seed):
        return [re.findall(r"```python\n(.*?)```", c, re.S)
                for c in _contents(source.material, Cell("code-edit", 8, 0.0), seed)]

    assert quoted(1) != quoted(0)  # another seed deals other functions, not only other words


@pytest.mark.parametrize("seed", [0, 3])
def test_headline_cells_share_no_function_passage_or_question(material, seed):
    """A proposer that learns across requests (vLLM's suffix) must not find an earlier
    cell's answer: each headline cell is dealt its own hand of every deck."""
    items = ([f.code for f in material.functions] + [t for _, t in material.texts]
             + list(material.questions))
    seen: dict[str, str] = {}
    for cell in INSTRUCT_HEADLINE:
        for content in _contents(material, cell, seed):
            (item,) = [i for i in items if i in content and (i not in material.questions
                                                             or i == content)]
            assert item not in seen, f"{cell.key} repeats material of {seen.get(item)}"
            seen[item] = cell.key
    assert DEAL_ORDER[: len(INSTRUCT_HEADLINE)] == INSTRUCT_HEADLINE


def test_instruct_cells_stop_at_eos_and_token_windows_ignore_it(source):
    """The engine's SamplingParams: an instruct request ends at EOS, capped at its
    workload's max_tokens; a token window makes exactly max_tokens (ignore_eos)."""
    cp = cell_prompts(source, INSTRUCT_SIZES, Cell("chat", 1, 1.0))
    params = sampling_kwargs(cell_payload(cp))
    assert params["ignore_eos"] is False
    assert params["max_tokens"] == INSTRUCT_WORKLOADS["chat"].max_tokens == cp.max_tokens
    window = {"temperature": 0.0, "max_tokens": 32, "prompts": [[1, 2]]}
    assert sampling_kwargs(window)["ignore_eos"] is True  # a cell without the key: as before
    assert sampling_kwargs({**window, "ignore_eos": True})["ignore_eos"] is True
    # the warm-up makes its 16 tokens whatever the cell's rule
    assert sampling_kwargs(cell_payload(cp), max_tokens=16, ignore_eos=True)["ignore_eos"]


def test_the_warm_up_makes_16_tokens_of_a_reversed_prompt_whatever_the_eos_rule(
        source, monkeypatch):
    """A reversed chat may end at once: the warm-up ignores EOS, so the spec path runs
    before timing; its prompt is no real one, so a suffix cache learns no real answer."""
    from specplugin.bench import engine

    calls = []
    monkeypatch.setattr(engine, "_sampling", lambda cell, max_tokens=None, ignore_eos=None:
                        sampling_kwargs(cell, max_tokens, ignore_eos))
    monkeypatch.setattr(engine, "_generate", lambda llm, prompts, params:
                        calls.append((prompts, params)))
    payload = cell_payload(cell_prompts(source, INSTRUCT_SIZES, Cell("chat-mix", 8, 1.0)))
    engine.warm_up(None, [payload])
    assert [p["temperature"] for _, p in calls] == [0.0, 1.0]  # every temperature it runs
    for prompts, params in calls:
        assert params["ignore_eos"] is True and params["max_tokens"] == 16
        assert prompts == [payload["prompts"][0][::-1]] * 8


def test_quick_sizes_cap_max_tokens_and_requests(source):
    quick = INSTRUCT.quick_sizes
    cp = cell_prompts(source, quick, INSTRUCT_QUICK[0])
    assert len(cp.prompts) == quick.min_requests and cp.max_tokens == quick.max_tokens_cap
    assert [INSTRUCT_SIZES.num_batches(b) * b for b in (1, 8, 32)] == [6, 8, 32]


def _instruct_pair(tokenizer, root, jinja: bool):
    (root / "target").mkdir(parents=True)
    tokenizer.save_pretrained(root / "target", save_jinja_files=jinja)
    return root


@pytest.mark.parametrize("jinja", [True, False], ids=["chat_template.jinja", "tokenizer_config"])
def test_a_pair_whose_tokenizer_has_a_chat_template_is_an_instruct_pair(tokenizer, tmp_path,
                                                                        zoo_root, jinja):
    pair = _instruct_pair(tokenizer, tmp_path / "pair", jinja)
    assert family_for(pair) is INSTRUCT and INSTRUCT.dtype == "auto"
    assert family_for(zoo_root) is CODE_WINDOWS and CODE_WINDOWS.dtype == "float32"
    config = json.loads((pair / "target" / "tokenizer_config.json").read_text())
    assert ("chat_template" in config) != jinja


def test_build_cells_gives_an_instruct_pair_its_headline_by_default(tokenizer, tmp_path):
    from specplugin.bench.cli import build_cells

    pair = _instruct_pair(tokenizer, tmp_path / "pair", jinja=True)
    cells, _ = build_cells(pair, [], False)
    assert [cp.cell for cp in cells] == list(INSTRUCT_HEADLINE)
    assert all(not cp.ignore_eos for cp in cells)
    cells, _ = build_cells(pair, [], True)
    assert [cp.cell for cp in cells] == list(INSTRUCT_QUICK)
    cells, _ = build_cells(pair, ["chat"], False)  # a workload named: all its cells
    assert [cp.cell.key for cp in cells] == [f"chat/b{b}/t{t}" for b in (1, 8, 32)
                                             for t in (0, 1)]
    with pytest.raises(ValueError, match="instruct: code-edit, explain, chat, chat-mix"):
        build_cells(pair, ["edit"], False)


def test_the_real_models_template_renders_a_chatml_turn():
    """SmolLM2-135M-Instruct's own tokenizer (``specplugin zoo fetch smollm2``)."""
    smollm2 = pytest.importorskip("specplugin.zoo.smollm2")

    # (not zoo.pair_root("smollm2"), which would fetch the model when it is missing)
    target = smollm2.default_cache_root() / smollm2.PAIR_NAME / "target"
    if not smollm2.is_complete(target):
        pytest.skip(f"no SmolLM2 model at {target}: run `specplugin zoo fetch smollm2`")
    source = INSTRUCT.load_source(target.parent)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    cp = cell_prompts(source, INSTRUCT_SIZES, Cell("code-edit", 1, 0.0))
    for ids in cp.prompts:
        text = tokenizer.decode(list(ids))
        assert text.startswith("<|im_start|>system\n") and text.endswith(GENERATION_PROMPT)
        assert "<|im_start|>user\n" in text and "```python\n" in text
        assert list(ids).count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2

"""``specplugin demo``: its prompts and its argument checks (fast, no engine)."""

import pytest

from specplugin import cli
from specplugin.bench.instruct import InstructSource, material_from_stdlib
from specplugin.demo import demo_chats, union_settings


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be an integer of at least 1; got '0'"),
    (["--num-prompts", "two"], "--num-prompts must be an integer of at least 1; got 'two'"),
    (["--batch-sizes", "0"], "--batch-sizes must be comma-separated integers of at least 1"),
    (["--batch-sizes", "1,,8"], "--batch-sizes must be comma-separated integers"),
    (["--max-tokens", "-1"], "--max-tokens must be an integer of at least 1; got '-1'"),
    (["-k", "0"], "--num-speculative-tokens must be an integer from 1 to 32; got '0'"),
    (["-k", "33"], "--num-speculative-tokens must be an integer from 1 to 32; got '33'"),
])
def test_bad_values_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_chats_take_the_three_kinds_in_turn_and_never_repeat_material():
    material = material_from_stdlib()
    chats = demo_chats(InstructSource(material, render=None), 7)
    assert [kind for kind, _ in chats] == ["code-edit", "explain", "chat"] * 2 + ["code-edit"]
    contents = [chat[-1]["content"] for _, chat in chats]
    assert len(set(contents)) == 7
    assert contents[2] in material.questions  # an open question, as asked
    assert "```python" in contents[0]  # an edit quotes the function it changes


def test_the_union_uses_the_draft_model_only_when_the_pair_has_one(tmp_path):
    assert union_settings(tmp_path) == {"proposers": ["ngram", "suffix"]}
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    assert union_settings(tmp_path) == {"proposers": ["draft", "ngram", "suffix"],
                                        "draft_model": str(tmp_path / "draft")}

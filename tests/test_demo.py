"""``specplugin demo``: its prompts and its argument checks (fast, no engine)."""

import pytest

from specplugin import cli
from specplugin.demo import (COPY_SEPARATOR, SIGNATURE, batch_sizes, demo_prompts, restart_of,
                             signature_window)


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be an integer at least 1; got 0"),
    (["--num-prompts", "two"], "--num-prompts must be an integer at least 1; got 'two'"),
    (["--batch-sizes", "0"], "every --batch-sizes entry must be an integer at least 1; got 0"),
    (["--batch-sizes", "1,,8"], "--batch-sizes must be comma-separated integers"),
    (["--max-tokens", "-1"], "--max-tokens must be an integer at least 1; got -1"),
    (["-k", "0"], "--num-speculative-tokens must be an integer from 1 to 32; got 0"),
    (["-k", "33"], "--num-speculative-tokens must be an integer from 1 to 32; got 33"),
])
def test_bad_values_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_batch_sizes_parse():
    assert batch_sizes("1,8") == [1, 8]
    assert batch_sizes(" 4 ") == [4]


def test_more_prompts_than_held_out_files_is_refused_before_any_engine(zoo_root, capsys):
    assert cli.main(["demo", "--zoo", str(zoo_root), "--num-prompts", "1000"]) == 2
    assert "--num-prompts must be at most" in capsys.readouterr().out


def test_a_window_ends_on_a_signature_line_without_its_newline():
    text = "def f(a):\n    return a\n" + "y = 2\n" * 20 + "class C:\n    pass\n" + "z\n" * 40
    window = signature_window(text, max_chars=60)
    assert window.endswith("y = 2\nclass C:")  # the first signature past the first third
    assert len(window) <= 60 and window.startswith("y = 2")  # whole lines
    assert signature_window("x = 1\n" * 40, 60) is None


def test_prompts_alternate_edits_and_continuations_ending_where_the_model_writes_code(zoo_root):
    prompts = demo_prompts(zoo_root, 4)
    assert [p.kind for p in prompts] == ["edit", "continuation", "edit", "continuation"]
    assert len({p.file for p in prompts}) == 4
    for p in prompts:
        if p.kind == "continuation":
            last = p.text.splitlines()[-1]
            assert SIGNATURE.fullmatch(last), last
        else:
            window, restart = p.text.split(COPY_SEPARATOR)
            assert window.startswith(restart) and restart == restart_of(window)


def test_an_edit_restarts_on_whole_lines():
    assert restart_of("import os\nimport sys\n" + "x" * 100) == "import os\nimport sys"
    assert restart_of("y" * 100 + "\nz") == "y" * 100  # at least the first line

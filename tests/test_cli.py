"""The ``specplugin`` command imports only the module of the subcommand being run."""

import sys

import pytest

from specplugin import cli


def test_help_lists_every_subcommand_without_importing_any(monkeypatch, capsys):
    for module, _ in cli.SUBCOMMANDS.values():
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, (_, help_text) in cli.SUBCOMMANDS.items():
        assert name in out and help_text in out


def test_a_broken_subcommand_module_breaks_only_its_own_command(monkeypatch, tmp_path, capsys,
                                                                 zoo_root):
    (tmp_path / "specplugin_broken_command.py").write_text(
        "raise RuntimeError('this subcommand module is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", ("specplugin_broken_command", "broken"))
    assert cli.main(["zoo", "path", "target", "--root", str(zoo_root)]) == 0
    assert capsys.readouterr().out.strip() == str(zoo_root / "target")
    with pytest.raises(RuntimeError, match="is broken"):
        cli.main(["bench", "--quick"])


def test_the_subcommand_is_the_first_argument_that_is_not_an_option():
    assert cli.requested(["demo", "--num-prompts", "2"]) == "demo"
    assert cli.requested(["-h"]) is None
    assert cli.requested([]) is None


def test_integer_options_parse_and_name_themselves_when_refused():
    import argparse

    assert cli.int_list_option("--batch-sizes", 1)("1,8") == [1, 8]
    assert cli.int_list_option("--batch-sizes", 1)(" 4 ,4") == [4]  # repeats dropped
    assert cli.int_option("-k", 1, 32)("32") == 32
    with pytest.raises(argparse.ArgumentTypeError, match="-k must be an integer from 1 to 32"):
        cli.int_option("-k", 1, 32)("33")

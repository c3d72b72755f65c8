"""``specplugin cost-curve``: the table, plot and JSON from made-up timings, the worker's
timing call against a fake vLLM runner, the child's job kind (fast, no engine), and one
real eager run on the committed zoo target (slow, marked ``vllm``)."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specplugin import cli
from specplugin.bench import costcurve, engine
from specplugin.bench.costcurve import Point, ms_per_extra_token

# 1 row: 10 ms, +1 ms per extra token; 8 rows: 12 ms, +0.5 ms per extra token
FAKE = [Point(1, 1, 0.010), Point(1, 4, 0.013), Point(8, 1, 0.012), Point(8, 4, 0.024)]


def test_ms_per_extra_token_is_relative_to_one_token_per_row_at_the_same_rows():
    assert [ms_per_extra_token(p, FAKE) for p in FAKE] == pytest.approx([None, 1.0, None, 0.5])
    assert ms_per_extra_token(Point(8, 4, 0.024), FAKE[:2]) is None  # no 8-row, 1-token point


def test_table_plot_and_json(tmp_path, capsys):
    costcurve.print_table(FAKE, title="cost test")
    out = capsys.readouterr().out
    assert "cost test" in out and "ms/extra token" in out
    lines = [line for line in out.splitlines() if "24.00" in line]
    assert len(lines) == 1 and all(v in lines[0] for v in ("8", "4", "32", "0.500"))
    meta = {"context_len": 256, "eager": True, "machine": {"processor": "cpu", "cpu_count": 2}}
    png = costcurve.plot(FAKE, costcurve.title_of(meta), tmp_path / "c.png")
    assert png.stat().st_size > 1000
    data = json.loads(costcurve.write_json(FAKE, meta, tmp_path / "c.json").read_text())
    assert data["meta"] == meta
    assert data["points"][3] == pytest.approx({"rows": 8, "query_len": 4, "seconds": 0.024,
                                               "num_tokens": 32, "ms": 24.0,
                                               "ms_per_extra_token": 0.5})


def test_every_shape_becomes_a_cell_and_comes_back_in_table_order():
    cells = costcurve.shape_cells([1, 8], [1, 4], context_len=256, repeats=5)
    assert [(c["rows"], c["query_len"]) for c in cells] == [(1, 1), (1, 4), (8, 1), (8, 4)]
    assert {c["context_len"] for c in cells} == {256} and {c["repeats"] for c in cells} == {5}
    reported = {c["key"]: {"seconds": 0.001 * i} for i, c in enumerate(reversed(cells))}
    points = costcurve.points_from(reported, [1, 8], [1, 4])
    assert [(p.rows, p.query_len, p.seconds) for p in points] == [
        (1, 1, 0.003), (1, 4, 0.002), (8, 1, 0.001), (8, 4, 0.0)]


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "--rows must be comma-separated integers of at least 1"),
    (["--rows", "1,,8"], "--rows must be comma-separated integers of at least 1"),
    (["--query-lens", "x"], "--query-lens must be comma-separated integers of at least 1"),
    (["--context-len", "-1"], "--context-len must be an integer of at least 0; got '-1'"),
    (["--repeats", "0"], "--repeats must be an integer of at least 1; got '0'"),
])
def test_bad_values_are_refused_naming_the_option(argv, message, capsys, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError(f"{argv} got past argparse and started an engine")

    monkeypatch.setattr("specplugin.bench.runner.run_job", no_engine)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["cost-curve", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_child_asks_the_worker_to_time_each_shape():
    calls = []

    class FakeLLM:
        def collective_rpc(self, method, args=()):
            calls.append((method, args))
            return [0.002, 0.003]  # two workers: the step waits for the slower

    events = []
    job = {"kind": "forward_times", "cells": costcurve.shape_cells([2], [1, 3], 64, 4)}
    engine.JOB_KINDS[job["kind"]](FakeLLM(), job, events.append)
    assert calls == [("time_forward", (2, 1, 64, 4)), ("time_forward", (2, 3, 64, 4))]
    assert events == [{"event": "cell", "key": "r2-q1", "seconds": 0.003},
                      {"event": "cell", "key": "r2-q3", "seconds": 0.003}]


# ---------------------------------------------------------------- the worker's timing


def _fake_runner(sleeps=(0.0,)):
    """PluginRunnerMixin over a stand-in for vLLM's runner that records its dummy runs."""
    from specplugin.vllm_layer.worker import PluginRunnerMixin

    class FakeRunner(PluginRunnerMixin):
        uniform_decode_query_len = 9  # vLLM's: 1 + num_speculative_tokens
        speculative_config = "the engine's"
        scheduler_config = SimpleNamespace(max_num_seqs=256)
        max_num_tokens = 2048
        max_model_len = 1024

        def __init__(self):
            self.dummy_runs, self.logit_rows = [], []
            self.sleeps = list(sleeps)
            self.model = SimpleNamespace(compute_logits=lambda h: self.logit_rows.append(len(h)))

        def _dummy_run(self, num_tokens, **kwargs):
            self.dummy_runs.append(dict(kwargs, num_tokens=num_tokens,
                                        query_len=self.uniform_decode_query_len,
                                        speculative_config=self.speculative_config))
            time.sleep(self.sleeps.pop(0) if len(self.sleeps) > 1 else self.sleeps[0])
            hidden_states = torch.zeros(num_tokens, 4)  # [num_tokens, hidden_size]
            return hidden_states, hidden_states[:1]

        def _sync_device(self):
            pass

    return FakeRunner()


def test_time_forward_runs_attention_over_the_context_for_rows_of_query_tokens():
    runner = _fake_runner()
    runner.time_forward(rows=8, query_len=4, context_len=256, repeats=2)
    assert len(runner.dummy_runs) == 3  # one discarded, then the repeats
    assert runner.dummy_runs[0] == {
        "num_tokens": 32, "force_attention": True, "uniform_decode": True,
        "profile_seq_lens": 256 + 4, "query_len": 4, "speculative_config": None}
    assert runner.logit_rows == [32] * 3  # every query token's logits, as in verification
    # vLLM's own settings are back for the engine's real steps
    assert runner.uniform_decode_query_len == 9 and runner.speculative_config == "the engine's"


def test_time_forward_keeps_the_fastest_repeat_never_the_discarded_first_run():
    seconds = _fake_runner(sleeps=(0.0, 0.05, 0.02, 0.05)).time_forward(1, 1, 0, repeats=3)
    assert 0.02 <= seconds < 0.05


def test_time_forward_restores_vllms_settings_when_a_run_fails():
    runner = _fake_runner()
    runner.model = SimpleNamespace(compute_logits=lambda h: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.time_forward(1, 4, 16, repeats=1)
    assert runner.uniform_decode_query_len == 9 and runner.speculative_config == "the engine's"


@pytest.mark.parametrize("shape, message", [
    ((0, 1, 0), "rows, query_len and repeats >= 1"),
    ((300, 1, 0), "over the engine's max_num_seqs (256)"),
    ((128, 32, 0), "over the engine's max_num_batched_tokens (2048)"),
    ((1, 32, 1000), "over the engine's max_model_len (1024)"),
])
def test_time_forward_refuses_shapes_the_engine_cannot_run(shape, message):
    runner = _fake_runner()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner.time_forward(*shape, repeats=1)
    assert runner.dummy_runs == []


def test_calibration_times_what_a_speculative_step_runs_through_the_same_timing():
    from specplugin.vllm_layer.worker import CALIBRATION_CONTEXT_LEN

    runner = _fake_runner()
    calibrated = []
    runner.drafter = SimpleNamespace(calibrate=lambda n, s: calibrated.append((list(n), list(s))))
    runner.calibrate_step_cost(repeats=1)
    # one row's query first (up to 8 of the 1 + K = 9 tokens), then rows of 8
    shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]
    assert [(r["num_tokens"] // r["query_len"], r["query_len"])
            for r in runner.dummy_runs[::2]] == shapes
    assert {r["profile_seq_lens"] - r["query_len"] for r in runner.dummy_runs} == {
        CALIBRATION_CONTEXT_LEN}
    assert {r["force_attention"] for r in runner.dummy_runs} == {True}
    assert calibrated[0][0] == [1, 2, 4, 8, 16, 32, 64] and len(calibrated[0][1]) == 7


def test_a_batch_1_engine_calibrates_up_to_its_verified_tokens_not_one_knot():
    """max_num_seqs=1 once gave the single knot {1: T}, and the cost model priced
    verifying n tokens at n plain steps: the controller never drafted."""
    runner = _fake_runner()
    runner.scheduler_config = SimpleNamespace(max_num_seqs=1)
    calibrated = []
    runner.drafter = SimpleNamespace(calibrate=lambda n, s: calibrated.append(list(n)))
    runner.calibrate_step_cost(repeats=1)
    assert calibrated == [[1, 2, 4, 8]]
    assert {r["num_tokens"] // r["query_len"] for r in runner.dummy_runs} == {1}


@pytest.mark.parametrize("max_rows, max_query_len, max_tokens, shapes", [
    (1, 9, 2048, [(1, 1), (1, 2), (1, 4), (1, 8)]),
    (3, 9, 2048, [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]),
    (256, 2, 2048, [(1, 1), (1, 2), (2, 2), (4, 2), (8, 2), (16, 2), (32, 2)]),
    (256, 9, 16, [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]),
])
def test_calibration_shapes_stay_within_the_engine(max_rows, max_query_len, max_tokens, shapes):
    from specplugin.adaptive.cost import calibration_shapes

    assert calibration_shapes(max_rows, max_query_len, max_tokens) == shapes


def test_one_timed_point_prices_verification_flat_not_as_plain_steps():
    from specplugin.adaptive.cost import StepCostModel

    model = StepCostModel(max_tokens=64)
    model.calibrate(np.array([1]), np.array([0.02]))
    assert model.step_one(9) == pytest.approx(model.step_one(1))


# ---------------------------------------------------------------- one real engine


@pytest.mark.vllm
def test_cost_curve_times_every_shape_on_real_vllm(zoo_root, tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, "-m", "specplugin.cli", "cost-curve", "--eager", "--zoo", str(zoo_root),
         "--rows", "1,8", "--query-lens", "1,8", "--repeats", "3", "--json", str(out),
         "--out-dir", str(tmp_path / "cc")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ms/extra token" in proc.stdout  # the table went to stdout
    assert (tmp_path / "cc" / "cost-curve.png").stat().st_size > 1000
    data = json.loads(out.read_text())
    ms = {(p["rows"], p["query_len"]): p["ms"] for p in data["points"]}
    assert set(ms) == {(1, 1), (1, 8), (8, 1), (8, 8)}
    assert all(t > 0 for t in ms.values())
    assert ms[(8, 8)] >= ms[(8, 1)], ms  # 64 query tokens are not cheaper than 8
    assert data["meta"]["eager"] is True and data["meta"]["context_len"] == 256

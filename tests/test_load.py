"""``specplugin load``: the server command line it builds from the bench's engine
arguments, the dataset it hands ``vllm bench serve``, and its report. The load run
itself (minutes of serving) is a command, not part of the suite; tests/test_serve.py
runs its small version (a few streaming clients, one fault) against a real server."""

import json
from types import SimpleNamespace

from specplugin.bench import load
from specplugin.bench.methods import METHODS, Models


def test_server_flags_carry_every_engine_argument_the_bench_uses():
    models = Models(target="/m/target", draft="/m/draft")
    kwargs = METHODS["plugin-union"].engine_kwargs(models)
    args = load.serve_args("/m/target", 8123, kwargs, eager=True)
    assert args[1:3] == ["serve", "/m/target"] and "--enforce-eager" in args
    assert args[args.index("--dtype") + 1] == "float32"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["model"] == "specplugin.Speculator"
    extra = json.loads(args[args.index("--additional-config") + 1])
    assert extra["specplugin"]["draft_model"] == "/m/draft"
    plain = load.serve_args("/m/target", 8123, METHODS["none"].engine_kwargs(models), False)
    assert "--speculative-config" not in plain and "--enforce-eager" not in plain


def test_the_dataset_is_mixed_prompts_as_text_with_a_fixed_output_length(zoo_root, tmp_path):
    path = load.write_dataset(zoo_root, tmp_path / "p.jsonl", 6, 32)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 6 and all(r["output_tokens"] == 32 and r["prompt"] for r in rows)
    assert len({r["prompt"] for r in rows}) == 6


def test_metrics_are_summed_by_exact_name():
    text = ('vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
            'vllm:kv_cache_usage_perc_other 7\n'
            'vllm:specplugin_proposer_failures_total{proposer="ngram"} 3.0\n'
            'vllm:specplugin_proposer_failures_total{proposer="union"} 1.0\n')
    assert load.metric_sum(text, "vllm:kv_cache_usage_perc") == 0.25
    assert load.metric_sum(text, "vllm:specplugin_proposer_failures_total") == 4.0
    assert load.metric_sum(text, "vllm:absent") is None


def test_the_report_compares_with_no_speculation_and_the_builtin(capsys):
    from specplugin.bench.report import stdout_console

    results = [load.LoadResult("none", 10, 0, 5.0, 100.0, ["a", "b", "c"]),
               load.LoadResult("plugin-union", 10, 0, 4.0, 150.0, ["a", "b", "x"]),
               load.LoadResult("vllm-suffix", 10, 0, 4.5, 120.0, ["a", "b", "c"],
                               plugin_failures=None, kv_usage_after=0.0)]
    load.print_results(results, 3, stdout_console())
    out = capsys.readouterr().out
    assert "1.50x" in out and "1.25x" in out and "2/3" in out and "3/3" in out
    args = SimpleNamespace(num_prompts=10)
    assert all(r.completed == args.num_prompts for r in results)


def test_a_soak_mixes_lengths_temperatures_options_and_clients_that_leave():
    from specplugin.bench.soak import soak_bodies

    items = list(soak_bodies("m", ["a", "b", "c"], 400, leave_share=0.1))
    bodies = [b for b, _ in items]
    assert len(items) == 400 and [b["prompt"] for b in bodies[:4]] == ["a", "b", "c", "a"]
    assert len({b["max_tokens"] for b in bodies}) > 50
    assert {b["temperature"] for b in bodies} == {0.0, 0.7, 1.0}
    assert {json.dumps(b.get("vllm_xargs")) for b in bodies} >= {
        "null", '{"specplugin_max_k": 0}', '{"specplugin_proposers": "ngram"}'}
    leaving = [n for _, n in items if n is not None]
    assert 20 < len(leaving) < 60 and all(1 <= n <= 4 for n in leaving)
    assert list(soak_bodies("m", ["a"], 50, 0.1)) == list(soak_bodies("m", ["a"], 50, 0.1))
    # the control without the plugin: the same requests, none of its options (refused there)
    plain = list(soak_bodies("m", ["a", "b", "c"], 400, leave_share=0.1, options=False))
    assert all("vllm_xargs" not in b for b, _ in plain)
    assert [(b["max_tokens"], n) for b, n in plain] == [(b["max_tokens"], n) for b, n in items]


def test_rss_growth_compares_the_end_with_the_baseline_after_n_requests(tmp_path):
    from specplugin.bench.soak import plot, rss_growth

    by_process = {"vllm (1)": [[0, 400.0], [5, 400.0], [10, 400.0], [15, 400.0]],
                  "VLLM::Worker (2)": [[0, 500.0], [5, 600.0], [10, 610.0], [15, 650.0]]}
    sampler = SimpleNamespace(rss_mb=[[0, 900.0], [5, 1000.0], [10, 1010.0], [15, 1050.0]],
                              completed=[[0, 0], [5, 400], [10, 1200], [15, 2000]],
                              by_process=by_process)
    growth = rss_growth(sampler, 1000)
    assert growth["rss_baseline_mb"] == 1010.0 and growth["rss_end_mb"] == 1050.0
    assert abs(growth["rss_growth"] - 40 / 1010) < 1e-9
    assert growth["rss_slope_mb_per_1000"] == 50.0  # (1010 -> 1050 over 800 requests)
    assert growth["rss_growth_by_process"] == {  # which process grew
        "vllm (1)": {"baseline_mb": 400.0, "end_mb": 400.0, "slope_mb_per_1000": 0.0},
        "VLLM::Worker (2)": {"baseline_mb": 610.0, "end_mb": 650.0, "slope_mb_per_1000": 50.0}}
    report = {"requests": 2000, "concurrency": 64, "rss_mb": sampler.rss_mb,
              "rss_mb_by_process": by_process, "tracked_requests": [[0, 0], [5, 64], [15, 0]]}
    plot(report, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 0

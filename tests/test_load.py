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
    assert load._sum_metric(text, "vllm:kv_cache_usage_perc") == 0.25
    assert load._sum_metric(text, "vllm:specplugin_proposer_failures_total") == 4.0
    assert load._sum_metric(text, "vllm:absent") is None


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

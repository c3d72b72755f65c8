"""`vllm serve` (the stock console script, two API server processes) with the plugin:
completions, per-request options, metrics, the batch-expanding scorer, faults (a proposer
failing every 3rd call, a client leaving mid-stream) under a few concurrent streaming
clients, a small soak and a storm of aborts, start-up errors. The full load runs (64
clients, 2,000 or 20,000 requests) are ``specplugin load``, not part of the suite."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specplugin.bench.load import free_port, wait_healthy
from specplugin.bench.soak import stream
from specplugin.zoo import zoo_path
from tests.shared_engine import MULTIPROCESS

pytestmark = pytest.mark.vllm

VLLM = str(Path(sys.executable).with_name("vllm"))
SPEC = json.dumps({"method": "custom_class", "model": "specplugin.Speculator",
                   "num_speculative_tokens": 8})


# one fault (test-only setting): the n-gram proposer raises at every 3rd call; and the
# batch-expanding scorer with every draft verified as an extra candidate beside a decoy
# (test-only), so that its winners carry the served output
SETTINGS = {"specplugin": {"proposers": ["ngram", "suffix"], "max_candidates": 2,
                           "fault_injection": {"proposers": {"ngram": 3},
                                               "decoy_primary": True}}}


def _serve_args(model, port, additional: dict) -> list[str]:
    return [VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1",
            "--speculative-config", SPEC, "--additional-config", json.dumps(additional)]


# two API servers put vLLM in Prometheus's multiprocess mode; dev mode serves
# /collective_rpc, which reads the plugin's counters from the worker itself
SERVER_ARGS = ["--api-server-count", "2"]
SERVER_ENV = {**MULTIPROCESS, "VLLM_SERVER_DEV_MODE": "1"}


def _http(url: str, body: dict | None = None) -> str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def server_proc(zoo_root, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_serve_args(zoo_path("target", zoo_root), port, SETTINGS)
                                + SERVER_ARGS, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **SERVER_ENV})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log, timeout_s=300)
    except RuntimeError as err:  # exited early, or not up in time
        proc.kill()
        pytest.fail(str(err))
    yield base, proc
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(server_proc):
    return server_proc[0]


def test_completions_through_the_openai_api_use_the_plugin(server):
    model = json.loads(_http(server + "/v1/models"))["data"][0]["id"]
    code = "def area(width, height):\n    return width * height\n\n\n"
    reply = json.loads(_http(server + "/v1/completions", {
        "model": model, "prompt": code + "# again:\n" + code, "max_tokens": 48,
        "temperature": 0.0}))
    assert reply["choices"][0]["text"]
    metrics = _http(server + "/metrics")
    drafts = [line for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0, drafts


def test_bad_setting_stops_vllm_serve_with_the_fix_in_its_output(zoo_root):
    out = subprocess.run(_serve_args(zoo_path("target", zoo_root), free_port(),
                                     {"specplugin": {"proposers": ["ngrm"]}}),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "names unknown proposer 'ngrm'; available: draft, ngram" in out.stdout + out.stderr


def test_a_bad_per_request_option_is_an_http_400_naming_the_key(server):
    """``vllm_xargs`` lands in ``SamplingParams.extra_args``; the plugin's front-end check
    refuses a value above the server's bound before the request is scheduled."""
    model = json.loads(_http(server + "/v1/models"))["data"][0]["id"]
    body = {"model": model, "prompt": "def f(x):\n", "max_tokens": 8, "temperature": 0.0}
    with pytest.raises(urllib.error.HTTPError) as e:
        _http(server + "/v1/completions", {**body, "vllm_xargs": {"specplugin_max_k": 99}})
    assert e.value.code == 400
    error = json.loads(e.value.read().decode())["error"]
    assert error["param"] == "specplugin_max_k", error
    assert "num_speculative_tokens=8" in error["message"], error
    # the same server goes on serving; a request may lower K and pick proposers
    reply = json.loads(_http(server + "/v1/completions", {
        **body, "vllm_xargs": {"specplugin_max_k": 2, "specplugin_proposers": "ngram"}}))
    assert reply["choices"][0]["text"]


def _metric(metrics: str, prefix: str) -> float:
    values = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix)]
    assert values, f"{prefix} not in /metrics"
    return sum(values)


def test_concurrent_streaming_clients_all_succeed_with_unchanged_output_despite_faults(server):
    """Four clients stream at once while the n-gram proposer fails every 3rd call: every
    request completes, greedy output equals plain decoding (the same server with
    speculation off per request), and the failures are counted in /metrics."""
    from concurrent.futures import ThreadPoolExecutor

    model = json.loads(_http(server + "/v1/models"))["data"][0]["id"]
    code = "def area(width, height):\n    return width * height\n\n\n"
    prompts = [code + f"# version {i}:\n" + code for i in range(8)]
    body = {"model": model, "max_tokens": 40, "temperature": 0.0}
    with ThreadPoolExecutor(4) as pool:
        spec = list(pool.map(lambda p: stream(server, {**body, "prompt": p}, timeout_s=120),
                             prompts))
    plain = [json.loads(_http(server + "/v1/completions", {
        **body, "prompt": p, "vllm_xargs": {"specplugin_max_k": 0}}))["choices"][0]["text"]
        for p in prompts]
    assert spec == plain
    time.sleep(1.0)  # the worker publishes its counters at most every 0.5 s of steps
    _http(server + "/v1/completions", {**body, "prompt": code, "max_tokens": 8})
    metrics = _http(server + "/metrics")
    assert _metric(metrics, 'vllm:specplugin_proposer_failures_total{proposer="ngram"}') > 0
    assert _metric(metrics, 'vllm:specplugin_proposer_failures_total{proposer="suffix"}') == 0
    assert _metric(metrics, "vllm:specplugin_accepted_tokens_total{") > 0
    # the scorer ran in vllm serve: extra candidates won and carried the output
    assert _metric(metrics, "vllm:specplugin_scorer_wins_total") > 0


def test_a_client_leaving_mid_stream_frees_its_kv_cache(server):
    model = json.loads(_http(server + "/v1/models"))["data"][0]["id"]
    body = {"model": model, "prompt": "class Stack:\n    def __init__(self):\n",
            "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    assert stream(server, body, leave_after=3, timeout_s=120)  # closing the connection aborts the request
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = _http(server + "/metrics")
        if (_metric(metrics, "vllm:num_requests_running{") == 0
                and _metric(metrics, "vllm:kv_cache_usage_perc{") == 0):
            break
        time.sleep(0.5)
    else:
        pytest.fail("the aborted request still holds KV blocks:\n" + "\n".join(
            line for line in metrics.splitlines() if "running" in line or "kv_cache" in line))
    # and the server goes on serving
    assert json.loads(_http(server + "/v1/completions", {**body, "max_tokens": 8}))["choices"]


def _plugin_series(metrics: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith("vllm:specplugin_")}


def test_every_api_server_reports_the_workers_own_counts(server):
    """With two API servers (vLLM's multiprocess registry), every scrape, whichever server
    answers, has every ``vllm:specplugin_*`` series with the drafting worker's totals."""
    from prometheus_client import CollectorRegistry, generate_latest

    from specplugin.vllm_layer.metrics_export import merge, metric_families

    model = json.loads(_http(server + "/v1/models"))["data"][0]["id"]
    code = "def area(width, height):\n    return width * height\n\n\n"
    _http(server + "/v1/completions", {"model": model, "prompt": code + code,
                                       "max_tokens": 24, "temperature": 0.0})
    time.sleep(1.0)  # past the publishing period: the RPC's wait publishes what it read
    stats = json.loads(_http(server + "/collective_rpc",
                             {"method": "specplugin_stats"}))["results"][0]
    time.sleep(0.5)

    class Families:
        def collect(self):
            return metric_families(merge([stats]))

    registry = CollectorRegistry()
    registry.register(Families())
    expected = _plugin_series(generate_latest(registry).decode())
    assert len(expected) > 20 and any("accepted_tokens_total" in k for k in expected)
    for _ in range(6):  # new connections: both servers answer some
        assert _plugin_series(_http(server + "/metrics")) == expected


def test_a_soak_then_a_storm_of_aborts_leaves_nothing_behind(server_proc, zoo_root):
    """A small ``specplugin load --soak``: mixed requests with clients leaving, then 500
    streams aborted at once, then greedy requests: none fails, greedy output equals
    speculation off, and the plugin holds no request's record once the server is idle."""
    from specplugin.bench.load import text_prompts
    from specplugin.bench.soak import soak

    base, proc = server_proc
    model = json.loads(_http(base + "/v1/models"))["data"][0]["id"]
    report = soak(base, proc.pid, model, text_prompts(zoo_root, 40), num_requests=80,
                  concurrency=16, num_aborts=500, every_s=1.0, leave_share=0.1)
    assert report["failed"] == 0, report["errors"]
    assert report["left_mid_stream"] > 0
    assert report["tracked_requests_end"] == 0
    assert report["storm"]["aborts"] == 500 and report["storm"]["window_s"] < 1.0
    assert report["resumed"]["failed"] == 0, report["resumed"]["errors"]
    assert report["resumed"]["differ_from_spec_off"] == 0
    assert report["resumed"]["tracked_requests_end"] == 0
    assert max(n for _, n in report["tracked_requests"]) > 0  # the gauge saw the load

"""`vllm serve` (the stock console script) with the plugin: completions, per-request
options, metrics, the batch-expanding scorer, faults (a proposer failing every 3rd call, a client leaving
mid-stream) under a few concurrent streaming clients, start-up errors. The full load
run (64 clients, 2,000 requests) is ``specplugin load``, not part of the suite."""

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


def _http(url: str, body: dict | None = None) -> str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def server(zoo_root, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_serve_args(zoo_path("target", zoo_root), port, SETTINGS),
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **MULTIPROCESS})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log, timeout_s=300)
    except RuntimeError as err:  # exited early, or not up in time
        proc.kill()
        pytest.fail(str(err))
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


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


def _stream(server: str, body: dict, stop_after: int | None = None) -> str:
    """A streaming completion's text; ``stop_after``: leave after that many chunks."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(server + "/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    text, chunks = [], 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break  # closing the connection aborts the request on the server
    return "".join(text)


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
        spec = list(pool.map(lambda p: _stream(server, {**body, "prompt": p}), prompts))
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
    assert _stream(server, body, stop_after=3)
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

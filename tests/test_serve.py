"""`vllm serve` (the stock console script) with the plugin: completions, metrics, start-up errors."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specplugin.zoo import zoo_path

pytestmark = pytest.mark.vllm

VLLM = str(Path(sys.executable).with_name("vllm"))
SPEC = json.dumps({"method": "custom_class", "model": "specplugin.Speculator",
                   "num_speculative_tokens": 8})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_serve_args(zoo_path("target", zoo_root), port,
                                            {"specplugin": {"proposers": ["ngram"]}}),
                                stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("vllm serve exited early:\n" + log.read_text()[-3000:])
        try:
            _http(base + "/health")
            break
        except OSError:
            time.sleep(2)
    else:
        proc.kill()
        pytest.fail("vllm serve did not come up in 300 s:\n" + log.read_text()[-3000:])
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
    out = subprocess.run(_serve_args(zoo_path("target", zoo_root), _free_port(),
                                     {"specplugin": {"proposers": ["ngrm"]}}),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "names unknown proposer 'ngrm'; available: draft, ngram" in out.stdout + out.stderr

"""``specplugin load``: `vllm serve` with and without the plugin under vLLM's own serving
benchmark (``vllm bench serve``, a client nobody here wrote).

One server per configuration (none, the plugin's union, vLLM's best built-in; with
``--faults`` the union with injected failures and clients leaving mid-stream), the same
greedy prompts each. Reports tok/s ratios, output identity with no speculation, caught
failures, and KV cache usage afterwards (must be 0: aborts hold nothing).

``--soak N`` instead runs one server with the union for a long run (:mod:`.soak`): memory
and the plugin's per-request state over time, and with ``--storm`` a burst of aborts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = "bench-out/load"
FAULTS = {"proposers": {"ngram": 7, "suffix": 11}, "draft_forward": 13}


@dataclass
class LoadResult:
    name: str
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    output_tok_s: float = 0.0
    texts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    plugin_failures: float | None = None
    kv_usage_after: float | None = None
    running_after: float | None = None
    left_mid_stream: int = 0  # clients that disconnected on purpose (--faults)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specplugin.bench.methods import METHODS
    from specplugin.bench.runner import add_eager_argument
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64,
                        help="streaming clients at once (vllm bench serve --max-concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--builtin", default="vllm-suffix",
                        help="vLLM's built-in method to compare with (its bench settings)")
    parser.add_argument("--faults", action="store_true",
                        help=f"also run the union with fault injection {FAULTS} and clients "
                             "that leave mid-stream")
    parser.add_argument("--sample", type=int, default=200,
                        help="outputs compared with the spec-off server's")
    parser.add_argument("--soak", type=int, metavar="N",
                        help="instead: one server with the union under N mixed requests "
                             "(lengths, temperatures, options, clients leaving); samples RSS "
                             "and vllm:specplugin_tracked_requests; plot in --out-dir")
    parser.add_argument("--storm", type=int, default=0, metavar="A",
                        help="with --soak: then A streams aborted at once, then greedy "
                             "requests compared with speculation off")
    parser.add_argument("--sample-every", type=float, default=5.0,
                        help="with --soak: seconds between samples")
    parser.add_argument("--method", default="plugin-union", choices=sorted(METHODS),
                        help="with --soak: the server's method (a bench method name; none or "
                             "a vLLM method is the control for memory, without --storm)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="servers' logs, client results")
    add_eager_argument(parser)


def run(args) -> int:
    from specplugin.bench.cli import zoo_models
    from specplugin.bench.methods import METHODS
    from specplugin.bench.report import stdout_console
    from specplugin.bench.runner import run_environment

    console = stdout_console()
    root, models = zoo_models(args.zoo)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.soak:
        return run_soak(args, root, models, out_dir, console)
    dataset = write_dataset(root, out_dir / "prompts.jsonl", args.num_prompts, args.max_tokens)
    configs = [("none", METHODS["none"].engine_kwargs(models)),
               ("plugin-union", METHODS["plugin-union"].engine_kwargs(models)),
               (args.builtin, METHODS[args.builtin].engine_kwargs(models))]
    if args.faults:
        kwargs = METHODS["plugin-union"].engine_kwargs(models)
        kwargs["additional_config"]["specplugin"]["fault_injection"] = FAULTS
        configs.append(("plugin-union+faults", kwargs))
    results = []
    for name, engine_kwargs in configs:
        console.print(f"[bold]{name}[/bold]: starting vllm serve")
        results.append(load_one(name, models.target, engine_kwargs, dataset, args, out_dir,
                                leave_mid_stream=name.endswith("+faults")))
        r = results[-1]
        console.print(f"  {r.completed} completed, {r.failed} failed, {r.output_tok_s:.1f} "
                      f"output tok/s, KV usage after: {r.kv_usage_after}")
    print_results(results, args.sample, console)
    if args.json:
        payload = {"meta": {**run_environment(), "num_prompts": args.num_prompts,
                            "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                            "eager": args.eager},
                   "results": [{k: v for k, v in vars(r).items() if k != "texts"}
                               for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    ok = all(r.failed == 0 and r.completed == args.num_prompts and not r.kv_usage_after
             for r in results)
    return 0 if ok else 1


def run_soak(args, root: Path, models, out_dir: Path, console) -> int:
    """``--soak N``: the union's server under :func:`specplugin.bench.soak.soak`."""
    from specplugin.bench import soak
    from specplugin.bench.methods import METHODS, PLUGIN
    from specplugin.bench.runner import run_environment

    plugin = METHODS[args.method].family == PLUGIN  # (the gauge and per-request options)
    if args.storm and not plugin:
        raise SystemExit(f"--storm compares with the plugin switched off per request: drop it "
                         f"with --method {args.method}")
    prompts = text_prompts(root, min(args.soak, 500))
    kwargs = METHODS[args.method].engine_kwargs(models)
    with serving("soak", models.target, kwargs, args.eager, out_dir) as (base, pid):
        console.print(f"soak: {args.method}, {args.soak} requests, {args.concurrency} at a time")
        report = soak.soak(base, pid, models.target, prompts, args.soak, args.concurrency,
                           args.storm, args.sample_every, options=plugin)
    report["method"], report["meta"] = args.method, run_environment()
    soak.plot(report, out_dir / "soak.png")
    console.print_json(json.dumps({k: v for k, v in report.items()
                                   if k not in ("rss_mb", "rss_mb_by_process", "tracked_requests",
                                                 "requests_done")}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    resumed = report.get("resumed", {})
    ok = (report["failed"] == 0 and (report["tracked_requests_end"] == 0 or not plugin)
          and not resumed.get("failed") and not resumed.get("differ_from_spec_off")
          and resumed.get("tracked_requests_end", 0) == 0)
    return 0 if ok else 1


def text_prompts(zoo_root: Path, num_prompts: int) -> list[str]:
    """Mixed text prompts of the pair's held-out files (edits and completions)."""
    import numpy as np
    from tokenizers import Tokenizer

    from specplugin.bench.workloads import FULL_SIZES, mixed_prompts, source_from_zoo

    tokenizer = Tokenizer.from_file(str(Path(zoo_root) / "target" / "tokenizer.json"))
    prompts = mixed_prompts(source_from_zoo(zoo_root), FULL_SIZES, num_prompts,
                            np.random.default_rng(0))
    return [tokenizer.decode(ids) for ids in prompts]


def write_dataset(zoo_root: Path, path: Path, num_prompts: int, max_tokens: int) -> Path:
    """A ``vllm bench serve --dataset-name custom`` file of mixed text prompts."""
    with open(path, "w") as out:
        for prompt in text_prompts(zoo_root, num_prompts):
            out.write(json.dumps({"prompt": prompt, "output_tokens": max_tokens}) + "\n")
    return path


def serve_args(model: str, port: int, engine_kwargs: dict[str, Any], eager: bool) -> list[str]:
    """``vllm serve`` flags for these engine kwargs plus ``ENGINE_DEFAULTS``."""
    from specplugin.bench.runner import ENGINE_DEFAULTS

    engine_kwargs = {**ENGINE_DEFAULTS, **engine_kwargs}
    vllm = str(Path(sys.executable).with_name("vllm"))
    args = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", engine_kwargs["dtype"],
            "--gpu-memory-utilization", str(engine_kwargs["gpu_memory_utilization"]),
            "--seed", str(engine_kwargs["seed"])]
    for key in ("speculative_config", "additional_config"):
        if engine_kwargs.get(key):
            args += [f"--{key.replace('_', '-')}", json.dumps(engine_kwargs[key])]
    return args + (["--enforce-eager"] if eager else [])


@contextlib.contextmanager
def serving(name: str, model: str, engine_kwargs: dict, eager: bool, out_dir: Path):
    """A `vllm serve` of these engine kwargs, healthy: yields its URL and process id."""
    from specplugin.bench.runner import CHILD_ENV_DEFAULTS

    port = free_port()
    log = out_dir / f"{name}.server.log"
    env = {**CHILD_ENV_DEFAULTS, **os.environ}
    with open(log, "w") as out:
        server = subprocess.Popen(serve_args(model, port, engine_kwargs, eager),
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, log)
        yield base, server.pid
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def load_one(name: str, model: str, engine_kwargs: dict, dataset: Path, args, out_dir: Path,
             leave_mid_stream: bool = False) -> LoadResult:
    with serving(name, model, engine_kwargs, args.eager, out_dir) as (base, _):
        leavers = _start_leavers(base, model) if leave_mid_stream else None
        result = bench_serve(name, base, model, dataset, args, out_dir)
        if leavers is not None:
            result.left_mid_stream = leavers.join()
        time.sleep(2.0)  # the engine publishes its counters at most every 0.5 s of steps
        metrics = read_url(base + "/metrics")
        result.plugin_failures = metric_sum(metrics, "vllm:specplugin_proposer_failures_total")
        result.kv_usage_after = metric_sum(metrics, "vllm:kv_cache_usage_perc")
        result.running_after = metric_sum(metrics, "vllm:num_requests_running")
        return result


def bench_serve(name: str, base: str, model: str, dataset: Path, args, out_dir: Path) -> LoadResult:
    """One run of ``vllm bench serve`` against ``base``; its saved JSON, summarised."""
    vllm = str(Path(sys.executable).with_name("vllm"))
    filename = f"{name}.client.json"
    cmd = [vllm, "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", model,
           "--tokenizer", model, "--dataset-name", "custom", "--dataset-path", str(dataset),
           "--skip-chat-template",
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
           "--temperature", "0", "--ignore-eos", "--seed", "0", "--save-result",
           "--save-detailed", "--result-dir", str(out_dir), "--result-filename", filename,
           "--disable-tqdm"]
    with open(out_dir / f"{name}.client.log", "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    data = json.loads((out_dir / filename).read_text()) if proc.returncode == 0 else {}
    client_error = [] if proc.returncode == 0 else [
        f"vllm bench serve exited with {proc.returncode}; see {out_dir / (name + '.client.log')}"]
    return LoadResult(
        name=name, completed=int(data.get("completed", 0)),
        failed=int(data.get("failed", args.num_prompts if proc.returncode else 0)),
        duration_s=float(data.get("duration", 0.0)),
        output_tok_s=float(data.get("output_throughput", 0.0)),
        texts=list(data.get("generated_texts", [])),
        errors=client_error + [e for e in data.get("errors", []) if e][:5])


class _Leavers:
    """Clients that, in a loop, open a streaming completion and leave after a few chunks."""

    def __init__(self, base: str, model: str):
        self.base, self.model = base, model
        self.stop = threading.Event()
        self.count = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        from specplugin.bench.soak import stream

        body = {"model": self.model, "prompt": "class Stack:\n    def __init__(self):\n",
                "max_tokens": 500, "temperature": 0.0, "ignore_eos": True}
        while not self.stop.is_set():
            try:
                stream(self.base, body, leave_after=4, timeout_s=300)
                self.count += 1
            except (OSError, RuntimeError, ValueError):  # the server's refusal or a cut
                pass
            self.stop.wait(1.0)

    def join(self) -> int:
        self.stop.set()
        self.thread.join(timeout=300)
        return self.count


def _start_leavers(base: str, model: str) -> _Leavers:
    leavers = _Leavers(base, model)
    leavers.thread.start()
    return leavers


def print_results(results: list[LoadResult], sample: int, console) -> None:
    from rich.table import Table

    none = next((r for r in results if r.name == "none"), None)
    builtin = next((r for r in results if r.name.startswith("vllm-")), None)
    table = Table(title="specplugin load (vllm bench serve, greedy, mixed prompts)")
    for column in ("server", "completed", "failed", "output tok/s", "x none", "x built-in",
                   f"first {sample} outputs = spec-off", "plugin failures caught",
                   "left mid-stream", "KV usage after"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for r in results:
        same = "-"
        if none is not None and r is not none and r.texts and none.texts:
            n = min(sample, len(r.texts), len(none.texts))
            same = f"{sum(a == b for a, b in zip(r.texts[:n], none.texts[:n]))}/{n}"
        table.add_row(
            r.name, str(r.completed), str(r.failed), f"{r.output_tok_s:.1f}",
            f"{r.output_tok_s / none.output_tok_s:.2f}x" if none and none.output_tok_s else "-",
            f"{r.output_tok_s / builtin.output_tok_s:.2f}x"
            if builtin and builtin.output_tok_s else "-",
            same, "-" if r.plugin_failures is None else f"{r.plugin_failures:.0f}",
            str(r.left_mid_stream) if r.name.endswith("+faults") else "-",
            "-" if r.kv_usage_after is None else f"{r.kv_usage_after:.3f}")
    console.print(table)
    for r in results:
        for error in r.errors:
            console.print(f"[red]{r.name}: {error}[/red]")


def wait_healthy(base: str, server: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited early; see {log}:\n"
                               + log.read_text()[-3000:])
        try:
            read_url(base + "/health")
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vllm serve did not come up in {timeout_s:.0f} s; see {log}:\n"
                       + log.read_text()[-3000:])


def read_url(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return resp.read().decode()


def metric_sum(metrics: str, name: str) -> float | None:
    """The sum of a metric's samples (all labels) in a ``/metrics`` text; None if absent."""
    values = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith((name + " ", name + "{"))]
    return sum(values) if values else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

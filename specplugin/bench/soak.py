"""``specplugin load --soak N``: one `vllm serve` with the full union for a long run.

N streaming requests at a fixed concurrency mix lengths, temperatures, per-request
options and clients that leave after a few chunks; every few seconds the server's RSS (its
whole process tree) and the plugin's ``vllm:specplugin_tracked_requests`` gauge are read.
With ``storm``, a burst of aborts follows (every stream of the burst closed within
milliseconds, mid-stream or still queued), then a greedy load whose outputs are compared
with the same prompts decoded with speculation off per request. Memory should stay flat
(a leak shows as a slope) and the tracked state return to 0 once the server is idle.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

TRACKED = "vllm:specplugin_tracked_requests"
# per-request options a soak mixes in (vllm_xargs; None: the server's settings)
OPTIONS = (None, None, {"specplugin_max_k": 0}, {"specplugin_max_k": 3},
           {"specplugin_proposers": "ngram"}, {"specplugin_proposers": "suffix"})
TEMPERATURES = (0.0, 0.0, 0.7, 1.0)


@dataclass
class Tally:
    """Counts shared by the client threads."""

    completed: int = 0
    left: int = 0  # clients that left mid-stream on purpose
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            if error is not None and len(self.errors) < 5:
                self.errors.append(error)


def open_stream(base: str, body: dict, timeout_s: float = 600
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST a streaming completion; the connection and its response (status checked).
    ``timeout_s``: the longest wait on the server (connecting, or for its next bytes)."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        conn.close()
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    return conn, resp


def stream(base: str, body: dict, leave_after: int | None = None,
           timeout_s: float = 600) -> str:
    """A streaming completion's text. ``leave_after``: close after that many chunks (the
    server aborts the request). Raises on an HTTP error or a stream cut short."""
    conn, resp = open_stream(base, body, timeout_s)
    try:
        text = []
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return "".join(text)
            if line.startswith("data: "):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if leave_after is not None and len(text) >= leave_after:
                    return "".join(text)
        raise RuntimeError("the stream ended without [DONE]")
    finally:
        conn.close()


def soak_bodies(model: str, prompts: list[str], num_requests: int, leave_share: float,
                seed: int = 0, options: bool = True):
    """(body, leave_after) for each request: mixed lengths, temperatures and (``options``)
    the plugin's per-request options, which a server without the plugin refuses."""
    rng = np.random.default_rng(seed)
    for i in range(num_requests):
        body = {"model": model, "prompt": prompts[i % len(prompts)],
                "max_tokens": int(rng.integers(8, 129)),
                "temperature": TEMPERATURES[int(rng.integers(len(TEMPERATURES)))]}
        extra = OPTIONS[int(rng.integers(len(OPTIONS)))]
        if extra is not None and options:
            body["vllm_xargs"] = extra
        leave = int(rng.integers(1, 5)) if rng.random() < leave_share else None
        yield body, leave


def run_requests(base: str, bodies, concurrency: int, tally: Tally) -> list[str | None]:
    """Each (body, leave_after)'s text (None: it failed), ``concurrency`` at a time."""
    def one(item) -> str | None:
        body, leave = item
        try:
            text = stream(base, body, leave)
            tally.add("left" if leave is not None else "completed")
            return text
        except Exception as err:  # noqa: BLE001 - every failure is counted and reported
            tally.add("failed", f"{type(err).__name__}: {err}")
            return None

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


class Sampler:
    """A thread reading the server's RSS and the tracked-requests gauge every ``every_s``."""

    def __init__(self, base: str, server_pid: int, tally: Tally, every_s: float):
        self.base, self.pid, self.tally, self.every_s = base, server_pid, tally, every_s
        self.start = time.monotonic()
        # [seconds, value] pairs; completed requests beside the RSS
        self.rss_mb: list[list[float]] = []
        # each process's [seconds, MB] (name and pid): which one grows, if any
        self.by_process: dict[str, list[list[float]]] = {}
        self.tracked: list[list[float]] = []
        self.completed: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        t = round(time.monotonic() - self.start, 2)
        by_process = server_rss_mb(self.pid)
        self.rss_mb.append([t, round(sum(by_process.values()), 1)])
        for name, mb in by_process.items():
            self.by_process.setdefault(name, []).append([t, round(mb, 1)])
        self.completed.append([t, self.tally.completed + self.tally.left + self.tally.failed])
        tracked = tracked_requests(self.base)
        if tracked is not None:
            self.tracked.append([t, tracked])


def server_rss_mb(pid: int) -> dict[str, float]:
    """Resident memory (MB) of each process of the server's tree (API servers, engine
    core, workers), by name and pid."""
    import psutil

    root = psutil.Process(pid)
    rss = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss[f"{proc.name()} ({proc.pid})"] = proc.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return rss


def tracked_requests(base: str) -> float | None:
    from specplugin.bench.load import metric_sum, read_url

    try:
        return metric_sum(read_url(base + "/metrics"), TRACKED)
    except OSError:
        return None


def wait_idle(base: str, timeout_s: float = 30.0) -> float | None:
    """The gauge once it reads 0 (or at ``timeout_s``): records go at the step after their
    request ends, and an idle worker publishes them at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        tracked = tracked_requests(base)
        if tracked == 0 or time.monotonic() > deadline:
            return tracked
        time.sleep(0.5)


def storm(base: str, model: str, prompts: list[str], num_aborts: int,
          settle_s: float = 3.0, wait_s: float = 120.0) -> dict:
    """Open ``num_aborts`` long streams; once no new one has started streaming for
    ``settle_s`` (the rest wait in the engine's queue), close every connection at once.
    Returns how many were aborted, how many were streaming, and the burst's seconds."""
    opened: list[http.client.HTTPConnection] = []
    lock, stormed = threading.Lock(), threading.Event()
    streaming = threading.Semaphore(0)
    body = {"model": model, "max_tokens": 1024, "temperature": 0.0, "ignore_eos": True}

    def one(i: int) -> None:
        try:
            conn, resp = open_stream(base, {**body, "prompt": prompts[i % len(prompts)]})
            with lock:
                opened.append(conn)
                if stormed.is_set():  # opened after the burst: leave at once
                    conn.close()
                    return
            first = True
            for raw in resp:  # read on until the storm closes the connection
                if first and raw.startswith(b"data: "):
                    streaming.release()
                    first = False
        except Exception:  # noqa: BLE001 - closed by the storm, as intended
            pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num_aborts)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait_s
    num_streaming = 0
    while num_streaming < num_aborts and time.monotonic() < deadline:
        if streaming.acquire(timeout=settle_s):
            num_streaming += 1
        elif num_streaming:
            break
    start = time.monotonic()
    with lock:
        stormed.set()
        for conn in opened:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    window = time.monotonic() - start
    for t in threads:
        t.join(timeout=60)
    return {"aborts": len(opened), "streaming_at_abort": num_streaming, "window_s": window}


def greedy_check(base: str, model: str, prompts: list[str], num_requests: int,
                 concurrency: int, tally: Tally) -> int:
    """Greedy requests with speculation, then the same with it off per request; the
    number that differ (a failed request counts as differing)."""
    bodies = [{"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 64,
               "temperature": 0.0} for i in range(num_requests)]
    off = {"vllm_xargs": {"specplugin_max_k": 0}}
    spec = run_requests(base, [(b, None) for b in bodies], concurrency, tally)
    plain = run_requests(base, [({**b, **off}, None) for b in bodies], concurrency, tally)
    return sum(a is None or a != b for a, b in zip(spec, plain))


def soak(base: str, server_pid: int, model: str, prompts: list[str], num_requests: int,
         concurrency: int, num_aborts: int = 0, every_s: float = 5.0,
         leave_share: float = 0.05, options: bool = True) -> dict:
    """The soak (and with ``num_aborts`` the storm and the greedy load after it) against
    a running server; the report ``specplugin load --soak --json`` writes."""
    tally = Tally()
    with Sampler(base, server_pid, tally, every_s) as sampler:
        run_requests(base, soak_bodies(model, prompts, num_requests, leave_share,
                                       options=options), concurrency, tally)
    report = {"requests": num_requests, "concurrency": concurrency,
              "completed": tally.completed, "left_mid_stream": tally.left,
              "failed": tally.failed, "errors": tally.errors,
              "duration_s": sampler.rss_mb[-1][0],
              "tracked_requests_end": wait_idle(base), "rss_mb": sampler.rss_mb,
              "rss_mb_by_process": sampler.by_process,
              "tracked_requests": sampler.tracked, "requests_done": sampler.completed}
    report.update(rss_growth(sampler, min(1000, num_requests // 4)))
    if num_aborts:
        report["storm"] = storm(base, model, prompts, num_aborts)
        after = Tally()
        num_resumed = min(1000, num_requests)
        mismatched = greedy_check(base, model, prompts, num_resumed, concurrency, after)
        report["resumed"] = {"requests": num_resumed, "failed": after.failed,
                             "errors": after.errors, "differ_from_spec_off": mismatched,
                             "tracked_requests_end": wait_idle(base)}
    return report


def rss_growth(sampler: Sampler, baseline_requests: int) -> dict:
    """RSS once ``baseline_requests`` were done against RSS at the end of the soak, and its
    slope since (MB per 1,000 requests, least squares: a leak shows as one), in all and per
    process."""
    at = next((i for i, (_, done) in enumerate(sampler.completed)
               if done >= baseline_requests), 0)
    done = np.array([d for _, d in sampler.completed[at:]], dtype=np.float64)

    def growth(series: list[list[float]]) -> dict:
        mb = np.array([m for _, m in series[at:]], dtype=np.float64)
        n = min(len(mb), len(done))
        slope = (float(np.polyfit(done[:n], mb[:n], 1)[0]) * 1000
                 if n >= 2 and np.ptp(done[:n]) > 0 else 0.0)
        return {"baseline_mb": series[min(at, len(series) - 1)][1], "end_mb": series[-1][1],
                "slope_mb_per_1000": round(slope, 1)}

    total = growth(sampler.rss_mb)
    return {"rss_baseline_after_requests": baseline_requests,
            "rss_baseline_mb": total["baseline_mb"], "rss_end_mb": total["end_mb"],
            "rss_growth": total["end_mb"] / total["baseline_mb"] - 1.0,
            "rss_slope_mb_per_1000": total["slope_mb_per_1000"],
            "rss_growth_by_process": {name: growth(series)
                                      for name, series in sampler.by_process.items()}}


def plot(report: dict, path) -> None:
    """RSS and the tracked-requests gauge over the soak, one above the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, tracked) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    rss.plot(*zip(*report["rss_mb"]), label="all")
    for name, series in report.get("rss_mb_by_process", {}).items():
        rss.plot(*zip(*series), label=name, linewidth=0.8)
    rss.legend(fontsize="x-small")
    rss.set_ylabel("server RSS (MB)")
    rss.set_title(f"specplugin load --soak {report['requests']} "
                  f"(concurrency {report['concurrency']})")
    if report["tracked_requests"]:
        tracked.plot(*zip(*report["tracked_requests"]))
    tracked.set_ylabel("tracked requests")
    tracked.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

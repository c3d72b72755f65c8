"""The plugin's counters in vLLM's Prometheus output (``/metrics``, ``LLM.get_metrics()``).

The counters live in the drafting worker; the Prometheus registry lives in the front end,
and vLLM has no channel between them for a plugin's numbers. So the drafting worker
(tensor-parallel rank 0) writes a JSON snapshot of ``stats()`` at most every
:data:`PUBLISH_EVERY_S` seconds (in the worker's wait, :mod:`.worker_wait`) to a folder
named after ``VllmConfig.instance_id``; a front-end collector reads those files at scrape
time, so figures lag by at most that period. Offline, :func:`engine_stats` asks the
workers directly and is exact.

Several API servers (``--api-server-count`` > 1) put vLLM in Prometheus's multiprocess
mode: ``PROMETHEUS_MULTIPROC_DIR`` is set for every process of the server, and each scrape
reads the metric files there, not a process's registry. There the worker writes the same
families as prometheus_client metrics (:class:`MultiprocessMetrics`), whose values land in
those files, so every API server reports them.

Metric names and meanings: docs/operations.md (``vllm:specplugin_*`` counters; step
counters come from :data:`specplugin.metrics.STEP_COUNTERS`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specplugin.metrics import STEP_COUNTERS
from specplugin.profiling import phase

logger = logging.getLogger("specplugin")
PUBLISH_EVERY_S = 0.5
PREFIX = "vllm:specplugin_"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set by vLLM for --api-server-count > 1


def metrics_root() -> Path:
    """Where engines publish: shared memory when there is some (no disk writes)."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"specplugin-metrics-{os.getuid()}"


class StatsPublisher:
    """Worker side: writes ``stats()`` to ``<root>/<instance_id>/<pid>.json``, throttled."""

    def __init__(self, instance_id: str, every_s: float = PUBLISH_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.folder = metrics_root() / instance_id
        self.path = self.folder / f"{os.getpid()}.json"
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None
        self._broken = False
        self.busy_s = 0.0  # seconds spent writing snapshots (reported by the profiler)
        # several API servers: prometheus_client's multiprocess files instead of JSON
        self.multiprocess = MultiprocessMetrics() if os.environ.get(MULTIPROC_ENV) else None

    @phase("plugin: metrics")
    def maybe_publish(self, stats: Callable[[], dict[str, Any]], force: bool = False) -> None:
        now = self.clock()
        if self._broken or (not force and self._last is not None
                            and now - self._last < self.every_s):
            return
        self._last = now
        start = time.perf_counter()
        try:
            if self.multiprocess is not None:
                self.multiprocess.update(stats())
            else:
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(stats()))
                os.replace(tmp, self.path)
        except Exception:  # metrics must never cost a request
            self._broken = True
            logger.exception("specplugin: cannot publish metrics to %s; the plugin's counters "
                             "will be missing from /metrics", self.folder)
        self.busy_s += time.perf_counter() - start


def read_snapshots(folders: Iterable[Path]) -> list[dict[str, Any]]:
    snapshots = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            try:
                snapshots.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # being replaced right now: next scrape
                continue
    return snapshots


# the batch-expanding scorer's counters published as vllm:specplugin_scorer_<name>_total
SCORER_COUNTERS = {
    "extra_rows": "Extra candidates verified as extra rows of the target's pass.",
    "extra_tokens": "Query tokens of those extra rows.",
    "wins": "Extra candidates that beat the request's own draft.",
}


def merge(snapshots: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The sum of several workers' snapshots (data-parallel engines each publish one)."""
    total: dict[str, Any] = {**dict.fromkeys(STEP_COUNTERS, 0), "k_histogram": Counter(),
                             "proposers": {}, "proposer_failures": Counter(),
                             "arbiter": Counter(), "scorer": Counter(), "tracked_requests": 0}
    for snap in snapshots:
        total["tracked_requests"] += snap.get("tracked_requests", 0)
        for key in STEP_COUNTERS:
            total[key] += snap.get(key, 0)
        total["k_histogram"].update(snap.get("k_histogram", {}))
        total["proposer_failures"].update(snap.get("proposer_failures", {}))
        total["arbiter"].update(snap.get("arbiter") or {})
        total["scorer"].update({k: v for k, v in (snap.get("scorer") or {}).items()
                                if k in SCORER_COUNTERS})
        for name, counts in snap.get("proposers", {}).items():
            mine = total["proposers"].setdefault(name, {})
            for key, value in counts.items():
                if isinstance(value, list):
                    old = mine.get(key, [])
                    longer, shorter = (value, old) if len(value) >= len(old) else (old, value)
                    mine[key] = [a + (shorter[i] if i < len(shorter) else 0)
                                 for i, a in enumerate(longer)]
                else:
                    mine[key] = mine.get(key, 0) + value
    return total


def metric_families(total: dict[str, Any]) -> list:
    """Prometheus families for one merged snapshot: counters, and the gauge of requests
    whose records the plugin holds (a record goes at the step after its request ends)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def family(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        return CounterMetricFamily(PREFIX + name, doc, labels=labels)

    def scalars(table: dict[str, str], values: dict[str, Any], prefix: str = "") -> list:
        """One unlabelled counter per entry of ``table`` (name -> help text)."""
        out = []
        for key, doc in table.items():
            out.append(family(prefix + key, doc, []))
            out[-1].add_metric([], values.get(key, 0))
        return out

    per_proposer = {key: family(key, doc, ["proposer"]) for key, doc in (
        ("drafts", "Drafts verified (one request's candidate in one step), per proposer."),
        ("draft_tokens", "Draft tokens verified, per proposer."),
        ("accepted_tokens", "Draft tokens accepted, per proposer."),
        ("chosen", "Times the controller sent this proposer's candidate."))}
    per_pos = {key: family(f"{key}_per_pos", f"{doc}, per proposer and draft position.",
                           ["proposer", "position"]) for key, doc in (
        ("draft_tokens", "Draft tokens verified"), ("accepted_tokens", "Draft tokens accepted"))}
    for name, counts in sorted(total["proposers"].items()):
        for key, fam in per_proposer.items():
            fam.add_metric([name], counts.get(key, 0))
        for key, fam in per_pos.items():
            for position, value in enumerate(counts.get(f"{key}_per_pos", [])):
                fam.add_metric([name, str(position)], value)
    k = family("k", "Requests per step by the draft length chosen (0: no speculation).", ["k"])
    for value, count in sorted(total["k_histogram"].items(), key=lambda kv: int(kv[0])):
        k.add_metric([str(value)], count)
    blocks = family("arbiter_blocks", "Blocks of steps the step arbiter ran, by mode.", ["mode"])
    for mode, key in (("speculative", "speculative_blocks"), ("plain", "plain_blocks")):
        blocks.add_metric([mode], total["arbiter"].get(key, 0))
    failures = family("proposer_failures", "Proposer failures caught (each cost one step's "
                      "drafts, never a request; the recovered draw's and expected "
                      "acceptance's, vLLM's draw or the verdicts alone instead).",
                      ["proposer"])
    for name, count in sorted(total["proposer_failures"].items()):
        failures.add_metric([name], count)
    tracked = GaugeMetricFamily(PREFIX + "tracked_requests",
                                "Requests whose per-request records the plugin holds now.")
    tracked.add_metric([], total["tracked_requests"])
    return [*per_proposer.values(), *per_pos.values(), k, *scalars(STEP_COUNTERS, total),
            blocks, failures, *scalars(SCORER_COUNTERS, total["scorer"], "scorer_"), tracked]


class MultiprocessMetrics:
    """Worker side, in multiprocess mode: :func:`metric_families` of a snapshot as
    prometheus_client counters and gauges (not registered here), whose values go to the
    files every API server's scrape reads. Counters advance by what the snapshot added."""

    def __init__(self):
        self._metrics: dict[str, Any] = {}  # family name -> Counter or Gauge
        self._last: dict[tuple, float] = {}  # (sample name, labels) -> value written

    def update(self, snapshot: dict[str, Any]) -> None:
        from prometheus_client import Counter, Gauge

        for family in metric_families(merge([snapshot])):
            for sample in family.samples:
                metric = self._metrics.get(family.name)
                if metric is None:
                    kind = Gauge if family.type == "gauge" else Counter
                    extra = {"multiprocess_mode": "livesum"} if kind is Gauge else {}
                    metric = self._metrics[family.name] = kind(
                        family.name, family.documentation, list(sample.labels),
                        registry=None, **extra)
                child = metric.labels(**sample.labels) if sample.labels else metric
                if family.type == "gauge":
                    child.set(sample.value)
                    continue
                key = (sample.name, tuple(sample.labels.items()))
                delta = sample.value - self._last.get(key, 0.0)
                if delta > 0:
                    child.inc(delta)
                    self._last[key] = sample.value


class _Collector:
    """Front end: what this process's engines published, read at scrape time."""

    def __init__(self):
        self.instance_ids: list[str] = []

    def collect(self):
        folders = [metrics_root() / i for i in self.instance_ids]
        snapshots = read_snapshots(f for f in folders if f.is_dir())
        return metric_families(merge(snapshots)) if snapshots else []


_COLLECTOR: _Collector | None = None


def watch_engine(instance_id: str) -> None:
    """Front end: include engine ``instance_id`` in this process's ``/metrics``."""
    global _COLLECTOR
    if _COLLECTOR is None:
        from prometheus_client import REGISTRY

        _COLLECTOR = _Collector()
        REGISTRY.register(_COLLECTOR)
        atexit.register(_remove_folders, _COLLECTOR)
    if instance_id not in _COLLECTOR.instance_ids:
        _COLLECTOR.instance_ids.append(instance_id)


def _remove_folders(collector: _Collector) -> None:
    for instance_id in collector.instance_ids:
        shutil.rmtree(metrics_root() / instance_id, ignore_errors=True)


def engine_stats(llm) -> dict[str, Any]:
    """Offline: the plugin's exact counters from the drafting worker of ``llm`` (a ``vllm.LLM``)."""
    return llm.collective_rpc("specplugin_stats")[0]

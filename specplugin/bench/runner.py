"""The one way this project starts vLLM: one engine per child process, followed from here.

Every engine goes through :func:`run_job` (or :func:`run_engine`), so all measure alike:
:data:`ENGINE_DEFAULTS`, :data:`CHILD_ENV_DEFAULTS`, the child's warm-up and timing. Default
is vLLM's compiled mode; ``eager=True`` adds ``enforce_eager`` (faster start, for tests).
Never two engines at once: they would time each other. Failures raise :class:`EngineFailure`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specplugin.bench.workloads import CellPrompts
from specplugin.config import CONFIG_KEY, SPECULATOR_CLASS
from specplugin.profiling import PROBE_ENV

# vLLM's keyword arguments (besides ``model``) for every engine the project starts.
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # vLLM picks bf16 on CPU for "auto"; the zoo's small models want fp32
    "gpu_memory_utilization": 0.1,  # on CPU a fraction of the NUMA node; 0.92 fails when shared
    "disable_log_stats": False,  # the spec-decode counters come from the stats loggers
    "seed": 0,  # seeds sampling at temperature > 0
}

# every engine child's environment unless the caller's says otherwise
CHILD_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: ~58k tokens of the zoo target; more costs start-up
    "TOKENIZERS_PARALLELISM": "false",
    PROBE_ENV: "1",  # each worker answers the memory probe before every cell
}
POLL_S = 0.5


def engine_kwargs(overrides: Mapping[str, Any], eager: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` kwargs besides ``model``: defaults, ``overrides``, then ``enforce_eager``."""
    kwargs = {**ENGINE_DEFAULTS, **overrides}
    if eager:
        kwargs["enforce_eager"] = True
    return kwargs


def plugin_engine_kwargs(num_speculative_tokens: int, options: Mapping[str, Any]) -> dict:
    """The stock vLLM arguments that switch the plugin on, with ``options`` as its settings."""
    return {
        "speculative_config": {"method": "custom_class", "model": SPECULATOR_CLASS,
                               "num_speculative_tokens": num_speculative_tokens},
        "additional_config": {CONFIG_KEY: dict(options)},
    }


def machine_name() -> str:
    """The processor's model name (Linux), else what ``platform`` knows."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_environment() -> dict[str, Any]:
    """Command, UTC date, machine and versions: the head of every ``--json`` file."""
    import datetime
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "command": " ".join(["specplugin"] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": machine_name(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "versions": {d: version(d) for d in ("vllm-cpu", "vllm", "torch", "specplugin")},
    }


def add_eager_argument(parser: argparse.ArgumentParser) -> None:
    """``--eager`` with one help text for every command that starts engines."""
    parser.add_argument("--eager", action="store_true",
                        help="run vLLM eagerly (enforce_eager: engines start in ~30 s instead of "
                             "~50 s, decoding is slower); default: vLLM's own compiled mode")


class EngineFailure(RuntimeError):
    """A child exited non-zero or timed out; the message ends with its log's tail."""


@dataclass(frozen=True)
class EngineJob:
    """Everything one child needs: the model, vLLM's arguments and the cells to run."""

    label: str  # for logs and messages, e.g. "r1-vllm-ngram"
    model: str
    engine_kwargs: Mapping[str, Any]  # on top of ENGINE_DEFAULTS
    cells: tuple[dict[str, Any], ...]  # see cell_payload, or forward shapes for "forward_times"
    kind: str = "generate"  # how the child runs the cells: a key of engine.JOB_KINDS
    eager: bool = False
    return_token_ids: bool = False
    return_texts: bool = False  # decoded after the timed calls, so timing is unchanged
    overhead_pairs: int = 0  # "profile" jobs: timers-off/on runs after the ledger's run
    env: Mapping[str, str] = field(default_factory=dict)  # the child's, over child_env()
    timeout_s: float = 3600.0


@dataclass
class JobResult:
    startup_s: float = 0.0
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)  # by cell key
    warnings: list[str] = field(default_factory=list)  # what the child found wrong with vLLM
    log_path: Path | None = None


def cell_payload(cp: CellPrompts, n: int = 1) -> dict[str, Any]:
    """A cell as the child reads it (plain JSON)."""
    c = cp.cell
    return {"key": c.key, "workload": c.workload, "batch_size": c.batch_size,
            "temperature": c.temperature, "max_tokens": cp.max_tokens,
            "ignore_eos": cp.ignore_eos, "n": n, "prompts": [list(p) for p in cp.prompts],
            **({"temperatures": list(cp.temperatures)} if cp.temperatures else {})}


def cells_payload(cells: Sequence[CellPrompts]) -> tuple[dict[str, Any], ...]:
    return tuple(cell_payload(cp) for cp in cells)


def max_num_seqs(cells: Sequence[Mapping[str, Any]]) -> int:
    """``max_num_seqs`` as a user sets it: the largest batch of ``cells`` (vLLM's default,
    256, would size calibration and buffers for batches never run)."""
    return max(c["batch_size"] for c in cells)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in CHILD_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if _is_vllm_cpu():
        # vLLM detects CPU from the "vllm" dist's "+cpu" version; an install without it
        # fails every engine with "Device string must not be empty"
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


def _write_job(job: EngineJob, path: Path) -> None:
    """The child reads complete arguments, so the job file alone says how it ran."""
    record = asdict(job)
    record["engine_kwargs"] = engine_kwargs(job.engine_kwargs, job.eager)
    path.write_text(json.dumps(record))


def run_job(job: EngineJob, workdir: Path,
            on_event: Callable[[dict[str, Any]], None] = lambda e: None,
            verbose: bool = False) -> JobResult:
    """Run ``job`` in a fresh ``python -m specplugin.bench.engine`` and collect its lines.

    Output goes to ``workdir/LABEL.log`` (the terminal when ``verbose``). The child runs in
    ``workdir``: from a checkout's cwd ``python -m`` would import that ``specplugin``."""
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    stem = workdir / _slug(job.label)
    job_path, out_path, log_path = (stem.with_suffix(s) for s in (".job.json", ".jsonl", ".log"))
    _write_job(job, job_path)
    out_path.unlink(missing_ok=True)
    result = JobResult(log_path=None if verbose else log_path)
    command = [sys.executable, "-m", "specplugin.bench.engine", str(job_path), str(out_path)]
    with open(os.devnull if verbose else log_path, "w") as log:
        sink = {} if verbose else {"stdout": log, "stderr": subprocess.STDOUT}
        # its own process group: vLLM's engine-core and worker processes go with it
        proc = subprocess.Popen(command, env={**child_env(), **job.env}, cwd=workdir,
                                start_new_session=True, **sink)
        try:
            code = _follow(proc, job, out_path, result, on_event)
        finally:
            _end_group(proc)
    where = "its output above" if verbose else f"log {log_path}:\n{_log_tail(log_path)}"
    if code is None:
        raise EngineFailure(f"{job.label}: timed out after {job.timeout_s:.0f} s; {where}")
    if code != 0:
        raise EngineFailure(f"{job.label}: engine process exited with {code}; {where}")
    return result


def _end_group(proc: subprocess.Popen) -> None:
    """Kill what is left of the child's process group: an aborted child leaves vLLM's
    engine-core and worker processes polling, slowing every later engine."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _follow(proc: subprocess.Popen, job: EngineJob, out_path: Path, result: JobResult,
            on_event: Callable[[dict[str, Any]], None]) -> int | None:
    """Pass the child's events on as they come; its exit code, or None on timeout.
    ``done`` counts as success: vLLM's slow shutdown is cut short by :func:`_end_group`."""
    deadline, seen = time.monotonic() + job.timeout_s, 0
    while True:
        code = proc.poll()
        events, seen = _read_events(out_path, seen)
        for event in events:
            _record(result, event)
            on_event(event)
            if event["event"] == "done":
                return 0
        if code is not None:
            return code
        if time.monotonic() > deadline:
            return None  # run_job kills the child's process group
        time.sleep(POLL_S)


def _record(result: JobResult, event: dict[str, Any]) -> None:
    if event["event"] == "ready":
        result.startup_s = event["startup_s"]
    elif event["event"] == "cell":
        result.cells[event["key"]] = {k: v for k, v in event.items() if k != "event"}
    elif event["event"] == "warning":
        result.warnings.append(event["text"])


# ---------------------------------------------------------------- one engine, one call


@dataclass
class EngineRun:
    """One cell of a job: outputs in prompt order, vLLM's counters, what the job reported."""

    token_ids: list[list[int]]  # [num_prompts][num_output_tokens]
    texts: list[str] | None  # [num_prompts], when detokenize was asked
    seconds: float  # wall time of the timed generate() calls
    startup_s: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [num_speculative_tokens]
    # plugin only (None otherwise): step counters, objects frozen after warm-up, rank 0's
    # learning jobs, caught failures by name (each cost a step its drafts)
    plugin_steps: dict[str, int] | None = None
    worker_gc_frozen: int | None = None
    worker_learning: dict[str, float] | None = None
    proposer_failures: dict[str, int] | None = None
    warnings: list[str] = field(default_factory=list)
    log_path: Path | None = None

    @classmethod
    def from_job(cls, result: JobResult, key: str) -> EngineRun:
        """Cell ``key`` of a job run with ``return_token_ids``."""
        out = result.cells[key]
        counters = {k: out[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                         "accepted_per_pos")}
        return cls(token_ids=out["token_ids"], texts=out.get("texts"), seconds=out["seconds"],
                   startup_s=result.startup_s, plugin_steps=out.get("plugin_steps"),
                   worker_gc_frozen=out.get("worker_gc_frozen"),
                   worker_learning=out.get("worker_learning"),
                   proposer_failures=out.get("proposer_failures"),
                   warnings=list(result.warnings), log_path=result.log_path, **counters)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted / drafts (1.0 with no drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def prompt_cell(prompts: Sequence[str | Sequence[int]], max_tokens: int, temperature: float = 0.0,
                batch_size: int | None = None, key: str = "run",
                extra_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A cell of ``prompts`` (strings or token ids), ``batch_size`` at a time (default: all)."""
    return {"key": key, "workload": "prompts", "batch_size": batch_size or len(prompts),
            "temperature": temperature, "max_tokens": max_tokens, "n": 1,
            "prompts": [p if isinstance(p, str) else list(p) for p in prompts],
            "extra_args": dict(extra_args) if extra_args else None}


def run_engine(model: str | Path, overrides: Mapping[str, Any],
               prompts: Sequence[str | Sequence[int]], *, max_tokens: int,
               temperature: float = 0.0, batch_size: int | None = None, eager: bool = False,
               detokenize: bool = False, workdir: Path | None = None,
               label: str = "engine") -> EngineRun:
    """Generate ``prompts`` in one fresh engine, exactly ``max_tokens`` each (``ignore_eos``)."""
    cell = prompt_cell(prompts, max_tokens, temperature, batch_size)
    job = EngineJob(label=label, model=str(model), engine_kwargs=dict(overrides),
                    cells=(cell,), eager=eager, return_token_ids=True, return_texts=detokenize)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="specplugin-engine-"))
    return EngineRun.from_job(run_job(job, workdir), cell["key"])

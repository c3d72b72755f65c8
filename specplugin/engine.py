"""Run one vLLM engine in a fresh process and bring back its outputs and spec-decode counters.

Each configuration gets its own process so that engines never share memory or
threads and one crash cannot poison the next run; vLLM starts its engine core
with ``spawn`` anyway, so the child costs little extra. Used by the demo and the
tests; nothing here is imported by the plugin itself.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # vLLM picks bf16 on CPU for "auto"; the zoo's tiny models want fp32
    "enforce_eager": True,
    "gpu_memory_utilization": 0.1,
    "seed": 0,
    "disable_log_stats": False,
}

PLUGIN_SPEC = {"method": "custom_class", "model": "specplugin.Speculator"}


def plugin_engine_kwargs(num_speculative_tokens: int, options: dict) -> dict:
    """The stock vLLM arguments that switch the plugin on."""
    return {
        "speculative_config": {**PLUGIN_SPEC, "num_speculative_tokens": num_speculative_tokens},
        "additional_config": {"specplugin": options},
    }


@dataclass
class EngineRun:
    token_ids: list[list[int]]  # [num_prompts][num_output_tokens]
    texts: list[str]
    seconds: float  # wall time of the timed generate() call
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

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


def _run(model: str, engine_kwargs: dict, prompts: list, sampling: dict, warmup: bool,
         batch_size: int | None) -> EngineRun:
    from vllm import LLM

    llm = LLM(model=model, **{**ENGINE_DEFAULTS, **engine_kwargs})
    try:
        return _generate(llm, prompts, sampling, warmup, batch_size or len(prompts))
    finally:  # else the child waits forever at exit for vLLM's engine-core process
        llm.llm_engine.engine_core.shutdown()


def _generate(llm, prompts: list, sampling: dict, warmup: bool, batch_size: int) -> EngineRun:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from specplugin.bench.engine import counter_delta, spec_counters

    inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
    params = SamplingParams(**sampling)
    if warmup:  # first steps pay one-off costs (allocation, first kernels)
        llm.generate(inputs[:1], SamplingParams(**{**sampling, "max_tokens": 8}), use_tqdm=False)
    before = spec_counters(llm)
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(inputs), batch_size):  # batches one after the other
        outputs += llm.generate(inputs[i : i + batch_size], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = counter_delta(spec_counters(llm), before)
    return EngineRun(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        texts=[o.outputs[0].text for o in outputs],
        seconds=seconds,
        **counters,
    )


def _run_reporting_errors(*args) -> EngineRun:
    # vLLM's config errors (pydantic) do not pickle; send their text back instead
    try:
        return _run(*args)
    except Exception as err:
        raise RuntimeError(f"{type(err).__name__}: {err}") from None


def run_engine(model: str, engine_kwargs: dict, prompts: list, sampling: dict,
               warmup: bool = True, batch_size: int | None = None) -> EngineRun:
    """Generate ``prompts`` (strings or token-id lists) with one fresh engine in a child process,
    ``batch_size`` prompts at a time (default: all at once)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_run_reporting_errors, str(model), engine_kwargs, prompts, sampling, warmup,
                           batch_size).result()

"""Timers on vLLM's and the plugin's per-step methods, for ``specplugin profile`` only.

Nothing here runs in a normal engine. With ``SPECPLUGIN_PROFILE=1``, ``register()`` wraps
``EngineCore.collective_rpc`` so ``llm.collective_rpc("specplugin_profile", args=(action,))``
reaches the engine core and every worker. ``"start"`` wraps vLLM's methods named in the
tables below and every plugin function marked with
:func:`specplugin.profiling.phase`, and switches each process's
:class:`~specplugin.profiling.PhaseClock` on; ``"stop"`` returns the ledgers. Each phase is
charged its exclusive time; outside a timed step a wrapper costs one attribute read. A
method vLLM renamed makes ``start`` fail loudly (``tests/test_profile.py`` checks every row).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import time
from typing import Any

import torch

from specplugin.profiling import (BACKGROUND, BACKGROUND_WAIT, DRAFT_FORWARD, DRAFT_FORWARDS,
                                  DRAFT_TOKENS, DRAFTED, PHASE_MARK, PROBE_ENV, QUERY_TOKENS,
                                  WORKER, PhaseClock)
from specplugin.vllm_layer import patches

ENV = "SPECPLUGIN_PROFILE"  # "1" in specplugin profile's engine children only
RPC = "specplugin_profile"
# answered by each worker of an engine started with PROBE_ENV (memory_probe_ms)
PROBE_RPC = "specplugin_memory_probe"
# one clock per process
CLOCK = PhaseClock()

_RUNNER = "vllm.v1.worker.gpu_model_runner"
_PLUGIN_RUNNER = "specplugin.vllm_layer.worker"

# vLLM's methods: (module, class, attribute, phase). The plugin's
# own are marked where they are written (``specplugin.profiling.phase``); its phases are
# named "plugin:", "propose:", "draft:" and "scorer:".
Timed = tuple[tuple[str, str, str, str], ...]
# engine-core process: the scheduler and the waits on the workers
ENGINE_TIMED: Timed = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output"),
    ("vllm.v1.engine.core", "EngineCore", "post_step", "draft handoff"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "collective_rpc", WORKER),
    ("vllm.v1.executor.multiproc_executor", "FutureWrapper", "result", WORKER),
)
ENGINE_ROOT = ("vllm.v1.engine.core", "EngineCoreProc", "_process_engine_step")
# counted (DRAFTED): the engine core hands a step's drafts to the scheduler
ENGINE_DRAFTS = ("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids")
# the worker's per-step calls, each a root (nested if in the engine core's process);
# the first is the step
WORKER_ROOTS: Timed = (
    (_RUNNER, "GPUModelRunner", "execute_model", "runner (other)"),
    (_RUNNER, "GPUModelRunner", "sample_tokens", "runner (other)"),
    (_RUNNER, "GPUModelRunner", "take_draft_token_ids", "draft handoff"),
    # the plain-step decision around vLLM's sampling; untimed it would count as IPC
    (_PLUGIN_RUNNER, "PluginRunnerMixin", "sample_tokens", "plugin: runner"),
)
# worker process: vLLM's model runner
WORKER_TIMED: Timed = (
    (_RUNNER, "GPUModelRunner", "_update_states", "update_states"),
    (_RUNNER, "GPUModelRunner", "_prepare_inputs", "prepare_inputs"),
    (_RUNNER, "GPUModelRunner", "_calc_spec_decode_metadata", "prepare_inputs"),
    (_RUNNER, "GPUModelRunner", "_model_forward", "forward"),
    (_RUNNER, "GPUModelRunner", "_sample", "sample"),
    (_RUNNER, "GPUModelRunner", "_update_states_after_model_execute", "bookkeeping"),
    (_RUNNER, "GPUModelRunner", "_bookkeeping_sync", "bookkeeping"),
    (_RUNNER, "GPUModelRunner", "propose_draft_token_ids", "drafting"),
    (_RUNNER, "GPUModelRunner", "_copy_draft_token_ids_to_cpu", "draft handoff"),
)
# vLLM drafters: one ``set_forward_context`` block per forward ("draft forward", counted).
# The plugin's passes share one context, so its forwards are its model calls instead.
DRAFT_FORWARD_MODULES = ("vllm.v1.spec_decode.llm_base_proposer",)
# tensor methods that sync with the device: counted per phase
SYNC_METHODS = ("cpu", "item", "tolist")


def _timed(phase: str, clock: PhaseClock | None = None, count: str | None = None):
    clock = clock or CLOCK

    def around(original, self, *args, **kwargs):
        if not clock.stack:  # not inside a timed step
            return original(self, *args, **kwargs)
        if count is not None:
            clock.count(count)
        clock.enter(phase)
        try:
            return original(self, *args, **kwargs)
        finally:
            clock.exit()

    return around


def timed_call_cost_s(repeats: int = 20000) -> float:
    """Seconds one timed call adds: a method wrapped as the tables' are, inside an open
    step, minus the same call unwrapped."""

    class Probe:
        def method(self):
            return None

    clock = PhaseClock(CLOCK.sync)
    patches_wrapper = patches.wrapping(Probe.method, _timed("probe", clock))
    probe = Probe()
    clock.begin_step()
    start = time.perf_counter()
    for _ in range(repeats):
        patches_wrapper(probe)
    timed = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        probe.method()
    plain = time.perf_counter() - start
    clock.end_step()
    return max(timed - plain, 0.0) / repeats


def _timed_function(phase: str, original, count: str | None = None):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not CLOCK.stack:
            return original(*args, **kwargs)
        if count is not None:
            CLOCK.count(count)
        CLOCK.enter(phase)
        try:
            return original(*args, **kwargs)
        finally:
            CLOCK.exit()

    return wrapper


def _root(phase: str, step: bool):
    """A root of the clock while it is enabled; a nested phase inside an open one."""
    nested = _timed(phase)

    def around(original, self, *args, **kwargs):
        if CLOCK.stack:
            return nested(original, self, *args, **kwargs)
        if not CLOCK.enabled:
            return original(self, *args, **kwargs)
        CLOCK.begin_step(phase, step)
        try:
            return original(self, *args, **kwargs)
        finally:
            CLOCK.end_step()

    return around


def _counted_schedule(original, self, *args, **kwargs):
    """The scheduler's phase, and what the step verifies: query tokens, draft tokens."""
    if not CLOCK.stack:
        return original(self, *args, **kwargs)
    CLOCK.enter("schedule")
    try:
        output = original(self, *args, **kwargs)
    finally:
        CLOCK.exit()
    CLOCK.count(QUERY_TOKENS, output.total_num_scheduled_tokens)
    CLOCK.count(DRAFT_TOKENS, sum(len(d) for d in output.scheduled_spec_decode_tokens.values()))
    return output


def _counted_drafts(original, self, *args, **kwargs):
    """Count that drafting ran in the step (a skipped-drafting plain step hands none)."""
    if CLOCK.stack:
        CLOCK.count(DRAFTED)
    return original(self, *args, **kwargs)


def _timed_forward_context(original):
    @contextlib.contextmanager
    def wrapper(*args, **kwargs):
        with original(*args, **kwargs) as context:
            if not CLOCK.stack:
                yield context
                return
            CLOCK.count(DRAFT_FORWARDS)
            CLOCK.enter(DRAFT_FORWARD)
            try:
                yield context
            finally:
                CLOCK.exit()

    return wrapper


def _counted_sync(original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if CLOCK.stack:
            CLOCK.count_sync()
        return original(self, *args, **kwargs)

    return wrapper


def _owner(module_name: str, class_name: str):
    return getattr(importlib.import_module(module_name), class_name)


def _install_table(table: Timed) -> None:
    for module_name, class_name, attribute, phase in table:
        owner = _owner(module_name, class_name)
        if attribute == "schedule":
            patches.patch_around(owner, attribute, _counted_schedule)
        else:
            patches.patch_around(owner, attribute, _timed(phase))


def marked(modules: list) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, function) for every function marked with a phase in these
    modules' namespaces (a function imported into several is wrapped in each) and in their
    classes' own attributes."""
    found = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                found += [(value, attribute, method) for attribute, method in vars(value).items()
                          if hasattr(method, PHASE_MARK)]
            elif callable(value) and hasattr(value, PHASE_MARK):
                found.append((module, name, value))
    return found


def plugin_modules() -> list:
    """The plugin's modules this process has imported."""
    return [m for name, m in list(sys.modules.items())
            if name.split(".")[0] == "specplugin" and m is not None]


def _install_marked() -> None:
    for owner, attribute, func in marked(plugin_modules()):
        if patches.is_patched(owner, attribute):
            continue
        phase, count = getattr(func, PHASE_MARK)
        if isinstance(owner, type):
            patches.patch_around(owner, attribute, _timed(phase, count=count))
        else:
            patches.replace_attribute(owner, attribute, _timed_function(phase, func, count))


def install_engine_core() -> None:
    """The engine-core process's timers (once): its steps, the scheduler, the waits."""
    root = _owner(*ENGINE_ROOT[:2])
    if patches.is_patched(root, ENGINE_ROOT[2]):
        return
    _install_table(ENGINE_TIMED)
    patches.patch_around(_owner(*ENGINE_DRAFTS[:2]), ENGINE_DRAFTS[2], _counted_drafts)
    patches.patch_around(root, ENGINE_ROOT[2], _root("rest", step=True))


def install_worker(runner) -> None:
    """A worker process's timers (once); the target's ``compute_logits`` (wrapped on the
    model instance) is charged to ``forward``."""
    first = _owner(*WORKER_ROOTS[0][:2])
    if patches.is_patched(first, WORKER_ROOTS[0][2]):
        return
    _install_table(WORKER_TIMED)
    _install_marked()
    for module_name, class_name, attribute, phase in WORKER_ROOTS:
        patches.patch_around(_owner(module_name, class_name), attribute,
                             _root(phase, step=attribute == "execute_model"))
    for module_name in DRAFT_FORWARD_MODULES:
        module = importlib.import_module(module_name)
        patches.replace_attribute(module, "set_forward_context",
                                  _timed_forward_context(module.set_forward_context))
    for name in SYNC_METHODS:
        patches.replace_attribute(torch.Tensor, name, _counted_sync(getattr(torch.Tensor, name)))
    model = runner.model
    model.compute_logits = _timed_function("forward", model.compute_logits)
    if runner.device.type == "cuda":
        CLOCK.sync = torch.cuda.synchronize


def _act(action: str, install) -> Any:
    """One process's part of an RPC action."""
    if action == "start":
        install()
        CLOCK.take()
        CLOCK.enabled = True
        return None
    if action == "stop":
        CLOCK.enabled = False
        return CLOCK.take().as_dict()
    if action in ("pause", "resume"):
        CLOCK.enabled = action == "resume"
        return None
    if action == "timer_cost":
        return timed_call_cost_s()
    if action == "device":
        return "cuda (timers synchronise)" if CLOCK.sync is not None else "synchronous"
    raise ValueError(f"{RPC}: unknown action {action!r}; one of start, stop, pause, resume, "
                     "timer_cost, device.")


def worker_rpc(worker, action: str) -> Any:
    """Sent by the engine core to every worker."""
    if action == "device":
        return ("cuda (timers synchronise)" if worker.model_runner.device.type == "cuda"
                else "cpu (every phase synchronous)")
    runner = worker.model_runner
    if action == "start":  # baseline: count background seconds in the window only
        runner.__dict__["_specplugin_background_s"] = _background_s(runner)
    out = _act(action, lambda: install_worker(runner))
    if action == "stop":
        busy, waited = _background_s(runner)
        busy0, waited0 = runner.__dict__.get("_specplugin_background_s", (0.0, 0.0))
        out["counts"][BACKGROUND] = busy - busy0
        out["counts"][BACKGROUND_WAIT] = waited - waited0
    return out


def _background_s(runner) -> tuple[float, float]:
    """(seconds the worker's wait ran plugin work: held learning and publishing; seconds
    held learning ran on a step)."""
    from specplugin.vllm_layer.worker import learning_background

    background = learning_background(runner)
    busy = waited = 0.0
    if background is not None:
        background.run_pending()
        busy, waited = background.busy_s, background.waited_s
    publisher = getattr(runner, "_stats_publisher", None)
    if publisher is not None and getattr(runner, "publishes_in_wait", False):
        busy += publisher.busy_s
    return busy, waited


def memory_probe_ms(worker=None, num_floats: int = 4_000_000, repeats: int = 30) -> float:
    """Median ms to copy ``num_floats`` float32 (16 MB) over ``repeats`` copies (after 5
    warm-ups): the memory speed this process gets. ``worker``: unused (vLLM's executor
    passes it). On the 2-vCPU VM an engine's decode speed varies up to 1.5x with its
    worker's memory speed (correlation ~0.86), so benchmarks record it."""
    source = torch.ones(num_floats, dtype=torch.float32)
    target = torch.empty_like(source)
    times = []
    for i in range(repeats + 5):
        start = time.perf_counter()
        target.copy_(source)
        if i >= 5:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def engine_rpc(original, engine_core, method, timeout=None, args=(), kwargs=None):
    """Around ``EngineCore.collective_rpc``: ``specplugin_profile`` returns
    ``[{"engine": ..., "worker": ...}]`` per worker; ``specplugin_memory_probe`` each
    worker's :func:`memory_probe_ms`."""
    if method == PROBE_RPC:
        return original(engine_core, memory_probe_ms, timeout, (), None)
    if method != RPC:
        return original(engine_core, method, timeout, args, kwargs)
    engine = _act(args[0], install_engine_core)
    workers = original(engine_core, worker_rpc, timeout, args, kwargs)
    return [{"engine": engine, "worker": w} for w in workers]


def install_rpc() -> None:
    """Called by ``register()`` when ``SPECPLUGIN_PROFILE=1`` or ``SPECPLUGIN_MEMORY_PROBE=1``."""
    from vllm.v1.engine.core import EngineCore

    if not patches.is_patched(EngineCore, "collective_rpc"):
        patches.patch_around(EngineCore, "collective_rpc", engine_rpc)


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def probe_requested() -> bool:
    """``specplugin bench``'s engine children: :func:`memory_probe_ms` before each cell."""
    return os.environ.get(PROBE_ENV) == "1"


# front-end output processing runs beside the engine's steps: reported, not summed
FRONT_END = ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs")


class FrontEndTimer:
    """Seconds the front end spends in vLLM's output processing (detokenizing included)."""

    def __init__(self):
        self.enabled = False
        self.seconds = 0.0

    def install(self) -> None:
        owner = _owner(*FRONT_END[:2])
        if patches.is_patched(owner, FRONT_END[2]):
            return

        def around(original, this, *args, **kwargs):
            if not self.enabled:
                return original(this, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(this, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        patches.patch_around(owner, FRONT_END[2], around)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

"""One engine, the plugin's full union, shared by the end-to-end tests that need no probe.

Each vLLM engine costs this machine 30-40 s to start; the end-to-end modules used to
start their own reference engine (no speculation) and one engine per proposer subset.
Now they register cells here at import; the test run starts one engine with every
proposer (draft model, n-gram, suffix) and runs every registered cell in it, in
registration order. Within that engine a cell picks what it runs with the plugin's
per-request options: ``specplugin_max_k: 0`` for the reference (the step decodes
plainly: vLLM's non-speculative path, see ``PluginRunnerMixin._prepare_inputs``), and
``specplugin_proposers`` for a subset. That the plain path equals an engine without
speculation at all is checked by ``check-lossless`` (tests/test_lossless.py), which
compares every method with a real engine without speculation.

The engine runs in the layout users run by default (engine core and worker in
processes of their own; the rest of the suite runs vLLM's engine core in-process, see
tests/conftest.py). The step arbiter alternates speculative and plain blocks of steps
(``fault_injection.alternate_blocks``), so every cell also exercises plain steps that
skip drafting and the draft model catching up on what it skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from specplugin.bench.runner import EngineJob, EngineRun, plugin_engine_kwargs, prompt_cell, run_job
from specplugin.zoo import zoo_path

K = 8  # num_speculative_tokens of the shared engine
REFERENCE = {"specplugin_max_k": 0}  # a request decoded without drafts
# the process layout users run by default: vLLM's engine core and its worker in processes
# of their own (the suite's other engines run the engine core in-process: tests/conftest.py)
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

# key -> cell builder (called with the zoo folder once the test run starts the engine)
_CELLS: dict[str, Callable[[Path], dict[str, Any]]] = {}


def add_cell(key: str, prompts=None, *, max_tokens: int = 0, batch_size: int | None = None,
             temperature: float = 0.0, options: dict[str, Any] | None = None,
             build: Callable[[Path], dict[str, Any]] | None = None) -> str:
    """Register a cell (at import); returns its key. ``options``: each request's
    per-request options; ``build``: a function of the zoo folder that returns the cell
    (for prompts drawn from the zoo), instead of ``prompts``."""
    if key in _CELLS:
        raise ValueError(f"shared engine cell {key!r} registered twice")

    def make(zoo_root: Path) -> dict[str, Any]:
        cell = build(zoo_root) if build else prompt_cell(prompts, max_tokens, temperature,
                                                        batch_size, key=key)
        return {**cell, "key": key, "extra_args": dict(options) if options else None}

    _CELLS[key] = make
    return key


def engine_options(zoo_root: Path) -> dict[str, Any]:
    return {"proposers": ["draft", "ngram", "suffix"],
            "draft_model": str(zoo_path("draft", zoo_root)),
            "fault_injection": {"alternate_blocks": True}}


def state_dir(workdir: Path) -> Path:
    """Where the shared engine's union keeps what it learned (``state_dir``; it starts
    empty, so the engine starts cold like the others)."""
    return workdir / "state"


def run_shared(zoo_root: Path, workdir: Path) -> dict[str, EngineRun]:
    """Every registered cell in one engine: key -> its run."""
    cells = tuple(make(zoo_root) for make in _CELLS.values())
    options = {**engine_options(zoo_root), "state_dir": str(state_dir(workdir))}
    job = EngineJob(label="shared-union", model=str(zoo_path("target", zoo_root)),
                    engine_kwargs=plugin_engine_kwargs(K, options),
                    cells=cells, eager=True, return_token_ids=True,
                    env=MULTIPROCESS)  # the layout users run (tests/conftest.py)
    result = run_job(job, workdir)
    return {key: EngineRun.from_job(result, key) for key in _CELLS}

"""The step's drafts travel back with the step's output: one worker round trip less per step.

With synchronous scheduling, vLLM's engine core fetches drafts in a second call after
every step (``EngineCore.post_step`` -> ``executor.take_draft_token_ids()``); with the
multiprocess executor that is an IPC round trip (~1 ms per step on 2 cores, plain steps too).

The plugin's runner already has the drafts when ``sample_tokens`` returns, so it attaches
them to the ``ModelRunnerOutput`` (:func:`attach`). In the engine core, the executor keeps
them (:func:`sample_tokens_keeping_drafts`) and ``take_draft_token_ids`` returns them
(:func:`take_kept_drafts`). An output without the attribute (vLLM's own methods, plugin
off) leaves vLLM's call unchanged.
"""

from __future__ import annotations

from typing import Any

ATTRIBUTE = "specplugin_draft_token_ids"
_KEPT = "_specplugin_kept_drafts"  # on the executor, in the engine-core process
_MISSING = object()


def attach(output: Any, draft_token_ids: Any) -> None:
    """Worker side: the step's drafts (a ``DraftTokenIds`` or None) ride on ``output``."""
    setattr(output, ATTRIBUTE, draft_token_ids)


def sample_tokens_keeping_drafts(original, executor, *args, **kwargs):
    """Around ``MultiprocExecutor.sample_tokens``: keep the drafts the output carries."""
    output = original(executor, *args, **kwargs)
    drafts = getattr(output, ATTRIBUTE, _MISSING)  # a Future (non_block) carries none
    if drafts is not _MISSING:
        executor.__dict__[_KEPT] = drafts
    return output


def take_kept_drafts(original, executor):
    """Around ``MultiprocExecutor.take_draft_token_ids``: the kept drafts, once, else ask."""
    kept = executor.__dict__.pop(_KEPT, _MISSING)
    return original(executor) if kept is _MISSING else kept


def install() -> None:
    """Engine-core side (``register()``, every process; only the engine core calls these)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from specplugin.vllm_layer import patches

    if not patches.is_patched(MultiprocExecutor, "sample_tokens"):
        patches.patch_around(MultiprocExecutor, "sample_tokens", sample_tokens_keeping_drafts)
    if not patches.is_patched(MultiprocExecutor, "take_draft_token_ids"):
        patches.patch_around(MultiprocExecutor, "take_draft_token_ids", take_kept_drafts)

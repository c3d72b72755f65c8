"""The step's drafts travel back with the step's output: one worker round trip less per step.

With synchronous scheduling and a speculative config, vLLM's engine core asks its
workers for the step's drafts in a second call after every step
(``EngineCore.post_step`` -> ``executor.take_draft_token_ids()``). With vLLM's
multiprocess executor (every CPU engine, and CUDA with several workers) that call is
a round trip through the executor's shared-memory queues: ``specplugin profile``
showed it as the plugin's and vLLM's speculative methods' extra ``executor (IPC)``
time over an engine without speculation, about a millisecond per step on the
project's 2-core machine, paid on plain steps too.

The plugin's model runner already has the drafts when ``sample_tokens`` returns (the
plugin forces synchronous scheduling, and vLLM drafts before building the output), so
it attaches them to the step's ``ModelRunnerOutput`` (:func:`attach`; the executor
pickles the object, attribute included). In the engine core, the executor's
``sample_tokens`` keeps what came back and its ``take_draft_token_ids`` returns that
instead of asking the workers (:func:`sample_tokens_keeping_drafts`,
:func:`take_kept_drafts`; patch registry, :func:`install`). An output without the
attribute (vLLM's own speculative methods, the plugin off) leaves vLLM's call as it
was. The drafts are the same object vLLM would have fetched: the runner's
``take_draft_token_ids`` reads state that nothing changes between the two calls.
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

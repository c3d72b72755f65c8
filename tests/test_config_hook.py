"""The front-end config hook, on configs vLLM really builds (no engine starts).

``EngineArgs.create_engine_config()`` runs vLLM's whole config path in this
process, the plugin's hook included, in a few seconds.
"""

import logging
from types import SimpleNamespace

import pytest

from specplugin.zoo import zoo_path

pytestmark = pytest.mark.vllm


def _config(spec_extra=None, options=None, **engine):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "custom_class", "model": "specplugin.Speculator",
            "num_speculative_tokens": 4, **(spec_extra or {})}
    options = options or {"proposers": ["draft"], "draft_model": str(zoo_path("draft"))}
    args = EngineArgs(model=str(zoo_path("target")), dtype="float32", enforce_eager=True,
                      gpu_memory_utilization=0.1, speculative_config=spec,
                      additional_config={"specplugin": options}, **engine)
    return args.create_engine_config()


def test_the_draft_proposer_becomes_vllms_draft_model_in_the_plugins_worker():
    config = _config()
    assert config.speculative_config.method == "draft_model"
    assert config.parallel_config.worker_cls.endswith("PluginCPUWorker")
    assert config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("setting, value", [
    ("draft_tensor_parallel_size", 1),
    ("suffix_decoding_max_tree_depth", 8),
    ("max_model_len", 256),
])
def test_speculative_settings_the_plugin_would_drop_are_refused_by_name(setting, value):
    with pytest.raises(Exception) as err:
        _config({setting: value})
    assert f"speculative_config sets {setting}={value!r}" in str(err.value)
    assert "remove it from speculative_config" in str(err.value)


def test_async_scheduling_is_switched_off_with_a_log_line(caplog):
    from specplugin.vllm_layer.config_hook import ensure_sync_scheduling

    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    with caplog.at_level(logging.WARNING, logger="specplugin"):
        ensure_sync_scheduling(config)
    assert config.scheduler_config.async_scheduling is False
    assert "async scheduling is not supported" in caplog.text


def test_the_plugins_runner_refuses_to_start_under_async_scheduling():
    from specplugin.vllm_layer.worker import PluginCPUModelRunner

    runner = object.__new__(PluginCPUModelRunner)  # only the guard runs
    runner.use_async_scheduling = True
    with pytest.raises(RuntimeError, match="needs synchronous scheduling"):
        runner._install_plugin_drafter()

"""Front-end check of the plugin's settings, run while vLLM builds its ``VllmConfig``."""

from __future__ import annotations

import logging

from specplugin.config import CONFIG_KEY, SPECULATOR_CLASS, SpecPluginConfig, parse

logger = logging.getLogger("specplugin")


def selects_plugin(vllm_config) -> bool:
    spec = vllm_config.speculative_config
    return spec is not None and spec.method == "custom_class" and spec.model == SPECULATOR_CLASS


def plugin_options(vllm_config):
    extra = vllm_config.additional_config
    return extra.get(CONFIG_KEY) if isinstance(extra, dict) else None


def plugin_config(vllm_config) -> SpecPluginConfig:
    """Parse and validate; raises ``SpecPluginConfigError`` with the key and the fix."""
    return parse(plugin_options(vllm_config), vllm_config.speculative_config.num_speculative_tokens)


def check_vllm_config(vllm_config) -> None:
    if not selects_plugin(vllm_config):
        if plugin_options(vllm_config) is not None:
            logger.warning(
                'additional_config["%s"] is set but speculative_config does not select '
                '%s (method "custom_class", model "%s"): the plugin stays off.',
                CONFIG_KEY, SPECULATOR_CLASS, SPECULATOR_CLASS,
            )
        return
    plugin_config(vllm_config)

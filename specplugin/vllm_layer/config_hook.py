"""Front-end check of the plugin's settings, run while vLLM builds its ``VllmConfig``."""

from __future__ import annotations

import logging

from specplugin.config import (
    CONFIG_KEY,
    SPECULATOR_CLASS,
    SpecPluginConfig,
    SpecPluginConfigError,
    check_shared_vocabulary,
    parse,
)

logger = logging.getLogger("specplugin")

# the plugin's workers (specplugin.vllm_layer.worker), named here so that this module
# stays importable without building them
CPU_WORKER = "specplugin.vllm_layer.worker.PluginCPUWorker"
GPU_WORKER = "specplugin.vllm_layer.worker.PluginGPUWorker"


def selects_plugin(vllm_config) -> bool:
    """True for the user's switch (``custom_class`` naming ``specplugin.Speculator``) and
    for the draft-model form :func:`use_worker_layer` turns it into."""
    spec = vllm_config.speculative_config
    if spec is None:
        return False
    if spec.method == "custom_class" and spec.model == SPECULATOR_CLASS:
        return True
    return spec.method == "draft_model" and vllm_config.parallel_config.worker_cls in (
        CPU_WORKER, GPU_WORKER)


def plugin_options(vllm_config):
    extra = vllm_config.additional_config
    return extra.get(CONFIG_KEY) if isinstance(extra, dict) else None


def plugin_config(vllm_config) -> SpecPluginConfig:
    """Parse and validate; raises ``SpecPluginConfigError`` with the key and the fix."""
    return parse(plugin_options(vllm_config), vllm_config.speculative_config.num_speculative_tokens)


def check_vllm_config(vllm_config) -> None:
    spec = vllm_config.speculative_config
    if (spec is not None and spec.method == "draft_model"
            and vllm_config.model_config is spec.draft_model_config):
        return  # the config vLLM derives to load a draft model, not the user's
    if not selects_plugin(vllm_config):
        if plugin_options(vllm_config) is not None:
            logger.warning(
                'additional_config["%s"] is set but speculative_config does not select '
                '%s (method "custom_class", model "%s"): the plugin stays off.',
                CONFIG_KEY, SPECULATOR_CLASS, SPECULATOR_CLASS,
            )
        return
    config = plugin_config(vllm_config)
    if "draft" in config.proposers and vllm_config.speculative_config.method == "custom_class":
        use_worker_layer(vllm_config, config)


def use_worker_layer(vllm_config, config: SpecPluginConfig) -> None:
    """Run the draft proposer through the plugin's worker layer.

    vLLM's model runner gives a drafter the paged KV cache, block tables and sampling
    metadata only when ``speculative_config`` names a draft model. So the user's
    ``custom_class`` switch becomes vLLM's own ``draft_model`` config for the model at
    ``additional_config["specplugin"]["draft_model"]`` (same K, draft probabilities
    kept for verification), and ``parallel_config.worker_cls`` becomes the plugin's
    worker, whose runner puts the plugin's drafter in place of vLLM's.
    """
    from vllm.config import SpeculativeConfig
    from vllm.platforms import current_platform

    user_spec = vllm_config.speculative_config
    parallel = vllm_config.parallel_config
    worker = CPU_WORKER if current_platform.is_cpu() else GPU_WORKER
    if parallel.worker_cls not in ("auto", worker):
        raise SpecPluginConfigError(
            f"the draft proposer runs in specplugin's own worker, but worker_cls is set to "
            f"{parallel.worker_cls!r}; leave worker_cls unset (\"auto\") to use "
            f'additional_config["{CONFIG_KEY}"]["proposers"] = ["draft"].'
        )
    from transformers import AutoConfig

    # before vLLM builds the draft's config, whose own check would not name our setting
    check_shared_vocabulary(
        target_tokenizer=vllm_config.model_config.tokenizer,
        draft_model=config.draft_model,
        target_vocab_size=vllm_config.model_config.get_vocab_size(),
        draft_vocab_size=AutoConfig.from_pretrained(config.draft_model).vocab_size,
    )
    vllm_config.speculative_config = SpeculativeConfig(
        method="draft_model",
        model=config.draft_model,
        num_speculative_tokens=config.num_speculative_tokens,
        draft_sample_method="probabilistic",
        enforce_eager=user_spec.enforce_eager,
        target_model_config=user_spec.target_model_config,
        target_parallel_config=user_spec.target_parallel_config,
    )
    parallel.worker_cls = worker

"""Front-end check of the plugin's settings, run while vLLM builds its ``VllmConfig``."""

from __future__ import annotations

import dataclasses
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
    ensure_sync_scheduling(vllm_config)
    from specplugin.vllm_layer.metrics_export import watch_engine

    watch_engine(vllm_config.instance_id)  # the plugin's counters in this process's /metrics
    if vllm_config.speculative_config.method != "custom_class":
        return  # already the draft-model form built below
    if "draft" in config.proposers:
        use_worker_layer(vllm_config, config)
    else:
        select_plugin_worker(vllm_config)


def select_plugin_worker(vllm_config) -> None:
    """Every proposer runs in the plugin's worker, whose runner gives proposers request
    ids, sampling parameters and verification results (vLLM's hook gives token ids only)."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    worker = CPU_WORKER if current_platform.is_cpu() else GPU_WORKER
    if parallel.worker_cls not in ("auto", worker):
        raise SpecPluginConfigError(
            f"specplugin runs its proposers in its own worker, but worker_cls is set to "
            f"{parallel.worker_cls!r}; leave worker_cls unset (\"auto\") when "
            f'speculative_config selects {SPECULATOR_CLASS}.'
        )
    parallel.worker_cls = worker


def ensure_sync_scheduling(vllm_config) -> None:
    """The plugin needs synchronous scheduling: its per-row draft cuts and the draft
    probabilities it hands the rejection sampler line up with the batch rows of the
    step that drafted them, which async scheduling (drafting step N+1 while step N
    is still being scheduled) does not guarantee. Switched off here, with a log
    line; the plugin's runner refuses to start if it is on anyway."""
    scheduler = vllm_config.scheduler_config
    if scheduler.async_scheduling:
        logger.warning("specplugin: async scheduling is not supported with the plugin's "
                       "proposers; switching it off (scheduler_config.async_scheduling=False).")
        scheduler.async_scheduling = False


# Fields of the user's SpeculativeConfig that use_worker_layer carries into the draft-model
# config it builds, and those vLLM derives itself (never set by the user).
_CARRIED = frozenset({"method", "model", "num_speculative_tokens", "enforce_eager",
                      "target_model_config", "target_parallel_config"})
_DERIVED = frozenset({"draft_model_config", "draft_parallel_config"})


def dropped_settings(spec) -> list[str]:
    """User settings of ``spec`` (a ``SpeculativeConfig``) that differ from vLLM's defaults
    and that the plugin would not carry over: each would be silently ignored."""
    dropped = []
    for f in dataclasses.fields(spec):
        if f.name in _CARRIED | _DERIVED:
            continue
        value = getattr(spec, f.name)
        if value == _default_of(f):
            continue
        if f.name.startswith("prompt_lookup_") and value in (0, None):  # vLLM zeroes these
            continue
        dropped.append(f"{f.name}={value!r}")
    return dropped


def _default_of(f: dataclasses.Field):
    default = f.default
    if default is dataclasses.MISSING:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    inner = getattr(default, "default", default)  # pydantic Field(default=...)
    return None if inner is dataclasses.MISSING or type(inner).__name__ == "PydanticUndefinedType" else inner


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

    user_spec = vllm_config.speculative_config
    dropped = dropped_settings(user_spec)
    if dropped:
        raise SpecPluginConfigError(
            f"speculative_config sets {', '.join(dropped)}, which the plugin's draft proposer "
            "does not carry over to the draft model it runs (it keeps only method, model, "
            "num_speculative_tokens and enforce_eager); remove "
            f"{'it' if len(dropped) == 1 else 'them'} from speculative_config."
        )
    select_plugin_worker(vllm_config)
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

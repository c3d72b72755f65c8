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

# named, not imported, so this module imports without building the workers
CPU_WORKER = "specplugin.vllm_layer.worker.PluginCPUWorker"
GPU_WORKER = "specplugin.vllm_layer.worker.PluginGPUWorker"


def selects_plugin(vllm_config) -> bool:
    """True for ``custom_class`` naming ``specplugin.Speculator`` or its draft-model form."""
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


def worker_config(vllm_config) -> SpecPluginConfig:
    """The settings as this worker applies them: test failures pinned to another
    tensor-parallel rank (``fault_injection["rank"]``) left out."""
    from specplugin.vllm_layer.ranks import tensor_parallel_rank

    config = plugin_config(vllm_config)
    faults = config.fault_injection.on_rank(tensor_parallel_rank())
    if faults is config.fault_injection:
        return config
    return dataclasses.replace(config, fault_injection=faults)


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
    """Use the plugin's worker (vLLM's hook gives proposers token ids only)."""
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
    """Switch off async scheduling: drafts must line up with the rows that drafted them."""
    scheduler = vllm_config.scheduler_config
    if scheduler.async_scheduling:
        logger.warning("specplugin: async scheduling is not supported with the plugin's "
                       "proposers; switching it off (scheduler_config.async_scheduling=False).")
        scheduler.async_scheduling = False


# SpeculativeConfig fields use_worker_layer carries over / that vLLM derives itself
_CARRIED = frozenset({"method", "model", "num_speculative_tokens", "enforce_eager",
                      "target_model_config", "target_parallel_config"})
_DERIVED = frozenset({"draft_model_config", "draft_parallel_config"})


def dropped_settings(spec) -> list[str]:
    """Non-default settings of ``spec`` the plugin would silently not carry over."""
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
    """Run the draft proposer through the plugin's worker layer: vLLM gives a drafter the
    KV cache only for a ``draft_model`` config, so ``custom_class`` becomes one (same K,
    draft probs kept) and the plugin's worker swaps in the plugin's drafter."""
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

    # before vLLM's own check, which would not name our setting
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

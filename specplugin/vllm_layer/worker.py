"""The plugin's worker layer: vLLM's worker and model runner, plus what proposers need.

vLLM's ``custom_class`` hook hands a proposer token ids only. Proposers that run a
model on the paged KV cache need more, so when the plugin is configured with such
a proposer the config hook (:mod:`specplugin.vllm_layer.config_hook`) sets
``parallel_config.worker_cls`` to a worker below; the user still passes only
``speculative_config`` and ``additional_config``.

What the layer adds to vLLM's runner (:class:`PluginRunnerMixin`):

- the plugin's drafter in place of vLLM's (built before the models load, so the
  draft model's attention layers register in vLLM's static forward context and get
  KV tensors in the same paged block pool as the target's);
- :meth:`~PluginRunnerMixin.step_context`: request ids, each request's
  ``SamplingParams``, tokens each may still emit, and the block tables;
- per-request draft lengths: the drafter returns a [num_reqs, positions] tensor and
  the number of tokens each row keeps; the rows are cut before the scheduler sees them.

The CPU and CUDA versions are the same few lines: the mixin over vLLM's runner,
and a worker that builds that runner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from specplugin.proposers.draft import truncate_rows
from specplugin.vllm_layer import patches
from specplugin.vllm_layer.config_hook import plugin_config

_NO_LIMIT = 1 << 30


@dataclass(frozen=True)
class StepContext:
    """The batch as proposers see it at drafting time (rows = the runner's batch rows)."""

    req_ids: list[str]  # [num_reqs]
    sampling_params: list  # [num_reqs] vllm.SamplingParams (None for pooling requests)
    # [num_reqs] max_tokens minus tokens emitted before this step (this step's own
    # tokens are sampled but not yet counted when the drafter runs)
    remaining_tokens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] the target's KV blocks


class PluginRunnerMixin:
    """Mixed in front of vLLM's ``GPUModelRunner`` or ``CPUModelRunner``."""

    def _install_plugin_drafter(self) -> None:
        from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

        config = plugin_config(self.vllm_config)
        self._draft_lengths: list[int] | None = None
        if "draft" in config.proposers:
            self.drafter = PluginDraftProposer(self.vllm_config, self.device, self, config)

    def step_context(self) -> StepContext:
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        states = [self.requests[r] for r in req_ids]
        params = [s.sampling_params for s in states]
        remaining = [
            _NO_LIMIT if p is None or p.max_tokens is None else p.max_tokens - len(s.output_token_ids)
            for p, s in zip(params, states)
        ]
        block_table = batch.block_table[0].get_device_tensor(len(req_ids))
        return StepContext(req_ids, params, remaining, block_table)

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False) -> None:
        super()._copy_draft_token_ids_to_cpu(scheduler_output, zeros_only=zeros_only)
        if zeros_only:  # the drafter did not run this step: no drafts at all
            self._draft_lengths = [0] * self.input_batch.num_reqs
        else:
            self._draft_lengths = getattr(self.drafter, "last_lengths", None)

    def _get_draft_token_ids_cpu(self) -> tuple[list[list[int]], list[str]]:
        draft_token_ids, req_ids = super()._get_draft_token_ids_cpu()
        if self._draft_lengths is not None:
            draft_token_ids = truncate_rows(draft_token_ids, self._draft_lengths)
        return draft_token_ids, req_ids


class PluginCPUModelRunner(PluginRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self._install_plugin_drafter()


class PluginCPUWorker(CPUWorker):
    def init_device(self) -> None:
        # vLLM's CPU worker builds its runner inline from this module-level name
        with patches.swapped(cpu_worker, "CPUModelRunner", PluginCPUModelRunner):
            super().init_device()


def __getattr__(name: str):
    # The CUDA worker imports CUDA-only modules; build it only when asked for.
    if name in ("PluginGPUWorker", "PluginGPUModelRunner"):
        return _cuda_classes()[name]
    raise AttributeError(name)


@functools.cache
def _cuda_classes() -> dict[str, type]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class PluginGPUModelRunner(PluginRunnerMixin, GPUModelRunner):
        def __init__(self, vllm_config, device: torch.device):
            super().__init__(vllm_config, device)
            self._install_plugin_drafter()

    class PluginGPUWorker(Worker):
        def _make_model_runner(self):
            return PluginGPUModelRunner(self.vllm_config, self.device)

    return {"PluginGPUWorker": PluginGPUWorker, "PluginGPUModelRunner": PluginGPUModelRunner}

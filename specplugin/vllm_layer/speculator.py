"""``specplugin.Speculator``: the object vLLM's ``custom_class`` hook builds in each worker.

vLLM calls ``propose(...)`` once per engine step with the batch's token buffers and
verifies whatever drafts come back with its own rejection sampler, so output stays
exactly the target's. This adapter turns vLLM's arguments into a
:class:`~specplugin.proposers.base.DraftBatch` and shields the engine from
proposer failures: an exception costs that step its drafts, never a request.
"""

from __future__ import annotations

import logging

import numpy as np

from specplugin.proposers import DraftBatch, build_proposer
from specplugin.vllm_layer.config_hook import plugin_config

logger = logging.getLogger("specplugin")


class Speculator:
    def __init__(self, vllm_config):
        self.config = plugin_config(vllm_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.proposer = build_proposer(self.config.proposers[0], self.config)
        self.num_failures = 0

    def load_model(self, target_model) -> None:
        """The n-gram proposer needs no weights; the target model is not used."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],  # [num_reqs][num_sampled] tokens of the last step
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs] context length per row
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        slot_mappings=None,
    ) -> list[list[int]]:
        num_reqs = len(sampled_token_ids)
        num_tokens = num_tokens_no_spec[:num_reqs]
        # room left: context + draft must stay within max_model_len
        max_draft_lens = np.clip(self.max_model_len - num_tokens, 0, self.num_speculative_tokens)
        rows = tuple(i for i, s in enumerate(sampled_token_ids) if s and max_draft_lens[i] > 0)
        batch = DraftBatch(token_ids_cpu, num_tokens, max_draft_lens, rows)
        try:
            return self.proposer.propose(batch)
        except Exception:  # a proposer bug must not fail requests: decode plainly
            self.num_failures += 1
            if self.num_failures == 1:
                logger.exception("specplugin: proposer %r failed; this step decodes without "
                                 "drafts (logged once)", self.proposer.name)
            return [[] for _ in range(num_reqs)]

"""The draft proposer inside vLLM: vLLM's draft-model machinery, our drafting loop.

vLLM's ``DraftModelProposer`` already does what is hard: it loads the draft model
with its own layer names so that its attention layers get KV tensors in the same
paged block pool as the target's (indexed by the target's block tables), and its
first pass re-reads each request's newly verified tokens into that cache. This
subclass keeps all of that and replaces only the drafting loop, so that

- each request stops drafting when the draft's own confidence, calibrated online
  against verification results, says the next token is unlikely to be used, and goes
  on past the default K up to ``num_speculative_tokens`` while it stays likely (the
  rule, the calibration and their bookkeeping live in the vLLM-free
  :mod:`specplugin.proposers.draft`); the loop ends as soon as no request drafts;
- no request drafts beyond the tokens it may still emit (``max_tokens``);
- the draft probabilities of every position are kept at temperature > 0, so vLLM's
  rejection sampler verifies against the distribution the tokens were drawn from.

The loop is batched over requests: one forward per draft position for the whole
batch, never a per-request Python loop over tokens, never a recompute of the context.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

from specplugin.config import SpecPluginConfig
from specplugin.proposers.draft import (
    AcceptanceCalibration,
    CostModel,
    DraftRun,
    OutcomeTracker,
    StopRule,
    confidence_of,
)

logger = logging.getLogger("specplugin")


class PluginDraftProposer(DraftModelProposer):
    """``DraftModelProposer`` with per-request early stopping and extension.

    ``runner`` is the plugin's model runner (:mod:`specplugin.vllm_layer.worker`);
    its :meth:`step_context` gives the request ids and sampling parameters of the
    batch rows.
    """

    def __init__(self, vllm_config, device, runner, plugin_config: SpecPluginConfig):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.plugin_runner = runner  # vLLM's base class does not keep it
        settings = plugin_config.draft
        k_max = plugin_config.num_speculative_tokens
        self.fixed_min_acceptance = settings.min_acceptance  # None: measured by self.costs
        self.rule = StopRule(k=min(settings.k, k_max), k_max=k_max)
        self.calibration = AcceptanceCalibration()
        self.outcomes = OutcomeTracker(self.calibration)
        self.costs = CostModel()
        self._last_call: float | None = None  # perf_counter() of the previous propose()
        self._last_forwards = self._last_draft_tokens = 0  # of the previous propose()
        self.num_failures = 0
        # [num_reqs] draft tokens kept per row of the last propose(); the runner cuts
        # the rows of the returned [num_reqs, positions] tensor to these lengths.
        self.last_lengths: list[int] | None = None

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor:
        """vLLM's drafting call (arguments as :meth:`_propose`). A failure here costs the
        batch this step's drafts (it decodes plainly, still exactly the target's output),
        never a request; it is logged once."""
        try:
            return self._propose(num_speculative_tokens, *args, **kwargs)
        except Exception:
            self.num_failures += 1
            if self.num_failures == 1:
                logger.exception("specplugin: the draft proposer failed; this step decodes "
                                 "without drafts (logged once)")
            num_reqs = len(self.plugin_runner.input_batch.req_ids)
            self.last_lengths = [0] * num_reqs
            self._last_draft_probs = None
            self.outcomes.forget()
            self._last_call = None
            return torch.zeros((num_reqs, 1), dtype=torch.int64, device=self.device)

    def _propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [num_tokens]
        target_positions: torch.Tensor,  # [num_tokens]
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden_size] (unused by draft models)
        next_token_ids: torch.Tensor,  # [num_reqs]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [num_reqs]
        slot_mappings=None,
    ) -> torch.Tensor:  # [num_reqs, num_positions]; rows valid up to last_lengths
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        self.last_lengths = None
        cad = common_attn_metadata
        num_reqs = cad.batch_size()
        context = self.plugin_runner.step_context()
        rule = self._rule_for_this_step(context, num_reqs, num_rejected_tokens_gpu)

        num_tokens, token_indices_to_sample, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample, cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        # First pass: the verified tokens of every request (the draft's KV for them)
        # plus the newest token, whose output is draft position 0.
        hidden = self._forward(cad, num_tokens, draft_index=0)
        positions = self.positions[token_indices_to_sample]
        run = DraftRun(rule, self.calibration, _sampled_rows(sampling_metadata, num_reqs),
                       caps=_caps(context.remaining_tokens[:num_reqs], num_speculative_tokens))
        more = self._sample_into(run, hidden[token_indices_to_sample], sampling_metadata)
        if not more:
            return self._finish(run, context.req_ids)

        self._switch_to_decode(cad, num_reqs, num_rejected_tokens_gpu)
        for draft_index in range(1, rule.k_max):
            start = time.perf_counter()
            positions = self._update_positions_dependent_metadata(
                positions, cad, num_reqs, num_reqs, self.block_size)
            self.input_ids[:num_reqs] = run.token_ids[-1].int()
            hidden = self._forward(cad, num_reqs, draft_index)
            more = self._sample_into(run, hidden[:num_reqs], sampling_metadata)
            self.costs.observe_forward(time.perf_counter() - start)
            if not more:
                break
        return self._finish(run, context.req_ids)

    def _rule_for_this_step(self, context, num_reqs: int, num_rejected_tokens_gpu) -> StopRule:
        """Learn from the step just verified, then set this step's threshold."""
        num_accepted = self.outcomes.resolve(
            context.req_ids,
            None if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:num_reqs].tolist())
        now = time.perf_counter()
        if self._last_call is not None:  # every row emitted one token plus its accepted drafts
            self.costs.observe_step(now - self._last_call, num_reqs + num_accepted,
                                    self._last_forwards, self._last_draft_tokens)
        self._last_call = now
        if self.fixed_min_acceptance is not None:
            return dataclasses.replace(self.rule, row_threshold=self.fixed_min_acceptance)
        row, per_pass = self.costs.thresholds()
        return dataclasses.replace(self.rule, row_threshold=row, pass_threshold=per_pass)

    def _forward(self, cad, num_tokens: int, draft_index: int) -> torch.Tensor:
        """One draft-model forward over ``num_tokens`` query tokens on the paged cache;
        ``draft_index`` 0 is the first pass (many tokens per request), then one each."""
        _, attn_metadata = self.build_per_group_and_layer_attn_metadata(cad, draft_index)
        mode, num_input_tokens, across_dp = self._determine_batch_execution_and_padding(
            num_tokens)
        if draft_index == 0:
            kwargs, slot_size = self.build_model_inputs_first_pass(
                num_tokens, num_input_tokens, None)
            slot_mapping = self._get_slot_mapping(slot_size, cad.slot_mapping)
        else:
            kwargs = {"input_ids": self.input_ids[:num_input_tokens],
                      "positions": self._get_positions(num_input_tokens),
                      "inputs_embeds": None}
            slot_mapping = self._get_slot_mapping(num_input_tokens)
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=num_input_tokens,
                                 num_tokens_across_dp=across_dp,
                                 cudagraph_runtime_mode=mode, slot_mapping=slot_mapping):
            return self.model(**kwargs)

    def _switch_to_decode(self, cad, num_reqs: int, num_rejected_tokens_gpu) -> None:
        """After the first pass every request has exactly one query token per step."""
        cad.num_actual_tokens = num_reqs
        cad.max_query_len = 1
        cad.query_start_loc = self.arange[: num_reqs + 1]
        cad.query_start_loc_cpu = torch.from_numpy(self.token_arange_np[: num_reqs + 1]).clone()
        if num_rejected_tokens_gpu is not None:
            # the padded first pass counted rejected drafts as context; drop them
            cad.seq_lens -= num_rejected_tokens_gpu

    def _sample_into(self, run: DraftRun, hidden: torch.Tensor, sampling_metadata) -> bool:
        """Draw one draft token per request (hidden: [num_reqs, hidden_size]); True if any
        request keeps drafting."""
        logits = self.model.compute_logits(hidden)  # [num_reqs, vocab_size]
        if sampling_metadata.all_greedy:
            token_ids = logits.argmax(dim=-1)
            return run.add(token_ids, confidence_of(logits.softmax(dim=-1)))
        token_ids, draft_probs = compute_probs_and_sample_next_token(
            logits, sampling_metadata, self.use_fp64_gumbel)
        return run.add(token_ids, confidence_of(draft_probs), draft_probs)

    def _finish(self, run: DraftRun, req_ids: list[str]) -> torch.Tensor:
        self.last_lengths = run.lengths().tolist()
        self._last_forwards = run.num_positions - 1  # the first pass runs every step anyway
        self._last_draft_tokens = sum(self.last_lengths)
        self.outcomes.record(req_ids, run)
        self._last_draft_probs = run.stacked_draft_probs()
        return run.stacked_token_ids()


def _sampled_rows(sampling_metadata, num_reqs: int) -> np.ndarray:  # [num_reqs] bool
    if sampling_metadata.all_greedy:
        return np.zeros(num_reqs, dtype=bool)
    return (sampling_metadata.temperature[:num_reqs] >= _SAMPLING_EPS).cpu().numpy()


def _caps(remaining_tokens: list[int], num_speculative_tokens: int) -> np.ndarray:
    """[num_reqs] most useful draft tokens per row: a request that may emit only n more
    tokens gains nothing from drafts past n - 1 (the last one comes as the bonus).
    ``remaining_tokens`` does not count this step's own tokens yet (at least one), so
    ``remaining - 2`` is an upper bound that never cuts a useful draft."""
    return np.clip(np.asarray(remaining_tokens) - 2, 0, num_speculative_tokens)

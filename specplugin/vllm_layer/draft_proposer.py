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
import functools
import logging
import time

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

from specplugin.adaptive.cost import StepCostModel
from specplugin.config import SpecPluginConfig
from specplugin.metrics import FailureCounter
from specplugin.proposers import MODEL_PROPOSERS, StepBatch, build_proposer
from specplugin.proposers.draft import (
    AcceptanceCalibration,
    CostModel,
    DraftCandidates,
    DraftRun,
    OutcomeTracker,
    StopRule,
    confidence_of,
)
from specplugin.proposers.union import Union, Verified

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
        self._step_seconds: float | None = None  # wall time of the step just run
        self._last_forwards = self._last_draft_tokens = 0  # of the previous propose()
        self.failures = FailureCounter("draft", logger)
        # [num_reqs] draft tokens kept per row of the last propose(); the runner cuts
        # the rows of the returned [num_reqs, positions] tensor to these lengths.
        self.last_lengths: list[int] | None = None
        # With token-level proposers too, the union picks per request among their
        # candidates and the draft's (see _finish_union).
        self.union: Union | None = None
        token_level = [n for n in plugin_config.proposers if n not in MODEL_PROPOSERS]
        if token_level:
            self.draft_candidates = DraftCandidates()
            proposers = [build_proposer(n, plugin_config) for n in token_level]
            max_tokens = max(2, vllm_config.scheduler_config.max_num_batched_tokens)
            self.union = Union([*proposers, self.draft_candidates],
                               cost=StepCostModel(max_tokens=max_tokens))

    def calibrate(self, num_tokens: np.ndarray, seconds: np.ndarray) -> None:
        """Timed target forwards from engine start (see the worker)."""
        if self.union is not None:
            self.union.cost.calibrate(num_tokens, seconds)

    def finish_requests(self, req_ids) -> None:
        if self.union is not None:
            self.union.finish_requests(list(req_ids))

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor:
        """vLLM's drafting call (arguments as :meth:`_propose`). A failure here costs the
        batch this step's drafts (it decodes plainly, still exactly the target's output),
        never a request; it is counted and logged (:class:`FailureCounter`)."""
        try:
            return self._propose(num_speculative_tokens, *args, **kwargs)
        except Exception:
            self.failures.record()
            num_reqs = len(self.plugin_runner.input_batch.req_ids)
            self.last_lengths = [0] * num_reqs
            self._last_draft_probs = None
            self.forget_pending()
            self._last_call = None
            return torch.zeros((num_reqs, 1), dtype=torch.int64, device=self.device)

    def forget_pending(self) -> None:
        """vLLM skipped drafting for a step: the drafts recorded before it were verified
        in that step, whose results never reach this drafter."""
        self.outcomes.forget()
        if self.union is not None:
            self.union.forget_pending()

    def stats(self) -> dict[str, dict[str, int]]:
        """The plugin's own counters (read by the metrics exporters)."""
        return {"proposer_failures": self.failures.snapshot()}

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
        sampled = _sampled_rows(sampling_metadata, num_reqs)
        caps = _caps(context.remaining_tokens[:num_reqs], num_speculative_tokens)
        finish = self._finish
        if self.union is not None:  # token-level candidates first: they may spare drafting
            batch, offers, draft_caps = self._union_offers(
                context, sampled, caps, next_token_ids, num_rejected_tokens_gpu)
            finish = functools.partial(self._finish_union, batch=batch, offers=offers)
            caps = draft_caps
        run = DraftRun(rule, self.calibration, sampled, caps=caps)
        more = self._sample_into(run, hidden[token_indices_to_sample], sampling_metadata)
        if not more:
            return finish(run, context.req_ids)

        self._switch_to_decode(cad, num_reqs, num_rejected_tokens_gpu)
        # One padded size for every decode pass (CUDA graphs run a captured batch size):
        # the slot mapping's padding rows must get the padding slot id, or the dummy rows
        # would write over real draft KV.
        padding = self._determine_batch_execution_and_padding(num_reqs)
        for draft_index in range(1, rule.k_max):
            start = time.perf_counter()
            positions = self._update_positions_dependent_metadata(
                positions, cad, num_reqs, padding[1], self.block_size)
            self.input_ids[:num_reqs] = run.token_ids[-1].int()
            hidden = self._forward(cad, num_reqs, draft_index, padding)
            more = self._sample_into(run, hidden[:num_reqs], sampling_metadata)
            self.costs.observe_forward(time.perf_counter() - start)
            if not more:
                break
        return finish(run, context.req_ids)

    def _rule_for_this_step(self, context, num_reqs: int, num_rejected_tokens_gpu) -> StopRule:
        """Learn from the step just verified, then set this step's threshold."""
        num_accepted = self.outcomes.resolve(
            context.req_ids, context.num_scheduled_drafts[:num_reqs],
            None if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:num_reqs].tolist())
        now = time.perf_counter()
        # wall time of the step just run (None: first step, or the last one failed)
        self._step_seconds = None if self._last_call is None else now - self._last_call
        if self._step_seconds is not None:  # every row emitted one token plus its accepted drafts
            self.costs.observe_step(self._step_seconds, num_reqs + num_accepted,
                                    self._last_forwards, self._last_draft_tokens)
        self._last_call = now
        if self.fixed_min_acceptance is not None:
            return dataclasses.replace(self.rule, row_threshold=self.fixed_min_acceptance)
        row, per_pass = self.costs.thresholds()
        return dataclasses.replace(self.rule, row_threshold=row, pass_threshold=per_pass)

    def _forward(self, cad, num_tokens: int, draft_index: int,
                 padding: tuple | None = None) -> torch.Tensor:
        """One draft-model forward over ``num_tokens`` query tokens on the paged cache;
        ``draft_index`` 0 is the first pass (many tokens per request), then one each.
        ``padding``: vLLM's (cudagraph mode, padded token count, tokens across DP ranks)
        for this pass, computed here when not given."""
        _, attn_metadata = self.build_per_group_and_layer_attn_metadata(cad, draft_index)
        mode, num_input_tokens, across_dp = (
            padding or self._determine_batch_execution_and_padding(num_tokens))
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


    def _union_offers(self, context, sampled, caps, next_token_ids, num_rejected_tokens_gpu):
        """Learn from the step just verified, ask the token-level proposers, and decide
        which rows still need the draft model: a row whose best token-level candidate is
        expected to bring more accepted tokens than the draft's candidates have brought on
        average skips drafting (its forwards would be wasted)."""
        num_reqs = len(caps)
        rejected = (np.zeros(num_reqs, dtype=np.int64) if num_rejected_tokens_gpu is None
                    else num_rejected_tokens_gpu[:num_reqs].cpu().numpy())
        scheduled = np.asarray(context.num_scheduled_drafts[:num_reqs])
        batch = _step_batch(self.plugin_runner.input_batch, context, sampled, caps,
                            np.maximum(scheduled - rejected, 0), next_token_ids[:num_reqs])
        verified = Verified(batch.req_ids, scheduled, scheduled - rejected + 1,
                            self._step_seconds, context.num_query_tokens)
        draft_index = len(self.union.proposers) - 1
        offers = self.union.collect(batch, verified, range(draft_index))
        draft_mean = self.union.mean_accepted(draft_index)
        if draft_mean is None:  # no evidence yet: let the draft compete everywhere
            return batch, offers, caps
        covered = self.union.expected_accepted(batch, offers) > draft_mean
        return batch, offers, np.where(covered, 0, caps)

    def _finish_union(self, run: DraftRun, req_ids: list[str], batch: StepBatch,
                      offers) -> torch.Tensor:
        """The union chooses, per request, the draft's candidate or a token-level one (and
        how much of it). Draft rows keep their draft probabilities; token-level rows are
        deterministic guesses and get one-hot ones, so at temperature > 0 both kinds are
        verified losslessly in the same batch."""
        token_ids = run.stacked_token_ids()  # [num_reqs, num_positions]
        self.draft_candidates.set(token_ids.cpu().numpy(), run.stacked_confidences(),
                                  run.lengths())
        draft_index = len(self.union.proposers) - 1
        drafts = self.union.choose(batch, offers + self.union.ask(batch, [draft_index]))
        draft_rows = [source == draft_index for source in self.union.last_sources]
        lengths = np.array([len(d) for d in drafts])
        self.outcomes.record(req_ids, run, np.where(draft_rows, lengths, 0))
        self.last_lengths = lengths.tolist()
        self._last_forwards = run.num_positions - 1
        self._last_draft_tokens = int(lengths.sum())
        return self._mixed_output(run, token_ids, drafts, draft_rows)

    def _mixed_output(self, run: DraftRun, token_ids: torch.Tensor, drafts, draft_rows):
        """[num_reqs, k_out] token ids (and [num_reqs, k_out, vocab] probabilities when
        sampling) holding each row's chosen draft."""
        num_reqs, k_out = run.num_reqs, max(1, max(len(d) for d in drafts))
        out = torch.zeros((num_reqs, k_out), dtype=token_ids.dtype, device=token_ids.device)
        draft_probs = run.stacked_draft_probs()  # [num_reqs, num_positions, vocab] or None
        probs = None
        if draft_probs is not None:
            probs = torch.zeros((num_reqs, k_out, draft_probs.shape[-1]),
                                dtype=draft_probs.dtype, device=draft_probs.device)
        for r, draft in enumerate(drafts):
            k = len(draft)
            if k == 0:
                continue
            if draft_rows[r]:
                out[r, :k] = token_ids[r, :k]
                if probs is not None:
                    probs[r, :k] = draft_probs[r, :k]
            else:
                chosen = torch.tensor(draft, dtype=out.dtype, device=out.device)
                out[r, :k] = chosen
                if probs is not None:  # a deterministic guess: q is one-hot on it
                    probs[r, torch.arange(k, device=out.device), chosen] = 1.0
        self._last_draft_probs = probs
        return out


def _step_batch(input_batch, context, sampled: np.ndarray, caps: np.ndarray,
                num_accepted: np.ndarray, next_token_ids: torch.Tensor) -> StepBatch:
    """The batch as token-level proposers see it, before vLLM's bookkeeping: each row's
    context is its tokens so far, the drafts it just had accepted (already in the token
    buffer, where the scheduler put them) and the token this step sampled."""
    num_reqs = len(caps)
    known = input_batch.num_tokens_no_spec[:num_reqs] + num_accepted  # [num_reqs]
    num_tokens = known + 1
    token_ids = np.zeros((num_reqs, int(num_tokens.max())), dtype=np.int64)
    for r in range(num_reqs):
        token_ids[r, : known[r]] = input_batch.token_ids_cpu[r, : known[r]]
    token_ids[np.arange(num_reqs), known] = next_token_ids.cpu().numpy()
    rows = tuple(int(r) for r in np.flatnonzero(caps > 0))
    return StepBatch(tuple(context.req_ids[:num_reqs]), token_ids, num_tokens,
                     np.asarray(context.num_prompt_tokens[:num_reqs]), caps, sampled, rows)


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

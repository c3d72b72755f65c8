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
  ``SamplingParams``, tokens each may still emit, its K limit and allowed proposers;
- per-request draft lengths: the drafter returns a [num_reqs, positions] tensor and
  the number of tokens each row keeps; the rows are cut before the scheduler sees them;
- :meth:`~PluginRunnerMixin.time_forward`: the target's forward time for a shape (rows,
  query tokens per row, context), timed at engine start for the cost model and on
  request through ``LLM.collective_rpc("time_forward", ...)`` (``specplugin cost-curve``).

The CPU and CUDA versions are the same few lines: the mixins over vLLM's runner and
worker, and a worker that builds that runner.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.worker.cpu_worker import CPUWorker

from specplugin.adaptive.cost import calibration_shapes
from specplugin.proposers.base import StepBatch
from specplugin.proposers.draft import truncate_rows
from specplugin.request_options import RequestOptionsCache
from specplugin.vllm_layer.metrics_export import StatsPublisher
from specplugin.vllm_layer.ranks import RankZeroClock, agree_array, tensor_parallel_rank
from specplugin.vllm_layer import draft_handoff, patches, verification
from specplugin.vllm_layer.config_hook import plugin_config

_NO_LIMIT = 1 << 30
# context (tokens) of the forwards timed at engine start: see calibrate_step_cost
CALIBRATION_CONTEXT_LEN = 128
logger = logging.getLogger("specplugin")


@dataclass(slots=True)
class StepContext:
    """The batch as proposers see it at drafting time (rows = the runner's batch rows)."""

    req_ids: list[str]  # [num_reqs]
    sampling_params: list  # [num_reqs] vllm.SamplingParams (None for pooling requests)
    # [num_reqs] max_tokens minus tokens emitted so far. The draft model drafts before
    # vLLM's bookkeeping (this step's tokens not counted yet), specplugin.Speculator after
    # it (counted): each drafter bounds its drafts accordingly.
    remaining_tokens: list[int]
    # [num_reqs] draft tokens the scheduler verified for each row in this step (it may
    # have cut a row's draft short of what the drafter proposed, e.g. near max_model_len)
    num_scheduled_drafts: list[int]
    num_prompt_tokens: np.ndarray  # [num_reqs]
    num_query_tokens: int  # tokens the target ran in this step, every row's drafts included
    # [num_reqs] the longest draft each request allows (specplugin_max_k; else the server's K)
    max_k: list[int]
    # [num_reqs] the proposers each request allows (specplugin_proposers; None: all);
    # None when no request of the batch restricts them
    allowed: tuple | None
    # req_id -> how its candidates fared in the step just verified, for requests the
    # batch-expanding scorer verified extra candidates for (None: no scorer)
    scored: dict | None = None
    # [num_reqs] the acceptance probability of each draft token verified in this step, as
    # the rejection sampler computed it (:mod:`specplugin.vllm_layer.verification`; the
    # learners read sampled rows' only); None: no row sampled, or the scorer ran
    expected_acceptance: list[list[float]] | None = None
    # the step read prompt tokens: its time is a prefill's, not a decode step's,
    # and no cost model nor the step arbiter learns from it (Union._observe)
    read_prompts: bool = False


class PluginRunnerMixin:
    """Mixed in front of vLLM's ``GPUModelRunner`` or ``CPUModelRunner``."""

    def _install_plugin_drafter(self) -> None:
        from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

        if self.use_async_scheduling:  # the config hook switches it off; never run with it
            raise RuntimeError(
                "specplugin's worker needs synchronous scheduling: its per-row draft lengths "
                "and draft probabilities must line up with the rows of the step that drafted "
                "them. Start vLLM with async_scheduling=False (--no-async-scheduling).")
        config = plugin_config(self.vllm_config)
        # the drafter's counters, published for the front end's /metrics (one rank: every
        # tensor-parallel rank drafts the same)
        self._stats_publisher = (StatsPublisher(self.vllm_config.instance_id)
                                 if tensor_parallel_rank() == 0 else None)
        # True once the worker's wait has run (a worker process: see use_the_wait): the
        # counters are published there, off the step; an in-process engine never waits
        # so, and publishes at the start of a step
        self.publishes_in_wait = False
        # per-request specplugin_max_k / specplugin_proposers (checked in the front end)
        self.request_options = RequestOptionsCache(config.num_speculative_tokens,
                                                   config.proposers)
        self._plugin_config = config
        self._draft_lengths: list[int] | None = None
        # the step being run: which drafts the scheduler verified in it (step_context,
        # the scorer)
        self.step_scheduler_output = None
        # what the step's rejection sampler reported (see _sample)
        self._heard = None
        # the batch-expanding scorer (max_candidates > 1), built with the KV cache
        self.expander = None
        if "draft" in config.proposers:
            self.drafter = PluginDraftProposer(self.vllm_config, self.device, self, config)
        else:  # vLLM built specplugin.Speculator through its custom_class hook
            self.drafter.attach(self)
        # steps the drafter foretold plain, still to run as vLLM's own (see execute_model)
        self._plain_ahead = 0
        self._vllm_step = False  # the running step is one of them
        self._held_spec_config = None  # the speculative config, set aside for that step
        # of them, the steps the drafter has yet to learn from: their wall times (the
        # drafter's clock) and the batch's size (one batch: a run ends when it changes)
        self._plain_step_times: list[float | None] = []
        self._plain_run_reqs = 0
        self.num_steps_as_vllm = 0  # all of them, counted (steps_foretold_plain)
        self.calibration: dict[str, float] = {}  # "rows x query" -> forward ms at start-up
        # Steps without any draft can skip vLLM's speculative bookkeeping (see
        # _prepare_inputs) unless the model keeps recurrent state that relies on it.
        model = self.vllm_config.model_config
        self._plain_steps_allowed = not (model.is_hybrid or model.is_attention_free
                                         or model.has_inner_state)
    def step_context(self) -> StepContext:
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        so = self.step_scheduler_output
        scheduled = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        request_options, server_k = self.request_options, self.request_options.server_k
        # one loop over the rows (each comprehension is a call of its own, on cold caches)
        params, remaining, num_scheduled, max_k, allowed = [], [], [], [], []
        for r in req_ids:
            state = self.requests[r]
            p = state.sampling_params
            params.append(p)
            remaining.append(_NO_LIMIT if p is None or p.max_tokens is None
                             else p.max_tokens - len(state.output_token_ids))
            num_scheduled.append(len(scheduled.get(r, ())))
            options = request_options.get(r, None if p is None else p.extra_args)
            max_k.append(options.cap(server_k))
            allowed.append(options.proposers)
        restricted = any(a is not None for a in allowed)
        return StepContext(req_ids, params, remaining, num_scheduled,
                           batch.num_prompt_tokens[: len(req_ids)],
                           getattr(so, "total_num_scheduled_tokens", 0), max_k,
                           tuple(allowed) if restricted else None,
                           None if self.expander is None else dict(self.expander.outcomes),
                           None if self._heard is None else self._heard.per_row(),
                           _read_prompts(so))

    def peek_batch(self) -> StepBatch:
        """The batch as it stands before this step's tokens are sampled, for the union's
        look at a plain step (:meth:`Union.plain_step
        <specplugin.adaptive.union.Union.plain_step>`): views of the runner's buffers,
        the decoding rows, each request's own K limit."""
        batch = self.input_batch
        req_ids = tuple(batch.req_ids)
        num_reqs = len(req_ids)
        num_tokens = batch.num_tokens_no_spec[:num_reqs]
        num_prompt = batch.num_prompt_tokens[:num_reqs]
        server_k = self.request_options.server_k
        params = [self.requests[r].sampling_params for r in req_ids]
        max_k = np.array([self.request_options.get(r, None if p is None else p.extra_args)
                          .cap(server_k) for r, p in zip(req_ids, params)], dtype=np.int64)
        sampled = batch.temperature_cpu[:num_reqs] >= _SAMPLING_EPS
        rows = tuple(np.flatnonzero((num_tokens > num_prompt) & (max_k > 0)).tolist())
        return StepBatch(req_ids, batch.token_ids_cpu, num_tokens, num_prompt, max_k, sampled,
                         rows)

    @torch.inference_mode()
    def time_forward(self, rows: int, query_len: int, context_len: int, repeats: int = 5) -> float:
        """Seconds of one target forward over ``rows`` requests of ``query_len`` query tokens
        each, every row attending over ``context_len`` earlier tokens: what a step that
        verifies ``query_len - 1`` drafts per row costs the target. The fastest of
        ``repeats`` runs after one discarded (first-run allocations; on a shared machine
        every disturbance only adds time).

        Built on vLLM's ``_dummy_run``, which on its own would time a different forward:

        - ``force_attention``: without it the CPU dummy run builds no attention metadata and
          every attention layer skips its work, so the time would not grow with the context;
        - ``uniform_decode`` with ``uniform_decode_query_len`` set to ``query_len`` for the
          call: ``rows`` rows of ``query_len`` tokens (without it the tokens are spread one
          per request, i.e. ``rows * query_len`` decoding rows);
        - ``profile_seq_lens = context_len + query_len``: each row's sequence length, so
          query token j of a row attends over ``context_len + j + 1`` positions, as in
          verification. The dummy run writes no KV (its slots are -1) and an idle runner's
          block tables point at the null block, so the context is read from one block:
          the work is the real one, memory traffic is kinder than with distinct blocks;
        - logits of every query token, as verification computes them (the dummy run
          returns hidden states only);
        - the target alone: with a draft model configured the dummy run would also run the
          draft's, whose cost the drafters measure on their own.
        """
        self._check_forward_shape(rows, query_len, context_len, repeats)
        num_tokens = rows * query_len
        saved = self.uniform_decode_query_len, self.speculative_config
        self.uniform_decode_query_len, self.speculative_config = query_len, None
        try:
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                hidden_states, _ = self._dummy_run(
                    num_tokens, force_attention=True, uniform_decode=True,
                    profile_seq_lens=context_len + query_len)
                self.model.compute_logits(hidden_states[:num_tokens])
                self._sync_device()
                times.append(time.perf_counter() - start)
        finally:
            self.uniform_decode_query_len, self.speculative_config = saved
        return min(times[1:])

    def _check_forward_shape(self, rows: int, query_len: int, context_len: int,
                             repeats: int) -> None:
        """A shape this engine can run, or a ValueError naming the limit to raise."""
        if min(rows, query_len, repeats) < 1 or context_len < 0:
            raise ValueError(f"time_forward needs rows, query_len and repeats >= 1 and "
                             f"context_len >= 0; got {rows}, {query_len}, {repeats} and "
                             f"{context_len}.")
        for value, limit, setting in (
                (rows, self.scheduler_config.max_num_seqs, "max_num_seqs"),
                (rows * query_len, self.max_num_tokens, "max_num_batched_tokens"),
                (context_len + query_len, self.max_model_len, "max_model_len")):
            if value > limit:
                raise ValueError(f"time_forward: {value} is over the engine's {setting} "
                                 f"({limit}) for {rows} rows of {query_len} query tokens on "
                                 f"{context_len} context tokens; start the engine with a "
                                 f"larger {setting} or time a smaller shape.")

    @torch.inference_mode()
    def calibrate_step_cost(self, repeats: int = 5) -> None:
        """Time target forwards of 1, 2, 4, ... query tokens before the first request, so
        the cost model knows what verifying a token costs on this machine from the start.

        Knot ``n`` is :meth:`time_forward` of the shape a speculative step of ``n`` tokens
        runs (:func:`~specplugin.adaptive.cost.calibration_shapes`: one row's query of up
        to ``1 + K`` tokens first, then rows up to ``max_num_seqs``) over a context of
        :data:`CALIBRATION_CONTEXT_LEN` tokens: the cost model's curve has no context
        dimension, so it is measured at a modest context, a short prompt plus some output,
        where attention is a real but small share of a forward (with no context at all
        the attention layers would do no work and every token would look cheaper)."""
        calibrate = getattr(self.drafter, "calibrate", None)
        if calibrate is None:
            return
        shapes = calibration_shapes(self.scheduler_config.max_num_seqs,
                                    self.uniform_decode_query_len, self.max_num_tokens)
        longest = max(query_len for _, query_len in shapes)
        context_len = max(0, min(CALIBRATION_CONTEXT_LEN, self.max_model_len - longest))
        knots = [rows * query_len for rows, query_len in shapes]
        seconds = [self.time_forward(rows, query_len, context_len, repeats)
                   for rows, query_len in shapes]
        # tensor parallelism: every rank calibrates with rank 0's times (see ranks.py)
        seconds = agree_array(RankZeroClock(), np.array(seconds))
        # more tokens never cost less: a later knot that ran faster bounds earlier ones
        seconds = np.minimum.accumulate(np.array(seconds)[::-1])[::-1]
        calibrate(np.array(knots), seconds)
        self.calibration = {f"{r}x{q}": round(float(t) * 1e3, 3)
                            for (r, q), t in zip(shapes, seconds)}
        logger.info("specplugin: target forward ms by rows x query tokens %s", self.calibration)

    def plugin_stats(self) -> dict:
        """The drafter's counters, the speculative steps verified without vLLM's rejection
        sampler, the start-up calibration (``"calibration"``: forward ms by rows x query
        tokens) and the scorer's counters under ``"scorer"`` when it is on."""
        self._learn_plain_steps()
        stats = {**self.drafter.stats(), "steps_verified_greedy": verification.greedy_steps(),
                 "steps_verified_sampled": verification.sampled_steps(),
                 "steps_foretold_plain": self.num_steps_as_vllm,
                 "calibration": self.calibration}
        if self.expander is not None:
            stats["scorer"] = {**self.expander.stats.as_dict(), **self.expander.describe()}
        return stats

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self._plugin_config.max_candidates > 1:
            from specplugin.vllm_layer.scorer import BatchExpander

            self.expander = BatchExpander(self, self._plugin_config)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        """A step the drafter foretold plain runs as vLLM's own plain step.

        When the drafter keeps a step plain it may also say how many of the steps after it
        are plain whatever they measure (:meth:`Union.plain_steps_ahead
        <specplugin.adaptive.union.Union.plain_steps_ahead>`: the step arbiter's plain
        block runs on; a peek due meanwhile waits). Such a step, if it decodes one token
        per request of an unchanged batch, runs with the speculative config set aside for
        the whole step and none of the plugin's code (each override below hands it
        straight to vLLM): exactly the step of an engine without speculation, plus one
        clock read at its end. The drafter learns from those steps' times before the next
        step the plugin runs (:meth:`_learn_plain_steps`). Anything else (a request joins,
        leaves or resumes) ends the run, and that step is the plugin's."""
        if self._plain_ahead:
            if plain_decode(scheduler_output):
                self._plain_ahead -= 1
                self._vllm_step = True
                self._held_spec_config, self.speculative_config = self.speculative_config, None
                self.step_scheduler_output = scheduler_output
                try:
                    output = super().execute_model(scheduler_output, intermediate_tensors)
                except BaseException:
                    self._end_vllm_step()
                    raise
                if output is not None:  # no sampling call follows
                    self._end_vllm_step()
                return output
            self._plain_ahead = 0
        return super().execute_model(scheduler_output, intermediate_tensors)

    def _end_vllm_step(self) -> None:
        self._vllm_step = False
        self.speculative_config, self._held_spec_config = self._held_spec_config, None

    def _learn_plain_steps(self) -> None:
        """The steps run as vLLM's own since the drafter last heard, to the drafter."""
        if self._plain_step_times:
            times, self._plain_step_times = self._plain_step_times, []
            self.drafter.learn_plain_steps(times, self._plain_run_reqs)

    def _model_forward(self, input_ids=None, positions=None, **kwargs):
        """With the batch-expanding scorer, the step's extra candidates run as extra rows
        of this one forward (:mod:`specplugin.vllm_layer.scorer`)."""
        forward = super()._model_forward
        if self._vllm_step or self.expander is None or kwargs.get("inputs_embeds") is not None:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        return self.expander.forward(self, forward, input_ids, positions, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        if self._vllm_step:
            return super()._sample(logits, spec_decode_metadata)
        if spec_decode_metadata is None and self.expander is None:
            # a plain step: no rejection sampler runs, there is nothing to hear or recover
            self._heard = None
            return super()._sample(logits, None)
        if self.expander is not None:
            self.expander.keep_target_logits(logits, spec_decode_metadata)
            self._heard = None  # (its extra rows are not the batch's: verdicts only)
            with verification.recovering():
                sampler_output = super()._sample(logits, spec_decode_metadata)
            self.expander.resolve(self, sampler_output)
            return sampler_output
        if spec_decode_metadata is not None:
            # (No update_async_output_token_ids() first: the shortcut takes only batches
            # that read no output tokens; vLLM's _sample makes that call on fallback.)
            output = verification.verify_greedy(logits, spec_decode_metadata,
                                                self.input_batch.sampling_metadata,
                                                self.rejection_sampler)
            if output is not None:
                self._heard = None  # (no sampled request: nothing to hear)
                return output
            if verification.plainly_sampled(logits, self.input_batch.sampling_metadata,
                                            self.rejection_sampler):
                heard = verification.Heard()
                output = verification.verify_sampled(
                    logits, spec_decode_metadata, self.input_batch.sampling_metadata,
                    self._get_spec_decode_draft_probs(spec_decode_metadata), heard)
                if output is not None:
                    self._heard = heard
                    return output
        with verification.listening() as self._heard:
            return super()._sample(logits, spec_decode_metadata)

    def _update_states(self, scheduler_output):
        if self._vllm_step:
            return super()._update_states(scheduler_output)
        self._learn_plain_steps()  # (before anything of this step reaches the drafter)
        self.step_scheduler_output = scheduler_output
        if self.expander is not None:
            self.expander.check_scheduled_blocks(scheduler_output)
        if self._stats_publisher is not None and not self.publishes_in_wait:
            self._stats_publisher.maybe_publish(self.plugin_stats)
        finished = scheduler_output.finished_req_ids
        if finished and hasattr(self.drafter, "finish_requests"):
            self.drafter.finish_requests(finished)
        if finished:
            self.request_options.forget(finished)
        # a request resumed after preemption got new blocks: what the drafter kept about
        # its KV cache is gone (its token-level state stays valid)
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        if resumed and hasattr(self.drafter, "restart_requests"):
            self.drafter.restart_requests(resumed)
        return super()._update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        """A step in which no request has a draft runs as a plain decoding step.

        With a speculative config vLLM builds spec-decode metadata and runs its
        rejection sampler every step, drafts or not: measured at batch 16, a proposer
        that never drafts ran at 0.86x of no speculation. When the controller chose
        K = 0 for every request, the step skips that machinery (vLLM's own
        non-speculative path: plain sampler, one logit per request)."""
        if self._vllm_step:
            return super()._prepare_inputs(scheduler_output, *args, **kwargs)
        if not self._plain_steps_allowed or any(
                scheduler_output.scheduled_spec_decode_tokens.values()):
            return super()._prepare_inputs(scheduler_output, *args, **kwargs)
        spec, self.speculative_config = self.speculative_config, None
        try:
            return super()._prepare_inputs(scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        """The draft-model drafter decides its step before vLLM prepares the draft model's
        inputs (:meth:`PluginDraftProposer.propose_before_vllm_inputs
        <specplugin.vllm_layer.draft_proposer.PluginDraftProposer.propose_before_vllm_inputs>`):
        a step in which the draft model runs for no row hands back its drafts as lists,
        as vLLM's own token-level methods do, and touches none of the draft model's
        machinery; a step in which it runs skips vLLM's preparation of its inputs
        (:meth:`~specplugin.vllm_layer.draft_proposer.PluginDraftProposer.propose_decided`)."""
        decide = getattr(self.drafter, "propose_before_vllm_inputs", None)
        if decide is not None and torch.is_tensor(sampled_token_ids):
            self._draft_probs = self._draft_prob_req_ids = None  # as vLLM's call does
            drafts = decide(sampled_token_ids, sampling_metadata)
            if drafts is not None:
                return drafts
            if self.drafter.decided:
                drafts = self.drafter.propose_decided(
                    scheduler_output.num_spec_tokens_to_schedule, common_attn_metadata,
                    sampling_metadata)
                draft_probs = self.drafter.take_last_draft_probs()
                if draft_probs is not None:  # (as vLLM's call keeps them)
                    self._draft_probs = draft_probs
                    self._draft_prob_req_ids = self.input_batch.req_ids.copy()
                return drafts
        return super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
            common_attn_metadata, slot_mappings)

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False) -> None:
        super()._copy_draft_token_ids_to_cpu(scheduler_output, zeros_only=zeros_only)
        if zeros_only:  # the drafter did not run this step: no drafts at all
            self._draft_lengths = [0] * self.input_batch.num_reqs
            # drafts verified in this step were never resolved: drop them, or the next
            # step's resolve would count them as all accepted
            self.drafter.forget_pending()
            if self.expander is not None:
                self.expander.forget()
        else:
            # a tensor's rows are cut to the drafter's lengths; lists (the drafters' own
            # output) hold each row's draft as sent
            self._draft_lengths = (getattr(self.drafter, "last_lengths", None)
                                   if torch.is_tensor(self._draft_token_ids) else None)
            if self.expander is not None:
                self.expander.remember(self.input_batch.req_ids, self.drafter.last_alternates)

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        """The step's draft probabilities as the rejection sampler reads them
        ([num_draft_tokens_total, vocab_size]): a view of the drafter's [num_reqs,
        positions, vocab] tensor where its rows are the batch's and their drafts lie end to
        end (one row; or every row's positions all verified), else vLLM's gather (a dict of
        the rows and a concatenated copy: 0.06 ms a step at batch 1 in an engine, on the
        step's cold caches)."""
        probs, prob_req_ids = self._draft_probs, self._draft_prob_req_ids
        counts = spec_decode_metadata.num_draft_tokens  # [num_reqs] (a list)
        if (probs is not None and prob_req_ids is not None and probs.is_contiguous()
                and len(counts) == probs.shape[0] and prob_req_ids == self.input_batch.req_ids):
            if len(counts) == 1:
                return probs[0, :counts[0]] if counts[0] else None
            if all(n == probs.shape[1] for n in counts):
                return probs.view(-1, probs.shape[-1])
        return super()._get_spec_decode_draft_probs(spec_decode_metadata)

    def sample_tokens(self, grammar_output):
        """vLLM's step output, with the step's drafts riding on it: the engine core then
        need not ask this worker for them in a second round trip (:mod:`.draft_handoff`).

        A plain step is a plain step: when this step verified no draft and the drafter
        says the next one decodes plainly too (:meth:`_skip_drafting`), vLLM samples on
        its non-speculative path (no drafting call, no draft copies, no draft-model
        preparation) and the step hands back no drafts; the drafter may foretell that
        steps after it are plain too (:meth:`execute_model`)."""
        if self._vllm_step:  # (called from this override, as its super(): the sampled
            # profile, specplugin.stack_samples, charges vLLM's sampling to vLLM)
            try:
                output = super().sample_tokens(grammar_output)
            finally:
                self._end_vllm_step()
            return self._after_vllm_step(output)
        self._note_new_requests()
        if self._skip_drafting():
            self._plain_ahead = self._foretold_plain_steps()
            spec, self.speculative_config = self.speculative_config, None
            try:
                output = super().sample_tokens(grammar_output)
            finally:
                self.speculative_config = spec
            self._draft_token_req_ids = None  # nothing for anyone to fetch
            self._draft_lengths = None
            if self.expander is not None:
                self.expander.forget()
            drafts = None
        else:
            output = super().sample_tokens(grammar_output)
            drafts = self.take_draft_token_ids()
        if isinstance(output, ModelRunnerOutput) and output is not EMPTY_MODEL_RUNNER_OUTPUT:
            draft_handoff.attach(output, drafts)
        return output

    def _after_vllm_step(self, output):
        """After vLLM's sampling of a step run as its own (:meth:`execute_model`): the
        step's time is kept for the drafter, and no drafts ride on its output."""
        self._plain_step_times.append(self.drafter.timer.lap())
        self._plain_run_reqs = self.input_batch.num_reqs
        self.num_steps_as_vllm += 1
        self._draft_token_req_ids = None  # nothing for anyone to fetch
        self._draft_lengths = None
        if isinstance(output, ModelRunnerOutput) and output is not EMPTY_MODEL_RUNNER_OUTPUT:
            draft_handoff.attach(output, None)
        return output

    def _foretold_plain_steps(self) -> int:
        """How many steps after this plain one may run as vLLM's own (0 with the
        batch-expanding scorer, whose rows this path does not know)."""
        if self.expander is not None:
            return 0
        return self.drafter.plain_steps_ahead()

    def _note_new_requests(self) -> None:
        """Tell the drafter's step arbiter that requests joined the batch in this step
        (new text: :meth:`StepArbiter.new_requests
        <specplugin.adaptive.arbiter.StepArbiter.new_requests>`)."""
        so = self.step_scheduler_output
        note = getattr(self.drafter, "new_requests", None)
        if note is not None and getattr(so, "scheduled_new_reqs", None):
            note(len(so.scheduled_new_reqs), self.input_batch.num_reqs)

    def _skip_drafting(self) -> bool:
        """Whether this step's drafting can be skipped: the step verified no draft (nothing
        to learn but its time), vLLM keeps no per-step speculative state for this model,
        one rank decides alone, and the drafter's step arbiter keeps the next step plain."""
        so = self.step_scheduler_output
        skip = getattr(self.drafter, "skip_drafting", None)
        if (skip is None or not self._plain_steps_allowed or so is None
                or self.execute_model_state is None
                or self.parallel_config.tensor_parallel_size > 1
                or any(so.scheduled_spec_decode_tokens.values())):
            return False
        num_reqs = self.input_batch.num_reqs
        # requests that sample (temperature >= vLLM's _SAMPLING_EPS): vLLM's own set,
        # read without numpy (this runs on every plain step)
        num_sampled = len(self.input_batch.random_reqs)
        return skip(num_reqs, so.total_num_scheduled_tokens, 2 * num_sampled > num_reqs,
                    _read_prompts(so))

    def _get_draft_token_ids_cpu(self) -> tuple[list[list[int]], list[str]]:
        draft_token_ids, req_ids = super()._get_draft_token_ids_cpu()
        if self._draft_lengths is not None:
            draft_token_ids = truncate_rows(draft_token_ids, self._draft_lengths)
        return draft_token_ids, req_ids


class PluginCPUModelRunner(PluginRunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self._install_plugin_drafter()


class PluginWorkerMixin:
    """Mixed in front of vLLM's ``CPUWorker`` or ``Worker``: calibration after vLLM's
    warm-up, and the runner's timing and counters for ``LLM.collective_rpc``."""

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        self.model_runner.calibrate_step_cost()
        # vLLM reseeds after warm-up so that start-up work leaves no trace in sampling
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        # What start-up built (the models, the compiled graphs, vLLM's and the plugin's
        # tables) lives as long as the worker: frozen, as vLLM freezes its engine core's
        # heap after start-up, so that the collector's full collections while serving
        # scan only what serving allocates (see specplugin_gc)
        freeze_gc_heap()
        return times

    def specplugin_gc(self, collect: bool = True) -> dict:
        """``llm.collective_rpc("specplugin_gc")``: objects this worker froze at start-up
        and, with ``collect``, the seconds one full collection takes now (what a serving
        worker pauses for each time the collector runs one)."""
        start = time.perf_counter()
        if collect:
            gc.collect()
        return {"frozen": gc.get_freeze_count(),
                "full_collection_s": time.perf_counter() - start if collect else None}

    def use_the_wait(self) -> None:
        """This worker's reply to the engine core's call is on its way (see
        :mod:`specplugin.vllm_layer.worker_wait`), and it waits for its next call: the
        learning the step held back runs now (:mod:`specplugin.adaptive.background`), and,
        between steps, the counters are published when due (a JSON snapshot written to a
        file every half second: measured under py-spy about 4% of the plugin's own work at
        batch 1 when it ran at the start of a step). Not between a step's
        ``execute_model`` and its ``sample_tokens``: the step is half done there."""
        runner = self.model_runner
        background = learning_background(runner)
        if background is not None:
            background.run_pending()
        publisher = getattr(runner, "_stats_publisher", None)
        if publisher is not None and runner.execute_model_state is None:
            runner.publishes_in_wait = True
            publisher.maybe_publish(runner.plugin_stats)

    def specplugin_learning(self) -> dict:
        """``llm.collective_rpc("specplugin_learning")``: the learning jobs this worker's
        drafter handed over, how many ran in the worker's wait (the rest ran on a step,
        where something read what they write before the wait came), their seconds, and
        whether the counters are published in the wait."""
        runner = self.model_runner
        background = learning_background(runner)
        if background is None:
            return {}
        return {"jobs": background.num_jobs, "off_step": background.num_off_step,
                "off_step_s": background.busy_s, "on_step_s": background.waited_s,
                "publishes_in_wait": getattr(runner, "publishes_in_wait", False)}

    def time_forward(self, rows: int, query_len: int, context_len: int,
                     repeats: int = 5) -> float:
        """``llm.collective_rpc("time_forward", args=(rows, query_len, context_len,
        repeats))``: :meth:`PluginRunnerMixin.time_forward` on this worker's runner."""
        return self.model_runner.time_forward(rows, query_len, context_len, repeats)

    def specplugin_stats(self) -> dict:
        """``llm.collective_rpc("specplugin_stats")``: the drafter's counters, now
        (:func:`specplugin.vllm_layer.metrics_export.engine_stats`)."""
        return self.model_runner.plugin_stats()

    def specplugin_forget_learned(self) -> bool:
        """``llm.collective_rpc("specplugin_forget_learned")``, between requests: the
        drafter forgets what verification taught it (``specplugin bench`` after its
        warm-up, so that a timed cell starts as a user's fresh engine does). False when
        the drafter learns nothing."""
        runner = self.model_runner
        forget = getattr(runner.drafter, "forget_learned", None)
        if forget is None:
            return False
        runner._learn_plain_steps()  # (the steps that ran belong to what is forgotten)
        runner._plain_ahead = 0  # a fresh engine's arbiter foretells nothing yet
        forget()
        return True


class PluginCPUWorker(PluginWorkerMixin, CPUWorker):
    def init_device(self) -> None:
        # vLLM's CPU worker builds its runner inline from this module-level name
        with patches.swapped(cpu_worker, "CPUModelRunner", PluginCPUModelRunner):
            super().init_device()


def learning_background(runner):
    """The :class:`~specplugin.adaptive.background.Background` that ``runner``'s drafter
    holds its learning in (None: not the plugin's runner, or a drafter that learns nothing)."""
    return getattr(getattr(runner, "drafter", None), "background", None)


def plain_decode(scheduler_output) -> bool:
    """Every scheduled request decodes one token, no draft; none joins, leaves or
    resumes (a step that may run as vLLM's own, see ``execute_model``; the profile's
    step-by-step A/B pairs such steps)."""
    so = scheduler_output
    return (not so.scheduled_new_reqs and not so.finished_req_ids
            and not so.scheduled_cached_reqs.resumed_req_ids
            and not any(so.scheduled_spec_decode_tokens.values())
            and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0)


def _read_prompts(scheduler_output) -> bool:
    """Whether the step of ``scheduler_output`` read prompt tokens (the one fact every
    observer of the step's time reads: see :attr:`StepContext.read_prompts`): a row read
    more than a decode step's one token plus its drafts. That is a new request's prompt,
    the next chunk of a long prompt under chunked prefill, or a preempted request
    re-reading its context: a prefill's time in each case, not a decode step's."""
    if scheduler_output is None:
        return False
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return True
    per_request = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return any(n > 1 + len(drafts.get(r, ())) for r, n in per_request.items())


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

    class PluginGPUWorker(PluginWorkerMixin, Worker):
        def _make_model_runner(self):
            return PluginGPUModelRunner(self.vllm_config, self.device)

    return {"PluginGPUWorker": PluginGPUWorker, "PluginGPUModelRunner": PluginGPUModelRunner}

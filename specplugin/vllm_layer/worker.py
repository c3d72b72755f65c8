"""The plugin's worker layer: vLLM's worker and model runner, plus what proposers need.

vLLM's ``custom_class`` hook hands a proposer token ids only, so the config hook selects
a worker below. :class:`PluginRunnerMixin` adds: the plugin's drafter in place of vLLM's
(built before the models load, so the draft model shares the target's KV block pool);
per-request context (:meth:`~PluginRunnerMixin.step_context`) and draft lengths;
:meth:`~PluginRunnerMixin.time_forward` for the cost model; plain-step fast paths and
host-side verification shortcuts (:mod:`.verification`).
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
from vllm.v1.worker.cpu_worker import CPUWorker

from specplugin.adaptive.cost import calibration_shapes
from specplugin.profiling import phase
from specplugin.proposers.base import StepBatch
from specplugin.proposers.draft import truncate_rows
from specplugin.request_options import RequestOptionsCache
from specplugin.vllm_layer.metrics_export import StatsPublisher
from specplugin.vllm_layer.ranks import RankZeroClock, agree_array, tensor_parallel_rank
from specplugin.vllm_layer import draft_handoff, patches, verification
from specplugin.vllm_layer.config_hook import worker_config
from specplugin.vllm_layer.draft_inputs import sampled_rows

_NO_LIMIT = 1 << 30
# context tokens of the forwards timed at engine start (calibrate_step_cost)
CALIBRATION_CONTEXT_LEN = 128
logger = logging.getLogger("specplugin")


@dataclass(slots=True)
class StepContext:
    """The batch as proposers see it at drafting time (rows = the runner's batch rows)."""

    req_ids: list[str]  # [num_reqs]
    sampling_params: list  # [num_reqs] vllm.SamplingParams (None for pooling requests)
    # [num_reqs] max_tokens minus tokens emitted (draft model: before this step's count)
    remaining_tokens: list[int]
    # [num_reqs] draft tokens the scheduler verified per row (it may cut drafts short)
    num_scheduled_drafts: list[int]
    num_prompt_tokens: np.ndarray  # [num_reqs]
    num_query_tokens: int  # tokens the target ran in this step, drafts included
    # [num_reqs] longest draft each request allows (specplugin_max_k, else the server's K)
    max_k: list[int]
    # [num_reqs] proposers each request allows (None: all); None if no request restricts
    allowed: tuple | None
    # req_id -> how its candidates fared with the batch-expanding scorer (None: no scorer)
    scored: dict | None = None
    # [num_reqs][num_drafts] expected acceptance (None: no row sampled, or the scorer ran)
    expected_acceptance: list[list[float]] | None = None
    # the step read prompt tokens: a prefill's time, which no cost model learns from
    read_prompts: bool = False


class PluginRunnerMixin:
    """Mixed in front of vLLM's ``GPUModelRunner`` or ``CPUModelRunner``."""

    def _install_plugin_drafter(self) -> None:
        from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

        if self.use_async_scheduling:  # the config hook switches it off
            raise RuntimeError(
                "specplugin's worker needs synchronous scheduling: its per-row draft lengths "
                "and draft probabilities must line up with the rows of the step that drafted "
                "them. Start vLLM with async_scheduling=False (--no-async-scheduling).")
        config = worker_config(self.vllm_config)
        # counters for the front end's /metrics (rank 0 only: every rank drafts the same)
        self._stats_publisher = (StatsPublisher(self.vllm_config.instance_id)
                                 if tensor_parallel_rank() == 0 else None)
        # True once use_the_wait ran: publish there; an in-process engine publishes on steps
        self.publishes_in_wait = False
        self._plugin_config = config
        self._draft_lengths: list[int] | None = None
        # the running step's scheduler output (step_context, the scorer)
        self.step_scheduler_output = None
        # what the step's rejection sampler reported (see _sample)
        self._heard = None
        # the batch-expanding scorer (max_candidates > 1), built with the KV cache
        self.expander = None
        # the draft-model drafter decides before vLLM prepares its inputs
        self._drafts_with_model = "draft" in config.proposers
        if self._drafts_with_model:
            self.drafter = PluginDraftProposer(self.vllm_config, self.device, self, config)
        else:  # vLLM built specplugin.Speculator through its custom_class hook
            self.drafter.attach(self)
        # per-request specplugin_max_k / specplugin_proposers, in the requests' records
        self.request_options = RequestOptionsCache(config.num_speculative_tokens,
                                                   config.proposers, self.drafter.union.requests)
        # steps foretold plain, still to run as vLLM's own (see execute_model)
        self._plain_ahead = 0
        self._vllm_step = False  # the running step is one of them
        self._held_spec_config = None  # the speculative config, set aside for that step
        # those steps' wall times and batch size, not yet learned by the drafter
        self._plain_step_times: list[float | None] = []
        self._plain_run_reqs = 0
        self.num_steps_as_vllm = 0  # steps_foretold_plain
        self.calibration: dict[str, float] = {}  # "rows x query" -> forward ms at start-up
        # draft-free steps may skip spec bookkeeping unless the model keeps recurrent state
        model = self.vllm_config.model_config
        self._plain_steps_allowed = not (model.is_hybrid or model.is_attention_free
                                         or model.has_inner_state)
    @phase("plugin: context")
    def step_context(self) -> StepContext:
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        so = self.step_scheduler_output
        scheduled = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        request_options, server_k = self.request_options, self.request_options.server_k
        # one loop over the rows rather than several comprehensions (hot path)
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
        """The batch before this step's tokens are sampled, for the union's peek on a plain
        step (views of the runner's buffers, decoding rows, per-request K limit)."""
        batch = self.input_batch
        req_ids = tuple(batch.req_ids)
        num_reqs = len(req_ids)
        num_tokens = batch.num_tokens_no_spec[:num_reqs]
        num_prompt = batch.num_prompt_tokens[:num_reqs]
        server_k = self.request_options.server_k
        params = [self.requests[r].sampling_params for r in req_ids]
        max_k = np.array([self.request_options.get(r, None if p is None else p.extra_args)
                          .cap(server_k) for r, p in zip(req_ids, params)], dtype=np.int64)
        sampled = sampled_rows(batch, num_reqs)
        rows = tuple(np.flatnonzero((num_tokens > num_prompt) & (max_k > 0)).tolist())
        return StepBatch(req_ids, batch.token_ids_cpu, num_tokens, num_prompt, max_k, sampled,
                         rows)

    @torch.inference_mode()
    def time_forward(self, rows: int, query_len: int, context_len: int, repeats: int = 5) -> float:
        """Seconds of one target forward over ``rows`` rows of ``query_len`` query tokens on
        ``context_len`` context tokens; the fastest of ``repeats`` runs after a warm-up.

        Uses ``_dummy_run`` with ``force_attention`` (else CPU attention does no work),
        ``uniform_decode`` (else one token per row) and no speculative config (target only).
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
        """Time target forwards of 1, 2, 4, ... query tokens before the first request, for the
        cost model, at a modest :data:`CALIBRATION_CONTEXT_LEN` (the curve has no context
        dimension; with none, attention would do no work)."""
        shapes = calibration_shapes(self.scheduler_config.max_num_seqs,
                                    self.uniform_decode_query_len, self.max_num_tokens)
        longest = max(query_len for _, query_len in shapes)
        context_len = max(0, min(CALIBRATION_CONTEXT_LEN, self.max_model_len - longest))
        knots = [rows * query_len for rows, query_len in shapes]
        seconds = [self.time_forward(rows, query_len, context_len, repeats)
                   for rows, query_len in shapes]
        # tensor parallelism: every rank uses rank 0's times (ranks.py)
        seconds = agree_array(RankZeroClock(), np.array(seconds))
        # monotone: more tokens never cost less
        seconds = np.minimum.accumulate(np.array(seconds)[::-1])[::-1]
        self.drafter.calibrate(np.array(knots), seconds)
        self.calibration = {f"{r}x{q}": round(float(t) * 1e3, 3)
                            for (r, q), t in zip(shapes, seconds)}
        logger.info("specplugin: target forward ms by rows x query tokens %s", self.calibration)

    def plugin_stats(self) -> dict:
        """The drafter's counters plus verification shortcuts, start-up calibration and
        (when on) the scorer's counters."""
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
        """A step the drafter foretold plain (and a :func:`plain_decode`) runs as vLLM's own,
        speculative config set aside, no plugin code; any batch change ends the run. The
        drafter learns their times later (:meth:`_learn_plain_steps`)."""
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
        """Hand the drafter the steps run as vLLM's own since it last heard."""
        if self._plain_step_times:
            times, self._plain_step_times = self._plain_step_times, []
            self.drafter.learn_plain_steps(times, self._plain_run_reqs)

    @phase("scorer: expand")
    def _model_forward(self, input_ids=None, positions=None, **kwargs):
        """With the batch-expanding scorer, extra candidates run as extra rows (:mod:`.scorer`)."""
        forward = super()._model_forward
        if self._vllm_step or self.expander is None or kwargs.get("inputs_embeds") is not None:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        return self.expander.forward(self, forward, input_ids, positions, **kwargs)

    @phase("scorer: resolve")
    def _sample(self, logits, spec_decode_metadata):
        if self._vllm_step:
            return super()._sample(logits, spec_decode_metadata)
        if spec_decode_metadata is None and self.expander is None:
            # a plain step: no rejection sampler runs
            self._heard = None
            return super()._sample(logits, None)
        if self.expander is not None:
            self.expander.keep_target_logits(logits, spec_decode_metadata)
            self._heard = None  # extra rows are not the batch's: verdicts only
            with verification.recovering():
                sampler_output = super()._sample(logits, spec_decode_metadata)
            self.expander.resolve(self, sampler_output)
            return sampler_output
        # a speculative step without the scorer; no update_async_output_token_ids():
        # these batches read no output tokens
        output = verification.verify_greedy(logits, spec_decode_metadata,
                                            self.input_batch.sampling_metadata,
                                            self.rejection_sampler)
        if output is not None:
            self._heard = None  # no sampled request
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

    @phase("plugin: runner")
    def _update_states(self, scheduler_output):
        if self._vllm_step:
            return super()._update_states(scheduler_output)
        self._learn_plain_steps()  # before anything of this step reaches the drafter
        self.step_scheduler_output = scheduler_output
        if self.expander is not None:
            self.expander.check_scheduled_blocks(scheduler_output)
        if self._stats_publisher is not None and not self.publishes_in_wait:
            self._stats_publisher.maybe_publish(self.plugin_stats)
        finished = scheduler_output.finished_req_ids
        if finished:  # (finished or aborted: their records go, in the union)
            self.drafter.finish_requests(finished)
        # resumed after preemption: new KV blocks, the drafter's KV state is stale
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        if resumed:
            self.drafter.restart_requests(resumed)
        return super()._update_states(scheduler_output)

    @phase("plugin: runner")
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        """A step in which no request has a draft runs as a plain decoding step.

        With a speculative config vLLM runs its spec-decode machinery every step, drafts or
        not (a never-drafting proposer ran at ~0.86x of no speculation at batch 16)."""
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

    @phase("plugin: other")
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        """The draft-model drafter drafts before vLLM prepares the draft model's inputs
        (:meth:`~specplugin.vllm_layer.draft_proposer.PluginDraftProposer.draft_step`: its
        runs read the target's block tables, nothing vLLM prepares)."""
        if self._drafts_with_model and torch.is_tensor(sampled_token_ids):
            self._draft_probs = self._draft_prob_req_ids = None  # as vLLM's call does
            drafts = self.drafter.draft_step(sampled_token_ids, sampling_metadata,
                                             common_attn_metadata)
            draft_probs = self.drafter.take_last_draft_probs()
            if draft_probs is not None:  # kept as vLLM's call keeps them
                self._draft_probs = draft_probs
                self._draft_prob_req_ids = self.input_batch.req_ids.copy()
            return drafts
        return super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
            common_attn_metadata, slot_mappings)

    @phase("plugin: hand back")
    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False) -> None:
        super()._copy_draft_token_ids_to_cpu(scheduler_output, zeros_only=zeros_only)
        if zeros_only:  # the drafter did not run this step
            self._draft_lengths = [0] * self.input_batch.num_reqs
            # drop unresolved drafts, or the next resolve counts them as all accepted
            self.drafter.forget_pending()
            if self.expander is not None:
                self.expander.forget()
        else:
            # tensor rows are cut to the drafter's lengths; lists are already as sent
            self._draft_lengths = (self.drafter.last_lengths
                                   if torch.is_tensor(self._draft_token_ids) else None)
            if self.expander is not None:
                plan = self.drafter.plan
                self.expander.remember(self.input_batch.req_ids,
                                       [] if plan is None else plan.alternates)

    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        """Draft probs for the rejection sampler, [num_draft_tokens_total, vocab_size]: a view
        of the drafter's [num_reqs, positions, vocab_size] tensor when its drafts lie end to
        end (one row, or every position verified), else vLLM's gather (a copy)."""
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
        """vLLM's step output with the step's drafts riding on it (:mod:`.draft_handoff`).
        If :meth:`_skip_drafting`, vLLM samples on its non-speculative path and no drafts
        are handed back."""
        if self._vllm_step:  # via super() so the sampled profiler charges it to vLLM
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
        """After a step run as vLLM's own: keep its time for the drafter; no drafts ride."""
        self._plain_step_times.append(self.drafter.timer.lap())
        self._plain_run_reqs = self.input_batch.num_reqs
        self.num_steps_as_vllm += 1
        self._draft_token_req_ids = None  # nothing for anyone to fetch
        self._draft_lengths = None
        if isinstance(output, ModelRunnerOutput) and output is not EMPTY_MODEL_RUNNER_OUTPUT:
            draft_handoff.attach(output, None)
        return output

    def _foretold_plain_steps(self) -> int:
        """Steps after this plain one that may run as vLLM's own (0 with the scorer)."""
        if self.expander is not None:
            return 0
        return self.drafter.plain_steps_ahead()

    def _note_new_requests(self) -> None:
        """Tell the drafter's step arbiter that requests joined the batch this step."""
        so = self.step_scheduler_output
        if getattr(so, "scheduled_new_reqs", None):
            self.drafter.new_requests(len(so.scheduled_new_reqs), self.input_batch.num_reqs)

    @phase("plugin: plain step")
    def _skip_drafting(self) -> bool:
        """Skip this step's drafting: it verified no draft, the model allows plain steps,
        one rank only, and the drafter's arbiter keeps the next step plain."""
        so = self.step_scheduler_output
        if (not self._plain_steps_allowed or so is None
                or self.execute_model_state is None
                or self.parallel_config.tensor_parallel_size > 1
                or any(so.scheduled_spec_decode_tokens.values())):
            return False
        num_reqs = self.input_batch.num_reqs
        # sampling requests, from vLLM's own set (cheap: runs every plain step)
        num_sampled = len(self.input_batch.random_reqs)
        return self.drafter.skip_drafting(num_reqs, so.total_num_scheduled_tokens,
                                          2 * num_sampled > num_reqs, _read_prompts(so))

    @phase("plugin: hand back")
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
    """Mixed in front of vLLM's ``CPUWorker`` or ``Worker``: calibration after warm-up,
    and ``LLM.collective_rpc`` entry points."""

    def compile_or_warm_up_model(self):
        times = super().compile_or_warm_up_model()
        self.model_runner.calibrate_step_cost()
        # reseed as vLLM does, so start-up work leaves no trace in sampling
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        # freeze start-up objects so full GC collections scan only what serving allocates
        freeze_gc_heap()
        return times

    def specplugin_gc(self, collect: bool = True) -> dict:
        """``collective_rpc("specplugin_gc")``: objects frozen at start-up and, with
        ``collect``, the seconds one full collection takes now."""
        start = time.perf_counter()
        if collect:
            gc.collect()
        return {"frozen": gc.get_freeze_count(),
                "full_collection_s": time.perf_counter() - start if collect else None}

    def use_the_wait(self) -> None:
        """Idle time after replying to the engine core (:mod:`.worker_wait`): run held-back
        learning and publish counters when due (~4% of the plugin's work if done on a step).
        Publishing is skipped between ``execute_model`` and ``sample_tokens``, and forced
        once no request is left (the step that drops the last records: an idle server
        takes no later step that would publish them)."""
        runner = self.model_runner
        background = learning_background(runner)
        if background is not None:
            background.run_pending()
        publisher = getattr(runner, "_stats_publisher", None)
        if publisher is not None and runner.execute_model_state is None:
            runner.publishes_in_wait = True
            publisher.maybe_publish(runner.plugin_stats, force=runner.input_batch.num_reqs == 0)

    def specplugin_learning(self) -> dict:
        """``collective_rpc("specplugin_learning")``: learning jobs handed over, how many ran
        in the wait vs. on a step, their seconds, and whether publishing is in the wait."""
        runner = self.model_runner
        background = learning_background(runner)
        if background is None:
            return {}
        return {"jobs": background.num_jobs, "off_step": background.num_off_step,
                "off_step_s": background.busy_s, "on_step_s": background.waited_s,
                "publishes_in_wait": getattr(runner, "publishes_in_wait", False)}

    def time_forward(self, rows: int, query_len: int, context_len: int,
                     repeats: int = 5) -> float:
        """``collective_rpc("time_forward", args=...)``: :meth:`PluginRunnerMixin.time_forward`."""
        return self.model_runner.time_forward(rows, query_len, context_len, repeats)

    def specplugin_stats(self) -> dict:
        """``collective_rpc("specplugin_stats")``: the drafter's counters now."""
        return self.model_runner.plugin_stats()

    def specplugin_forget_learned(self) -> bool:
        """``collective_rpc("specplugin_forget_learned")``, between requests: reset what the
        drafter learned (bench warm-up)."""
        runner = self.model_runner
        runner._learn_plain_steps()  # flush, so they are forgotten too
        runner._plain_ahead = 0  # a fresh engine's arbiter foretells nothing yet
        runner.drafter.forget_learned()
        return True


class PluginCPUWorker(PluginWorkerMixin, CPUWorker):
    def init_device(self) -> None:
        # vLLM's CPU worker builds its runner inline from this module-level name
        with patches.swapped(cpu_worker, "CPUModelRunner", PluginCPUModelRunner):
            super().init_device()


def learning_background(runner):
    """The drafter's learning :class:`~specplugin.adaptive.background.Background`, or None."""
    return getattr(getattr(runner, "drafter", None), "background", None)


def plain_decode(scheduler_output) -> bool:
    """Every request decodes one token, no draft; none joins, leaves or resumes."""
    so = scheduler_output
    return (not so.scheduled_new_reqs and not so.finished_req_ids
            and not so.scheduled_cached_reqs.resumed_req_ids
            and not any(so.scheduled_spec_decode_tokens.values())
            and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0)


def _read_prompts(scheduler_output) -> bool:
    """Whether a row read more than one token plus its drafts (new prompt, prefill chunk,
    or resumed request): the step's time is a prefill's."""
    if scheduler_output is None:
        return False
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return True
    per_request = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return any(n > 1 + len(drafts.get(r, ())) for r, n in per_request.items())


def __getattr__(name: str):
    # the CUDA worker imports CUDA-only modules: build it only when asked for
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

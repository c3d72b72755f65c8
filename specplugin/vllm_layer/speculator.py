"""``specplugin.Speculator``: the drafter of the plugin's token-level proposers inside vLLM.

Built by vLLM's ``custom_class`` hook; the plugin's runner (:mod:`.worker`) attaches to
supply request ids, sampling params and verification results, which become vLLM-free
records for the :class:`~specplugin.adaptive.union.Union`. vLLM's rejection sampler
verifies the drafts, so output stays exactly the target's. A failure in drafting costs
that step its drafts, never a request.
"""

from __future__ import annotations

import logging

import numpy as np

from specplugin.adaptive import build
from specplugin.adaptive.cost import StepTimer
from specplugin.adaptive.memory import open_memory
from specplugin.metrics import FailureCounter
from specplugin.profiling import phase
from specplugin.proposers import StepBatch
from specplugin.adaptive.learning import Verified
from specplugin.adaptive.plan import StepPlan
from specplugin.vllm_layer.ranks import tensor_parallel_rank
from specplugin.vllm_layer.config_hook import worker_config
from specplugin.vllm_layer.draft_inputs import sampled_rows
from specplugin.vllm_layer import verification

logger = logging.getLogger("specplugin")


class Speculator:
    def __init__(self, vllm_config):
        self.config = worker_config(vllm_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.union = build(self.config, vllm_config.scheduler_config.max_num_batched_tokens)
        self.background = self.union.background
        self.memory = open_memory(self.union, self.config.state_dir,
                                  vllm_config.model_config.model, None,
                                  self.num_speculative_tokens,
                                  writer=tensor_parallel_rank() == 0)
        self.failures = FailureCounter("union", logger)
        self.runner = None
        self.plan: StepPlan | None = None  # the union's plan of the last propose
        self.last_lengths = None  # (drafts are lists already cut to their lengths)
        self.timer = StepTimer()
        # skip_drafting already read this step's wall time (see _this_step)
        self._step_seconds: float | None = None
        self._step_timed = False

    def attach(self, runner) -> None:
        """The plugin's model runner: the source of each step's request context."""
        self.runner = runner

    def load_model(self, target_model) -> None:
        """Token-level proposers need no weights."""

    def calibrate(self, num_tokens: np.ndarray, seconds: np.ndarray) -> None:
        """Timed target forwards from engine start (see the worker)."""
        self.union.cost.calibrate(num_tokens, seconds)

    @phase("plugin: other")
    def propose(
        self,
        sampled_token_ids: list[list[int]],  # [num_reqs][num_emitted] tokens of the last step
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs] context length per row
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        slot_mappings=None,
    ) -> list[list[int]]:
        num_reqs = len(sampled_token_ids)
        if self.runner is None:
            raise RuntimeError("specplugin.Speculator runs inside specplugin's worker; the "
                               "config hook selects it (leave worker_cls unset)")
        try:
            context = self.runner.step_context()
            batch = self._batch(context, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
            self.plan = self.union.step(batch, self._verified(context, sampled_token_ids))
            return self.plan.drafts
        except Exception:  # a bug in drafting must not fail requests: decode plainly
            self.plan = None
            self.failures.record()
            self.forget_pending()
            return [[] for _ in range(num_reqs)]

    def _peek(self) -> StepBatch:
        """The current batch, for the union's peek on a plain step."""
        return self.runner.peek_batch()

    def skip_drafting(self, num_reqs: int, num_query_tokens: int, mostly_sampled: bool,
                      read_prompts: bool = False) -> bool:
        """Asked before drafting on a step that verified no draft: True if the next step
        decodes plainly too, so no proposer runs (``Union.plain_step``). On False the full
        path runs in the same step and reuses the time read here (:meth:`_this_step`).
        ``read_prompts``: the step read prompt tokens (its time teaches nothing)."""
        seconds = self._step_seconds = self.timer.lap()
        self._step_timed = True
        try:
            return not self.union.plain_step(seconds, num_reqs, num_query_tokens,
                                             mostly_sampled, peek=self._peek,
                                             read_prompts=read_prompts)
        except Exception:  # a bug here costs the fast path, never a request
            self.failures.record()
            return False

    def plain_steps_ahead(self) -> int:
        """After :meth:`skip_drafting` said True: how many further steps are plain regardless
        (``Union.plain_steps_ahead``); the runner may run them as vLLM's own."""
        try:
            return self.union.plain_steps_ahead()
        except Exception:  # a bug here costs the fast path, never a request
            self.failures.record()
            return 0

    def learn_plain_steps(self, times: list[float | None], num_reqs: int) -> None:
        """Learn what :meth:`skip_drafting` would have from steps run as vLLM's own."""
        try:
            self.union.plain_steps_ran(times, num_reqs)
        except Exception:
            self.failures.record()

    def new_requests(self, num_new: int, num_reqs: int) -> None:
        """Requests joined the batch this step (see the runner's ``_note_new_requests``)."""
        self.union.new_requests(num_new, num_reqs)

    def _this_step(self) -> float | None:
        """The wall time of the step just run, read once per step (by :meth:`skip_drafting`
        if it ran; a second lap would teach the cost model that steps cost nothing)."""
        if self._step_timed:
            self._step_timed = False
            return self._step_seconds
        return self.timer.lap()

    @phase("plugin: context")
    def _verified(self, context, sampled_token_ids) -> Verified:
        seconds = self._this_step()
        return Verified(tuple(context.req_ids), np.asarray(context.num_scheduled_drafts),
                        np.array([len(s) for s in sampled_token_ids]), seconds,
                        context.num_query_tokens, context.scored,
                        expected=context.expected_acceptance, read_prompts=context.read_prompts,
                        next_tokens=[s[-1] if len(s) else -1 for s in sampled_token_ids])

    @phase("plugin: context")
    def _batch(self, context, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> StepBatch:
        num_reqs = len(sampled_token_ids)
        num_tokens = num_tokens_no_spec[:num_reqs]
        # r tokens left: at most r - 1 drafts (the last is the bonus); stay within max_model_len
        remaining = np.asarray(context.remaining_tokens[:num_reqs]) - 1
        limit = np.minimum(self.max_model_len - num_tokens, remaining)
        # and no request drafts past its own specplugin_max_k
        max_draft_lens = np.clip(limit, 0, context.max_k[:num_reqs])
        rows = tuple(i for i, s in enumerate(sampled_token_ids) if s and max_draft_lens[i] > 0)
        sampled = sampled_rows(self.runner.input_batch, num_reqs)
        return StepBatch(tuple(context.req_ids[:num_reqs]), token_ids_cpu, num_tokens,
                         np.asarray(context.num_prompt_tokens[:num_reqs]), max_draft_lens,
                         sampled, rows, context.allowed)

    def restart_requests(self, req_ids) -> None:
        """Resumed after preemption: token-level proposers keep no KV, nothing restarts."""

    def finish_requests(self, req_ids) -> None:
        self.union.finish_requests(list(req_ids))
        if self.memory is not None:
            self.memory.maybe_save(self.union, idle=self.union.idle)

    def forget_learned(self) -> None:
        """See ``Union.forget_learned``."""
        self._step_timed = False
        self.union.forget_learned()

    def forget_pending(self) -> None:
        self._step_timed = False
        self.union.forget_pending()

    def stats(self) -> dict:
        """The plugin's counters, JSON-able (for :mod:`.metrics_export`)."""
        return self.union.counters(self.failures, verification.failures())

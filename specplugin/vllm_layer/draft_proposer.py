"""The draft proposer inside vLLM: vLLM's draft-model machinery, our drafting loop.

Subclasses vLLM's ``DraftModelProposer`` (draft KV in the target's paged block pool) and
replaces the drafting loop: each request stops when the draft's calibrated confidence says
the next token is unlikely to be used (:mod:`specplugin.adaptive.draft_rule`), never past
the tokens it may still emit; sampled drafts keep their probabilities for vLLM's rejection
sampler. One batched forward per draft position, no per-request Python loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.llm_base_proposer import PADDING_SLOT_ID
from vllm.v1.sample.sampler import _SAMPLING_EPS

from specplugin import host_kernels, trace
from specplugin.adaptive import build
from specplugin.adaptive.cost import StepTimer
from specplugin.adaptive.memory import open_memory
from specplugin.config import SpecPluginConfig
from specplugin.profiling import DRAFT_FORWARD, DRAFT_FORWARDS, phase
from specplugin.proposers.faults import EveryNth
from specplugin.metrics import FailureCounter
from specplugin.proposers import StepBatch
from specplugin.proposers.base import Candidate
from specplugin.adaptive.draft_rule import AcceptanceCalibration, DraftRun, OutcomeTracker, StopRule
from specplugin.proposers.draft import (DraftKVCursor, HostDraws, UniformPool,
                                        greedy_draft_tokens, sample_draft_tokens)
from specplugin.adaptive.learning import Verified
from specplugin.adaptive.plan import DraftOutput, StepPlan
from specplugin.vllm_layer.draft_inputs import (
    KEPT_FIRST_VIEWS, DecodePassBuffers, FirstPassBuffers, cpu_attn_metadata,
    cpu_metadata_builder, decode_passes, draft_caps, host_view, num_accepted_drafts,
    mixed_draft_probs, sampled_rows, step_batch, update_cpu_decode_metadata)
from specplugin.vllm_layer.ranks import (RankZeroClock, follow, lead, ready_everywhere,
                                         tensor_parallel_rank)
from specplugin.vllm_layer import verification

logger = logging.getLogger("specplugin")


class PluginDraftProposer(DraftModelProposer):
    """``DraftModelProposer`` with per-request early stopping and extension. ``runner``:
    the plugin's model runner (its ``step_context()`` describes the batch rows)."""

    def __init__(self, vllm_config, device, runner, plugin_config: SpecPluginConfig):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.plugin_runner = runner  # vLLM's base class does not keep it
        # no M-RoPE: positions are one row
        self._one_dim_positions = not (self.uses_mrope or vllm_config.model_config.uses_mrope)
        self._paddings: dict[int, tuple] = {}  # tokens -> vLLM's padding (see _padding)
        self._row_views: dict[int, tuple] = {}  # rows -> buffer views (_views)
        settings = plugin_config.draft
        k_max = plugin_config.num_speculative_tokens
        self.fixed_min_acceptance = settings.min_acceptance  # None: measured by self.costs
        self.rule = StopRule(k=min(settings.k, k_max), k_max=k_max)
        self._rule_cache: tuple[tuple[float, float], StopRule] | None = None
        self.calibration = AcceptanceCalibration()
        self.outcomes = OutcomeTracker(self.calibration)
        self.timer = StepTimer()  # wall time between drafting calls
        self._step_seconds: float | None = None  # wall time of the step just run
        self._last_forwards = self._last_draft_tokens = 0  # of the previous propose()
        self._last_draft_seconds = 0.0  # the previous propose()'s draft run, wall time
        self._param_ratio: float | None = None  # draft / target parameters (see param_ratio)
        self._observed = False  # skip_drafting already timed this step, chose to speculate
        self.failures = FailureCounter("draft", logger)
        self.clock = RankZeroClock()  # under TP rank 0 decides, the others follow (ranks.py)
        self.told: bool | None = None  # under TP, rank 0 told this step's run (held?)
        self.k_max = k_max
        self._forward_seconds: list[float] = []
        # (seconds, catch-up tokens, warm) of this step's first pass (see _agree_on_timings)
        self._first_pass: tuple[float, int, bool] | None = None
        self._steps_since_run = 2  # engine steps since the draft last ran (_draft_ran_last_step)
        every = plugin_config.fault_injection.draft_forward  # test-only fault injection
        self._forward_fault = None if every is None else EveryNth("draft forward", every)
        self.uniforms = UniformPool(device)  # the draws' uniforms, one per row and position
        self._host_draws = torch.device(device).type == "cpu"  # compiled draws (take_host)
        self._cpu_builder = None  # vLLM's CPU attention builder, if the draft uses it
        # first-pass host inputs (FirstPassBuffers); per token count, its forward's views
        self._first_buffers = FirstPassBuffers.of(self, vllm_config)
        self._first_views: dict[int, tuple] = {}
        self._decode_buffers: DecodePassBuffers | None = None  # see initialize_attn_backend
        self._token_arange_cpu = torch.from_numpy(self.token_arange_np)  # [max_num_tokens]
        # [num_reqs] draft tokens per row of the last propose(); the runner cuts rows to these
        self.last_lengths: list[int] | None = None
        # this step's run (DraftRun, its rows) and draft probabilities, and the inputs a run
        # reads (set by _step)
        self._run: tuple[DraftRun, list[int]] | None = None
        self._run_probs: torch.Tensor | None = None
        self._run_inputs: tuple | None = None
        # the decider: the draft alone is a union of one
        self.union = build(plugin_config, vllm_config.scheduler_config.max_num_batched_tokens)
        self.cursor = DraftKVCursor(self.union.requests)  # where each request's draft KV ends
        self.plan: StepPlan | None = None  # the union's plan of the last step
        self.costs = self.union.draft_costs  # what drafting costs, as timed
        self.memory = open_memory(
            self.union, plugin_config.state_dir, vllm_config.model_config.model,
            plugin_config.draft_model, k_max, writer=tensor_parallel_rank() == 0)
        self.proposer_stats = self.union.stats
        # learning held until this step's drafts are made, then run in the worker's wait
        self.background = self.union.background
        self._held_jobs: list = []

    def calibrate(self, num_tokens: np.ndarray, seconds: np.ndarray) -> None:
        self.union.cost.calibrate(num_tokens, seconds)  # target forwards timed at start

    def _defer(self, job) -> None:  # learning for after this step's drafts
        self._held_jobs.append(job)

    def _release_learning(self) -> None:
        """This step's drafts are made: the held learning goes to the background."""
        jobs, self._held_jobs = self._held_jobs, []
        for job in jobs:
            self.background.submit(job)

    def _settle(self) -> None:
        """Flush all learning (held jobs included) before anything reads what it writes."""
        self._release_learning()
        self.union.settle()

    def restart_requests(self, req_ids) -> None:
        """Resumed after preemption: the draft re-reads their whole context."""
        self._settle()  # (the cursor's notes of their last run first)
        self.cursor.forget(req_ids)

    def finish_requests(self, req_ids) -> None:
        self._settle()
        self.union.finish_requests(list(req_ids))
        if self.memory is not None:
            self.memory.maybe_save(self.union, idle=self.union.idle)

    def new_requests(self, num_new: int, num_reqs: int) -> None:
        """Requests joined the batch this step: new text for the union's peeks and arbiter."""
        self.union.new_requests(num_new, num_reqs)

    def _peek(self) -> StepBatch:
        """The batch as it stands, for the union's peek on a plain step."""
        return self.plugin_runner.peek_batch()

    def skip_drafting(self, num_reqs: int, num_query_tokens: int, mostly_sampled: bool,
                      read_prompts: bool = False) -> bool:
        """Asked when the step just run verified no draft: True if the next is plain too, so
        no draft machinery runs (skipped rows' draft KV catches up later). False under TP.
        ``read_prompts``: the step read prompt tokens, so its time teaches no cost model."""
        if self.clock.shared:
            return False
        self._settle()
        self._step_seconds = self.timer.lap()
        seconds = None if read_prompts else self._step_seconds  # what the step teaches
        if seconds is not None and (self._last_forwards or self._last_draft_tokens):
            self.costs.observe_step(seconds, num_reqs, self._last_forwards,
                                    self._last_draft_tokens)
        elif seconds is not None:  # the draft did not run: learned with the next plain steps
            self.costs.observe_plain_step(seconds, num_reqs)
        draft_seconds = self._last_draft_seconds
        self._last_forwards = self._last_draft_tokens = 0
        self._last_draft_seconds = 0.0
        try:
            plain = not self.union.plain_step(self._step_seconds, num_reqs, num_query_tokens,
                                              mostly_sampled, peek=self._peek,
                                              draft_seconds=draft_seconds,
                                              read_prompts=read_prompts)
        except Exception:  # a bug here costs the fast path, never a request
            self.failures.record()
            plain = False
        if plain:
            self._steps_since_run += 1
            self.outcomes.forget()
            self.cursor.forget_pending()
            self.last_lengths = [0] * num_reqs
        else:
            self._observed = True  # the full path must not observe this step again
        return plain

    def plain_steps_ahead(self) -> int:
        """After :meth:`skip_drafting` kept the next step plain: how many more stay plain
        regardless, for the runner to run as vLLM's own (0 under TP)."""
        try:
            return 0 if self.clock.shared else self.union.plain_steps_ahead()
        except Exception:  # a bug here costs the fast path, never a request
            self.failures.record()
            return 0

    def learn_plain_steps(self, times: list[float | None], num_reqs: int) -> None:
        """Learn what :meth:`skip_drafting` would have from steps run as vLLM's own: ``times``
        their wall times (None: not measured), ``num_reqs`` rows decoding one token each."""
        self._settle()
        try:
            for seconds in times:
                if seconds is not None:
                    self.costs.observe_plain_step(seconds, num_reqs)
            self.union.plain_steps_ran(times, num_reqs)
            self._steps_since_run += len(times)
        except Exception:
            self.failures.record()

    @phase("plugin: other")
    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> list[list[int]]:
        """vLLM's drafting call, where the worker could not call :meth:`draft_step` (its
        sampled tokens were not a tensor); a failure costs this step's drafts, no request."""
        try:
            return self._propose(*args, **kwargs)
        except Exception:
            num_reqs = self.plugin_runner.input_batch.num_reqs
            self._failed(num_reqs)
            return [[] for _ in range(num_reqs)]
        finally:
            self._release_learning()

    def _failed(self, num_reqs: int) -> None:
        """This step drafts nothing after a failure (counted): nothing pending, no timing."""
        self.failures.record()
        self.last_lengths = [0] * num_reqs
        self.plan = None
        self._run = None
        self._last_draft_probs = None
        self._last_draft_seconds = 0.0
        self.forget_pending()
        self.timer.reset()

    @phase("plugin: other")
    def draft_step(self, sampled_token_ids: torch.Tensor, sampling_metadata,
                   cad) -> list[list[int]]:
        """The step's drafts from ``sampled_token_ids`` [num_reqs, 1 + drafts] (-1 past a
        row's accepted ones), before vLLM prepares any draft input (it needs none: the run
        reads the block tables of ``cad``, the target's, and the temperatures)."""
        runner = self.plugin_runner
        num_reqs = runner.input_batch.num_reqs
        try:
            vocab_size = runner.input_batch.vocab_size
            sampled = sampled_token_ids.tolist()[:num_reqs]  # [num_reqs][1 + drafts]
            valid = [sum(1 for t in row if 0 <= t < vocab_size) for row in sampled]
            # (chunked-prefill rows have no valid token: they draft nothing, see draft_caps)
            next_tokens = [row[v - 1] if v else 0 for row, v in zip(sampled, valid)]
            context = runner.step_context()
            scheduled = context.num_scheduled_drafts[:num_reqs]
            # as vLLM counts them: drafts verified + 1 - tokens emitted (None: no drafts)
            rejected = ([s + 1 - v for s, v in zip(scheduled, valid)] if any(scheduled)
                        else None)
            return self._step(context, num_reqs, rejected, next_tokens, sampling_metadata, cad)
        except Exception:
            self._failed(num_reqs)
            return [[] for _ in range(num_reqs)]
        finally:
            self._release_learning()

    def forget_learned(self) -> None:
        """Forget what was learned: the union's (its costs included) and the calibration."""
        self._settle()
        self.forget_pending()
        self.calibration.forget()
        self.union.forget_learned()

    def forget_pending(self) -> None:
        """vLLM skipped drafting for a step: the results of earlier drafts never arrive."""
        self._settle()
        self.outcomes.forget()
        self.cursor.forget_pending()
        self._observed = False
        self.union.forget_pending()

    def stats(self) -> dict:
        """The plugin's own counters, JSON-able (published by metrics_export); the union's
        counter "draft" adds to the drafter's own. Held learning jobs write nothing yet."""
        return self.union.counters(self.failures, verification.failures())

    def _propose(
        self,
        target_token_ids: torch.Tensor,  # [num_tokens] (unused: the draft re-reads its KV)
        target_positions: torch.Tensor,  # [num_tokens] (unused)
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden_size] (unused)
        next_token_ids: torch.Tensor,  # [num_reqs]
        token_indices_to_sample: torch.Tensor | None,  # (unused)
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,  # (unused)
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [num_reqs]
        slot_mappings=None,  # (unused)
    ) -> list[list[int]]:
        num_reqs = common_attn_metadata.batch_size()
        rejected = (None if num_rejected_tokens_gpu is None
                    else num_rejected_tokens_gpu[:num_reqs].tolist())
        return self._step(self.plugin_runner.step_context(), num_reqs, rejected,
                          next_token_ids[:num_reqs].tolist(), sampling_metadata,
                          common_attn_metadata)

    def _step(self, context, num_reqs: int, rejected: list[int] | None,
              next_tokens: list[int], sampling_metadata, cad) -> list[list[int]]:
        """Learn from the step just verified, then this step's drafts. ``rejected`` (None: no
        drafts) and ``next_tokens``: [num_reqs] lists (cheaper than numpy for a few rows)."""
        self._settle()
        self._last_draft_probs = None
        self.last_lengths = None
        self.plan = None
        self._run = None
        self._steps_since_run += 1
        # [num_reqs] draft tokens each row had verified in that step, and accepted
        scheduled = list(context.num_scheduled_drafts[:num_reqs])
        num_accepted = num_accepted_drafts(scheduled, rejected)
        # accepted draft tokens whose draft KV the last run's decode passes wrote
        self.cursor.accepted(context.req_ids[:num_reqs], num_accepted)
        self._learn_draft_step(context, num_accepted, rejected)
        sampled = sampled_rows(self.plugin_runner.input_batch, num_reqs).tolist()
        # rows still in chunked prefill have no token to draft from yet
        caps = draft_caps(context.remaining_tokens[:num_reqs], context.max_k[:num_reqs],
                     self.plugin_runner.discard_request_mask.np[:num_reqs].tolist())
        last_tokens = [t if c > 0 else -1 for t, c in zip(next_tokens, caps)]  # -1: unknown
        self._run_inputs = (cad, sampling_metadata.temperature, sampled)
        verified = self._verified(context, scheduled, num_accepted, last_tokens)
        self._last_draft_seconds = 0.0
        batch = step_batch(self.plugin_runner.input_batch, context, sampled, caps,
                            num_accepted, next_tokens)
        # under TP rank 0 plans and the others follow (ranks.py)
        self.plan = (self.union.step(batch, verified, draft=self) if not self.clock.shared
                     else lead(self, batch, verified) if self.clock.leads else follow(self, batch))
        return self._union_drafts(batch, self.plan)

    def _run_draft(self, batch: StepBatch, caps: list[int]) -> tuple[DraftRun, list[int]]:
        """Run the draft model for the rows with ``caps[r] > 0``, each up to its cap."""
        cad, temperature, sampled = self._run_inputs
        num_tokens = batch.num_tokens.tolist()  # [num_reqs]
        rows = [r for r, c in enumerate(caps) if c > 0]  # the rows the draft model drafts for
        starts = self.cursor.starts([batch.req_ids[r] for r in rows],
                                    [num_tokens[r] for r in rows], self.max_num_tokens)
        if -1 in starts:  # (rows whose re-read would overflow the buffers wait)
            rows = [r for r, s in zip(rows, starts) if s >= 0]
            starts = [s for s in starts if s >= 0]
        # the stop rule only when the draft runs (reading its thresholds is not free)
        run = DraftRun(self._rule_with_thresholds(), self.calibration,
                       [sampled[r] for r in rows], caps=[caps[r] for r in rows])
        if rows:
            start = time.perf_counter()
            self._draft(run, batch, rows, starts, [num_tokens[r] for r in rows], cad,
                        temperature)
            self._last_draft_seconds = time.perf_counter() - start
        return run, rows

    @phase("draft: loop")
    def _draft(self, run: DraftRun, batch: StepBatch, rows: list[int], starts: list[int],
               ends: list[int], cad, temperature: torch.Tensor | None) -> None:
        """Draft for ``rows`` (ascending): a first pass re-reads each row's context from
        ``starts`` (its draft KV's end) to ``ends`` (its context length), giving draft
        position 0; then one batched forward per position while the rule says so."""
        num_rows = len(rows)
        start = time.perf_counter()
        row_array = np.array(rows, dtype=np.int64)  # [num_rows]
        end_array = np.array(ends, dtype=np.int64)  # [num_rows] exclusive
        query_lens = [e - s for s, e in zip(starts, ends)]  # [num_rows]
        error = None
        try:
            cad, num_tokens, last, views = self._first_pass_inputs(
                batch, row_array, np.array(starts, dtype=np.int64), end_array, cad,
                (sum(query_lens), max(query_lens), max(ends)))
        except Exception as err:  # (raised below, on every rank)
            error = err
        self._ready_on_every_rank(error, [batch.req_ids[r] for r in rows], sum(query_lens))
        hidden = self._forward(cad, num_tokens, views)
        self.cursor.advance([batch.req_ids[r] for r in rows], ends)
        if temperature is not None and num_rows != temperature.shape[0]:  # (rows ascend)
            temperature = temperature[torch.from_numpy(row_array).to(temperature.device)]
        # once per run, from the host temperatures: all rows sample; all at temperature 1
        all_sampled = all(run.sampled)
        host_temperatures = self.plugin_runner.input_batch.temperature_cpu
        unit = all_sampled and temperature is not None and all(
            host_temperatures[r] == 1.0 for r in rows)
        mode = (all_sampled, unit)
        # one uniform per row and position for the run ([k_max, num_rows] on the host)
        uniforms = (None if temperature is None
                    else self.uniforms.take_host((run.rule.k_max, num_rows))
                    if self._host_draws else self.uniforms.take((run.rule.k_max, num_rows, 1)))
        # host draws write tokens straight into the next pass's int32 input ids (no copy)
        next_ids = None if temperature is None else self._views(num_rows)[3]
        # host draws from float32 logits, into blocks made once per run
        draws = (HostDraws(uniforms, None if unit else
                           host_temperatures[row_array].astype(np.float32), run.sampled,
                           next_ids)
                 if self._host_draws and temperature is not None else None)

        def sample(hidden: torch.Tensor) -> bool:  # [num_rows, hidden_size]
            return self._sample_into(run, hidden, temperature, mode, uniforms, next_ids, draws)

        more = sample(hidden[last])
        first_pass = (time.perf_counter() - start, num_tokens - num_rows)
        warm = self._start_run(*first_pass)
        if warm or not more:
            self._observe_first_pass(*first_pass, warm)
        if more:
            # a cold run's first pass is observed with its first decode pass
            self._decode_passes(run, cad, end_array, last, sample, next_ids is None,
                                None if warm else first_pass)

    def _decode_passes(self, run: DraftRun, cad, ends: np.ndarray, last, sample,
                       copy_ids: bool, cold_first_pass: tuple | None) -> None:
        """The run's decode passes, one batched forward per draft position while ``sample``
        (the draw and the stop rule) says so; ``copy_ids``: the next pass's input ids are
        copied from the run's tokens (else the host draw wrote them in place)."""
        num_rows = len(ends)
        self._switch_to_decode(cad, num_rows)
        # one padded size for every decode pass (CUDA graphs); padding rows must map to
        # the padding slot id, or the dummy rows overwrite real draft KV
        padding = self._padding(num_rows)
        # [num_padded] and [num_rows]: the same buffer every pass
        padded_ids, input_ids = self._views(padding[1])[2], self._views(num_rows)[2]
        if self._one_dim_positions:  # every pass's positions and slots at once
            passes = decode_passes(cad.block_table_tensor, ends, run.rule.k_max - 1,
                                   self.block_size, self.max_model_len, padding[1],
                                   self._decode_buffers)
        else:  # (M-RoPE positions: vLLM's update, one pass at a time)
            positions = self.positions[last].clone()  # (a slice for one row: not a view)
            inputs = self._decode_inputs(padding[1])  # (buffer views, rewritten per pass)
        # one forward context for all decode passes; each sets its metadata (_decode_forward)
        with set_forward_context(None, self.vllm_config, num_tokens=padding[1],
                                 num_tokens_across_dp=padding[2],
                                 cudagraph_runtime_mode=padding[0]):
            context = get_forward_context()
            for draft_index in range(1, run.rule.k_max):
                start, error = time.perf_counter(), None
                try:
                    if self._one_dim_positions:
                        inputs = passes.set_pass(draft_index - 1, cad, padded_ids,
                                                 self._draft_attn_layer_names)
                    else:
                        positions = self._update_positions_dependent_metadata(
                            positions, cad, num_rows, padding[1], self.block_size)
                    if copy_ids:
                        input_ids.copy_(run.token_ids[-1])  # (int64 -> int32 in the copy)
                except Exception as err:  # (raised below, on every rank)
                    error = err
                self._ready_on_every_rank(error, [], num_rows)
                hidden = self._decode_forward(context, cad, draft_index, inputs)
                if hidden.shape[0] != num_rows:  # (padded)
                    hidden = hidden[:num_rows]
                more = sample(hidden)
                self._observe_decode_pass(time.perf_counter() - start, cold_first_pass)
                cold_first_pass = None
                if not more:
                    return

    @phase("draft: inputs")
    def _first_pass_inputs(self, batch: StepBatch, rows: np.ndarray, starts: np.ndarray,
                           ends: np.ndarray, cad, sizes: tuple[int, int, int]):
        """Inputs and attention metadata of the first pass: row i reads ``[starts[i],
        ends[i])``. ``sizes``: (total tokens, longest query, longest context). Returns
        (metadata, total tokens, each row's last token index, :meth:`_first_pass_views`)."""
        num_tokens, max_query_len, max_seq_len = sizes
        num_rows = rows.size
        views = self._first_pass_views(num_tokens)
        num_padded = views[3][1]
        # integer work in one compiled host pass (on CPU, straight into the forward's inputs)
        buffers = self._first_buffers
        host = buffers.host if buffers is not None else FirstPassBuffers.host_arrays(
            num_padded, num_rows)
        if num_padded > host[3].shape[0]:  # (the kernel writes unchecked)
            raise ValueError(f"a first pass of {num_padded} tokens overflows the draft's "
                             f"buffers ({host[3].shape[0]})")
        host_kernels.first_pass_inputs(rows, starts, ends, batch.token_ids,
                                       host_view(cad.block_table_tensor), self.block_size,
                                       *host, num_padded, PADDING_SLOT_ID)
        device = self.input_ids.device
        if buffers is not None:  # (host tensors: the same on both sides)
            query_start_loc, seq_lens = buffers.row_views(num_rows)
            query_start_loc_cpu, seq_lens_cpu = query_start_loc, seq_lens
        else:
            query_start_loc_cpu, seq_lens_cpu = self._copy_first_pass(host, num_rows,
                                                                      num_padded)
            query_start_loc, seq_lens = query_start_loc_cpu.to(device), seq_lens_cpu.to(device)
        if rows[-1] == num_rows - 1:  # every row from 0 (rows ascend): a view
            block_table = cad.block_table_tensor[:num_rows]  # [num_rows, max_blocks]
        else:
            block_table = cad.block_table_tensor[torch.from_numpy(rows).to(device)]
        sub = CommonAttentionMetadata(
            query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens, num_reqs=num_rows, num_actual_tokens=num_tokens,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            block_table_tensor=block_table, slot_mapping=views[2], causal=True,
            # (vLLM's M-RoPE update writes the lengths in place: not into seq_lens)
            seq_lens_cpu_upper_bound=(seq_lens_cpu if self._one_dim_positions
                                      else seq_lens_cpu.clone()))
        # [num_rows] each row's last token; for one row a slice, far cheaper than a gather
        last = (slice(num_tokens - 1, num_tokens) if num_rows == 1
                else torch.from_numpy(host[0][1:num_rows + 1] - 1).to(device))
        return sub, num_tokens, last, views

    def _copy_first_pass(self, host: tuple, num_rows: int, num_padded: int):
        """Off the host path: copy the host arrays into the proposer's buffers; returns
        query starts and seq lens as host tensors."""
        cu_query_lens, seq_lens, positions, input_ids, slots = host
        device = self.input_ids.device
        self.input_ids[:num_padded].copy_(torch.from_numpy(input_ids).to(device))
        self._slot_mapping_buffer[:num_padded].copy_(torch.from_numpy(slots).to(device))
        positions = torch.from_numpy(positions).to(device)
        if self._one_dim_positions:
            self.positions[:num_padded].copy_(positions)
        else:
            self._set_positions(num_padded, positions)
        return torch.from_numpy(cu_query_lens), torch.from_numpy(seq_lens)

    def _first_pass_views(self, num_tokens: int) -> tuple:
        """First-pass forward inputs (model inputs, slot mappings, real slots, :meth:`_padding`)
        as buffer views, cached per count up to :data:`KEPT_FIRST_VIEWS` without DP."""
        views = self._first_views.get(num_tokens)
        if views is not None:
            return views
        padding = self._padding(num_tokens)
        num_padded = padding[1]
        if self.supports_mm_inputs:  # (embedded from the ids: by _forward, once written)
            kwargs = None
        elif self.pass_hidden_states_to_model:
            kwargs = self.build_model_inputs_first_pass(num_tokens, num_padded, None)[0]
        else:
            kwargs = {"input_ids": self.input_ids[:num_padded],
                      "positions": self._get_positions(num_padded), "inputs_embeds": None}
        slots = self._slot_mapping_buffer[:num_padded]
        views = (kwargs, dict.fromkeys(self._draft_attn_layer_names, slots),
                 slots[:num_tokens], padding)
        if (num_tokens <= KEPT_FIRST_VIEWS and not self.supports_mm_inputs
                and self.vllm_config.parallel_config.data_parallel_size == 1):
            self._first_views[num_tokens] = views
        return views

    @phase("plugin: learn")
    def _learn_draft_step(self, context, num_accepted: list[int],
                          rejected: list[int] | None) -> None:
        """Learn the draft's outcomes and the step's time from the step just verified."""
        num_reqs = len(num_accepted)
        pending = self.outcomes.take()  # (this step's drafts are recorded in its place)
        req_ids, scheduled = context.req_ids, context.num_scheduled_drafts[:num_reqs]
        expected = context.expected_acceptance
        self._defer(lambda: self.outcomes.resolve(req_ids, scheduled, rejected, expected,
                                                  pending=pending))
        if self._observed:  # skip_drafting timed this step already
            return
        # wall time of the step just run (None: first step, or the last one failed)
        self._step_seconds = self.timer.lap()
        if self.clock.shared:
            self._step_seconds, self._last_draft_seconds = self._agree_on_timings(
                self._step_seconds, self._last_draft_seconds)
        if self._step_seconds is not None and not context.read_prompts:  # (see skip_drafting)
            # every row emitted one token plus its accepted drafts
            self.costs.observe_step(self._step_seconds, num_reqs + sum(num_accepted),
                                    self._last_forwards, sum(scheduled))
            if self.costs.deferred_flush:
                self._defer(self.costs.flush_due)

    def _rule_with_thresholds(self) -> StopRule:
        """This step's stop rule; rebuilt only when its thresholds moved (every step asks)."""
        if self.fixed_min_acceptance is not None:
            thresholds = (self.fixed_min_acceptance, self.rule.pass_threshold)
        else:
            thresholds = self.costs.thresholds()
        if self._rule_cache is None or self._rule_cache[0] != thresholds:
            row, per_pass = thresholds
            self._rule_cache = (thresholds, dataclasses.replace(
                self.rule, row_threshold=row, pass_threshold=per_pass))
        return self._rule_cache[1]

    def _start_run(self, seconds: float, catch_up_tokens: int) -> bool:
        """The run's first pass is done: returns whether the run is warm; the draft has run."""
        warm = self.ran_last_step
        if trace.TRACE is not None:
            trace.TRACE.write("first_pass", ms=seconds * 1e3, catch_up=catch_up_tokens,
                              since=self._steps_since_run, warm=warm)
        self._steps_since_run = 0
        return warm

    def _observe_decode_pass(self, seconds: float,
                             cold_first_pass: tuple[float, int] | None) -> None:
        """A decode pass's time teaches the draft forward's price, except a cold run's first
        (slowed ~2.5x by the caches plain steps swept): its excess over the price goes to
        the first pass of that run (``cold_first_pass``: (seconds, catch-up tokens))."""
        if trace.TRACE is not None:
            trace.TRACE.write("decode_pass", ms=seconds * 1e3, cold=cold_first_pass is not None)
        if cold_first_pass is None:
            self._observe_forward(seconds)
            return
        first_seconds, catch_up_tokens = cold_first_pass
        price = self.costs.draft_forward_s
        excess = 0.0 if price is None else max(0.0, seconds - price)
        self._observe_first_pass(first_seconds + excess, catch_up_tokens, warm=False)

    def initialize_attn_backend(self, *args, **kwargs) -> None:
        super().initialize_attn_backend(*args, **kwargs)
        self._cpu_builder = cpu_metadata_builder(self.draft_attn_groups)
        if self._first_buffers is not None:  # (host buffers: the block tables' too)
            self._decode_buffers = DecodePassBuffers(self._draft_attn_layer_names)

    def _observe_forward(self, seconds: float) -> None:
        if self.clock.shared:  # shared at the next step (_agree_on_timings)
            self._forward_seconds.append(seconds)
        else:
            self.costs.observe_forward(seconds)

    def _observe_first_pass(self, seconds: float, catch_up_tokens: int, warm: bool) -> None:
        if self.clock.shared:  # shared at the next step (_agree_on_timings)
            self._first_pass = (seconds, catch_up_tokens, warm)
        else:
            self.costs.observe_first_pass(seconds, catch_up_tokens, warm)

    def _agree_on_timings(self, step_seconds: float | None,
                          draft_seconds: float) -> tuple[float | None, float]:
        """Under TP: rank 0's step, draft-run and draft-forward times replace this rank's."""
        forwards = self._forward_seconds
        first_seconds, first_tokens, warm = self._first_pass or (None, None, None)
        step_seconds, draft_seconds, total, count, first_seconds, first_tokens, warm = (
            self.clock.agree([step_seconds, draft_seconds, sum(forwards), len(forwards),
                              first_seconds, first_tokens, warm]))
        self._forward_seconds, self._first_pass = [], None
        for _ in range(int(count or 0)):
            self.costs.observe_forward(total / count)
        if first_seconds is not None:
            self.costs.observe_first_pass(first_seconds, int(first_tokens), bool(warm))
        return step_seconds, draft_seconds or 0.0

    def _ready_on_every_rank(self, error: Exception | None, req_ids: list[str],
                             num_tokens: int) -> None:
        """Before a draft forward of ``num_tokens``: raise ``error`` (its inputs failed), the
        test's fault, or (under TP) another rank's failure (:func:`ranks.ready_everywhere`)."""
        try:
            if error is None and self._forward_fault is not None:
                self._forward_fault.tick()
        except Exception as err:
            error = err
        if self.clock.shared:
            error = ready_everywhere(self.clock, self.cursor, error, req_ids, num_tokens)
        if error is not None:
            raise error

    @phase("draft: inputs")
    def _forward(self, cad, num_tokens: int, views: tuple) -> torch.Tensor:
        """The first pass: one draft forward over ``num_tokens``, in its own forward context."""
        attn_metadata = self._attn_metadata(cad, 0)
        kwargs, slot_mapping, _, (mode, num_input_tokens, across_dp) = views
        if kwargs is None:
            kwargs = self.build_model_inputs_first_pass(num_tokens, num_input_tokens, None)[0]
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=num_input_tokens,
                                 num_tokens_across_dp=across_dp,
                                 cudagraph_runtime_mode=mode, slot_mapping=slot_mapping):
            return self._run_model(kwargs)

    @phase("draft: inputs")
    def _decode_forward(self, context, cad, draft_index: int,
                        inputs: tuple[dict, dict]) -> torch.Tensor:
        """A decode pass in the run's shared ``ForwardContext`` (one per run, not per pass as
        vLLM's drafters do: ~0.02 ms a pass): sets the pass's metadata, runs the model."""
        kwargs, context.slot_mapping = inputs
        if draft_index > 1 and self._cpu_builder is not None:
            update_cpu_decode_metadata(self._cpu_builder, context.attn_metadata, cad)
        else:
            context.attn_metadata = self._attn_metadata(cad, draft_index)
        context.moe_layer_index = 0  # (MoE layers count their calls within a forward)
        return self._run_model(kwargs)

    @phase("draft: metadata")
    def _attn_metadata(self, cad, draft_index: int) -> dict:
        """Per-layer attention metadata of a draft forward, built directly from the draft's
        one group (else vLLM's ``build_per_group_and_layer_attn_metadata``)."""
        groups = self.draft_attn_groups
        if self._cpu_builder is not None:  # (one group)
            return dict.fromkeys(groups[0].layer_names,
                                 cpu_attn_metadata(self._cpu_builder, cad))
        if len(groups) != 1:
            return self.build_per_group_and_layer_attn_metadata(cad, draft_index)[1]
        group = groups[0]
        return dict.fromkeys(group.layer_names, group.build_metadata_for_drafting(
            common_attn_metadata=cad, draft_index=draft_index))

    @phase(DRAFT_FORWARD, DRAFT_FORWARDS)
    def _run_model(self, kwargs: dict) -> torch.Tensor:  # [num_tokens, hidden_size]
        """The draft model's forward (own method: the profile times it as draft compute)."""
        return self.model(**kwargs)

    def _decode_inputs(self, num_input_tokens: int) -> tuple[dict, dict]:
        """A decode pass's model inputs and slot mapping: buffer views every pass rewrites."""
        kwargs = {"input_ids": self.input_ids[:num_input_tokens],
                  "positions": self._get_positions(num_input_tokens), "inputs_embeds": None}
        return kwargs, self._get_slot_mapping(num_input_tokens)

    def _padding(self, num_tokens: int) -> tuple:
        """vLLM's (cudagraph mode, padded tokens, tokens across DP) for ``num_tokens``:
        cached per count without data parallelism (~0.03 ms a call), else agreed each time."""
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            return self._determine_batch_execution_and_padding(num_tokens)
        padding = self._paddings.get(num_tokens)
        if padding is None:
            padding = self._paddings[num_tokens] = (
                self._determine_batch_execution_and_padding(num_tokens))
        return padding

    def _switch_to_decode(self, cad, num_rows: int) -> None:
        """After the first pass every row has exactly one query token per pass."""
        cad.num_actual_tokens = num_rows
        cad.max_query_len = 1
        cad.query_start_loc, cad.query_start_loc_cpu = self._views(num_rows)[:2]

    def _views(self, num_rows: int) -> tuple:
        """Buffer views for ``num_rows``, made once per count: decode query starts (device,
        host), input ids, and those as numpy for host draws (None if not possible)."""
        views = self._row_views.get(num_rows)
        if views is None:
            input_ids = self.input_ids[:num_rows]
            host_ids = (input_ids.numpy() if self._host_draws
                        and self.input_ids.dtype == torch.int32 else None)
            views = self._row_views[num_rows] = (
                self.arange[: num_rows + 1], self._token_arange_cpu[: num_rows + 1],
                input_ids, host_ids)
        return views

    @phase(DRAFT_FORWARD)
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab_size]
        """The draft's LM head (own method: the profile counts it as draft compute)."""
        return self.model.compute_logits(hidden)

    @phase("draft: sample")
    def _sample_into(self, run: DraftRun, hidden: torch.Tensor,
                     temperature: torch.Tensor | None,
                     mode: tuple[bool, bool] = (False, False),
                     uniforms: torch.Tensor | np.ndarray | None = None,
                     next_ids: np.ndarray | None = None,
                     draws: HostDraws | None = None) -> bool:
        """Draw one draft token per drafting row; True if any row keeps drafting.
        ``hidden``: [num_rows, hidden_size]; ``temperature``: [num_rows] (None: all greedy);
        ``mode``: (all rows sample, all at temperature 1); ``uniforms``: [k_max, num_rows, 1];
        ``next_ids``: [num_rows] int32, also written by host draws; ``draws``: host draws."""
        logits = self._logits(hidden)  # [num_rows, vocab_size]
        if draws is not None and logits.dtype == torch.float32:
            added = run.add(*draws.draw(run.num_positions, logits))
            run.probs_block = draws.probs
            return added
        if temperature is None:
            return run.add(*greedy_draft_tokens(logits))
        all_sampled, unit = mode
        return run.add(*sample_draft_tokens(
            logits, temperature, None if all_sampled else temperature >= _SAMPLING_EPS,
            all_sampled=all_sampled, unit_temperature=unit,
            uniform=None if uniforms is None else uniforms[run.num_positions],
            next_ids=next_ids))

    def _keep_runs(self, run: DraftRun, rows: list[int], batch: StepBatch) -> list[int]:
        """Every drafting row sends its whole run; returns [num_reqs] draft tokens sent."""
        lengths = [0] * batch.num_reqs
        for r, n in zip(rows, run.length_list()):
            lengths[r] = n
        self._note_drafts(run, lengths)
        # recorded in the worker's wait (read only after _settle)
        self._defer(lambda: self._record_runs(run, rows, batch, lengths))
        return lengths

    def _record_runs(self, run: DraftRun, rows: list[int], batch: StepBatch,
                     lengths: list[int]) -> None:
        """:meth:`_keep_runs`'s drafts recorded to learn from and noted for the cursor."""
        if rows:
            self.outcomes.record([batch.req_ids[r] for r in rows], run)
        else:
            self.outcomes.forget()
        self._note_ahead(run, rows, batch, lengths)

    @staticmethod
    def _drafts(run: DraftRun, rows: list[int], lengths: list[int]) -> list[list[int]]:
        """[num_reqs] each row's draft tokens as lists (vLLM's scheduler takes lists)."""
        drafts: list[list[int]] = [[] for _ in lengths]
        for r, tokens in zip(rows, run.token_lists([lengths[r] for r in rows])):
            drafts[r] = tokens
        return drafts

    def _note_ahead(self, run: DraftRun, rows: list[int], batch: StepBatch,
                    sent: list[int]) -> None:
        """Tell the cursor how many ``sent`` tokens each row's decode passes read (not with
        the batch-expanding scorer: emitted tokens may be another candidate's)."""
        if not rows or self.plugin_runner.expander is not None:
            self.cursor.forget_pending()
            return
        passes = run.num_positions - 1  # decode passes run (the first pass excluded)
        self.cursor.drafted([batch.req_ids[r] for r in rows],
                            [min(sent[r], passes) for r in rows])

    def _note_drafts(self, run: DraftRun, lengths: list[int]) -> None:
        """What the cost model charges this step with, once it has run."""
        self.last_lengths = list(lengths)
        self._last_forwards = run.num_positions  # the first pass included
        self._last_draft_tokens = sum(lengths)

    @phase("plugin: hand back")
    def _full_rows(self, run: DraftRun, rows: list[int], num_reqs: int):
        """The run's [num_rows, positions] token ids (and [num_rows, positions, vocab] draft
        probabilities) as [num_reqs, ...] tensors, zero for rows that did not draft."""
        device = self.input_ids.device
        if not rows:
            return torch.zeros((num_reqs, 1), dtype=torch.int64, device=device), None
        drafted = run.stacked_token_ids()
        if len(rows) == num_reqs:  # every row drafted (rows ascending): nothing to scatter
            return drafted, run.stacked_draft_probs()
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        token_ids = drafted.new_zeros((num_reqs, drafted.shape[1]))
        token_ids[index] = drafted
        return token_ids, self._full_probs(run, rows, num_reqs)

    def _full_probs(self, run: DraftRun, rows: list[int], num_reqs: int):
        """The run's [num_rows, positions, vocab] draft probabilities as [num_reqs, ...],
        zero for rows that did not draft (None: the run drew none, all greedy)."""
        draft_probs = run.stacked_draft_probs() if rows else None
        if draft_probs is None or len(rows) == num_reqs:  # (rows ascending: no scatter)
            return draft_probs
        full = draft_probs.new_zeros((num_reqs, *draft_probs.shape[1:]))
        full[torch.tensor(rows, dtype=torch.int64, device=full.device)] = draft_probs
        return full

    def _verified(self, context, scheduled: list[int], num_accepted: list[int],
                  next_tokens: list[int]) -> Verified:
        """The step just verified, for the union (skip_drafting's timing was its own)."""
        self._observed = False
        return Verified(tuple(context.req_ids[:len(scheduled)]), scheduled,
                        [a + 1 for a in num_accepted], self._step_seconds,
                        context.num_query_tokens, context.scored,
                        draft_seconds=self._last_draft_seconds,
                        expected=context.expected_acceptance,
                        read_prompts=context.read_prompts, next_tokens=next_tokens)

    def catch_up_tokens(self, batch: StepBatch) -> list[int]:
        """[num_reqs] tokens each row's first pass reads beyond its newest (its draft KV's gap)."""
        return self.cursor.behind(batch.req_ids, batch.num_tokens)

    def param_ratio(self) -> float:
        """Draft / target parameters (the union prices an untimed forward with it)."""
        if self._param_ratio is None:
            target = self.plugin_runner.get_model()
            self._param_ratio = (sum(p.numel() for p in self.model.parameters())
                                 / max(1, sum(p.numel() for p in target.parameters())))
        return self._param_ratio

    def run(self, batch: StepBatch, caps: list[int], held: bool) -> DraftOutput:
        """The union's draft run: up to ``caps[r]`` tokens per row, cut by the stop rule.
        Rank 0 under TP tells it to the other ranks first (:meth:`_follow`)."""
        if self.clock.shared and self.clock.leads:
            self.told = held
            self.clock.tell([1, int(held), *caps], 2 + batch.num_reqs, "draft run")
        run, rows = self._run = self._run_draft(batch, caps)
        if held:  # every drafting row sends its whole run
            lengths = self._keep_runs(run, rows, batch)
            signals: list[list[float]] = [[] for _ in lengths]  # [num_reqs][length]
            for i, r in enumerate(rows):
                signals[r] = run.row_confidences(i, lengths[r])
            return DraftOutput(lengths, signals, run.num_positions)
        token_ids, self._run_probs = self._full_rows(run, rows, batch.num_reqs)
        lengths = np.zeros(batch.num_reqs, dtype=np.int64)
        confidences = np.zeros(token_ids.shape)
        if rows:
            lengths[rows] = run.lengths()
            confidences[rows] = run.stacked_confidences()
        token_ids = token_ids.cpu().numpy()
        candidates = [Candidate(token_ids[r, :n].astype(np.int64),
                                confidences[r, :n].astype(np.float64)) if n > 0 else None
                      for r, n in enumerate(lengths.tolist())]
        return DraftOutput(lengths.tolist(), [], run.num_positions, candidates)

    @property
    def ran_last_step(self) -> bool:
        """Whether the draft ran in the step before (its first pass is then warm)."""
        return self._steps_since_run <= 1

    @phase("plugin: hand back")
    def _union_drafts(self, batch: StepBatch, plan: StepPlan) -> list[list[int]]:
        """The union's plan as vLLM's drafts, with what the run needs noted (outcomes to
        learn, the cursor, the cost model's counts, draft probabilities)."""
        if self._run is None:  # the draft model did not run
            drafts = plan.drafts
            self.outcomes.forget()
            self.last_lengths = lengths = [len(d) for d in drafts]
            self._last_forwards, self._last_draft_tokens = 0, sum(lengths)
            # deterministic guesses only: one-hot, as for vLLM's token-level methods
            self._last_draft_probs = None
            return drafts
        run, rows = self._run
        if plan.drafts is None:  # a held step: every drafting row sent its whole run
            self._last_draft_probs = self._full_probs(run, rows, batch.num_reqs)
            return self._drafts(run, rows, self.last_lengths)
        drafts, draft_index = plan.drafts, self.union.draft_index
        draft_rows = np.array([source == draft_index for source in plan.sources], dtype=bool)
        chosen = [len(d) for d in drafts]
        if rows:
            self.outcomes.record([batch.req_ids[r] for r in rows], run,
                                 [chosen[r] if draft_rows[r] else 0 for r in rows])
        else:
            self.outcomes.forget()
        self._note_drafts(run, chosen)
        # decoy test (fault_injection.decoy_primary): greedy rows verify a decoy instead
        decoyed = self.union.decoy_primary & ~np.asarray(batch.sampled, dtype=bool)
        verified = draft_rows & ~decoyed  # [num_reqs] the rows that verify the draft's tokens
        self._note_ahead(run, rows, batch, [c if v else 0 for c, v in zip(chosen, verified)])
        self._last_draft_probs = mixed_draft_probs(self._run_probs, drafts, verified)
        return drafts

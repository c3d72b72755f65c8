"""The batch-expanding scorer inside vLLM: a request's extra candidates as extra rows of
the target's one forward pass (see docs/design.md).

vLLM verifies one draft per request. When the union offers several candidates
(:func:`specplugin.adaptive.controller.expand`), the scheduler gets the primary (never
shorter than the others: vLLM rolls back by ``scheduled - accepted``) and this module
verifies the rest in the same forward:

- **rows**: one extra row per candidate (vLLM's CPU attention has no custom mask);
- **blocks**: new positions go to private *scratch blocks* that
  :func:`reserve_scratch_blocks` keeps out of the scheduler's pool;
- **attention**: metadata rebuilt for ``T + E`` tokens; vLLM gets its own ``T`` rows back;
- **acceptance** (:meth:`BatchExpander.resolve`): longest accepted prefix (greedy) or
  recursive rejection sampling; a winning extra's scratch blocks replace the request's.

Requests whose sampling the plugin cannot reproduce exactly (:func:`acceptance_kind`) and,
at temperature > 0, draft-model candidates are never expanded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context, override_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.sampler import _SAMPLING_EPS

from specplugin.adaptive.controller import MAX_EXTRA_ROWS  # sizes the scratch pool
from specplugin.adaptive.learning import Scored
from specplugin.scorers.multi_draft import longest_accepted, one_hot_multi_draft_verify

logger = logging.getLogger("specplugin")
PLACEHOLDER_TOKEN_ID = -1  # vLLM's padding in the rejection sampler's output


def blocks_per_row(num_speculative_tokens: int, block_size: int) -> int:
    """Blocks an extra row may need: its ``1 + K`` positions span at most this many."""
    return num_speculative_tokens // block_size + 2


def num_scratch_blocks(plugin_config, block_size: int) -> int:
    """Blocks the plugin keeps out of the scheduler's pool (0 with the scorer off)."""
    if plugin_config.max_candidates < 2:
        return 0
    return MAX_EXTRA_ROWS * blocks_per_row(plugin_config.num_speculative_tokens, block_size)


GREEDY, SAMPLED = "greedy", "sampled"


def acceptance_kind(params) -> str | None:
    """``"greedy"`` (raw argmax), ``"sampled"`` (plain ``softmax(logits / temperature)``,
    unseeded), or None: vLLM's sampling would not be reproduced exactly; never expanded."""
    if params is None or not (
            params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and not params.logit_bias
            and not params.bad_words and params.allowed_token_ids is None
            and not params.min_tokens and params.logprobs is None
            and params.prompt_logprobs is None and params.structured_outputs is None
            and not getattr(params, "logits_processors", None)):
        return None
    if params.temperature < _SAMPLING_EPS:
        return GREEDY
    plain = (params.top_p == 1.0 and params.top_k in (0, -1) and params.min_p == 0.0
             and params.seed is None)
    return SAMPLED if plain else None


@dataclass(frozen=True)
class ExtraRow:
    """One extra candidate of batch row ``row``, verified as its own row."""

    row: int
    index: int  # its index among the request's extra candidates as sent
    draft_ids: tuple[int, ...]  # [k] the candidate's tokens (k <= the row's scheduled drafts)
    start: int  # offset of its first query token in the expanded batch (>= T)
    first_position: int  # position of its first query token (the request's last token)
    # per block its positions touch: (index in the request's table, scratch block, own block)
    blocks: tuple[tuple[int, int, int], ...]
    slots: torch.Tensor  # [1 + k] where this row writes its KV (scratch blocks)


@dataclass
class ScorerStats:
    """Counters of the scorer (``stats()["scorer"]``)."""

    steps: int = 0  # steps that verified extra rows
    extra_rows: int = 0
    extra_tokens: int = 0  # query tokens of the extra rows
    wins: int = 0  # extra candidates that beat the primary
    won_tokens: int = 0  # accepted tokens the winners added over the primary
    copied_blocks: int = 0  # copy-on-write copies of a partly filled last block
    aligned_starts: int = 0  # extra rows whose context ended exactly on a block boundary
    # highest block id the scheduler handed out; scratch ids among them (must stay 0)
    max_scheduled_block: int = 0
    scheduled_scratch_blocks: int = 0
    skipped: Counter = dataclasses.field(default_factory=Counter)  # reason -> rows

    def as_dict(self) -> dict:  # JSON-able
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "skipped"}, "skipped": dict(self.skipped)}


class BatchExpander:
    """Keeps a step's extra candidates, runs them in the next forward and resolves them
    after vLLM's sampler. One per model runner."""

    def __init__(self, runner, plugin_config):
        kv_config = runner.kv_cache_config
        groups = kv_config.kv_cache_groups
        self.block_size = groups[0].kv_cache_spec.block_size
        self.num_scratch = num_scratch_blocks(plugin_config, self.block_size)
        self.first_scratch = kv_config.num_blocks - self.num_scratch
        self.per_row = blocks_per_row(plugin_config.num_speculative_tokens, self.block_size)
        draft_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
        self._layers = runner.compilation_config.static_forward_context
        # target layers only: the draft model's cache is written by its own forward
        self._layer_names = [name for g in groups for name in g.layer_names
                             if name not in draft_layers]
        backends = {g.backend.get_name() for g in runner.attn_groups[0]} if groups else set()
        self.usable = (len(groups) == 1 and backends == {"CPU_ATTN"} and self.num_scratch > 0
                       and self.first_scratch > 0)
        if not self.usable:
            # needs CPU_ATTN's [num_blocks, ...] layout (a block is cache[b])
            logger.warning("specplugin: max_candidates > 1 needs one KV cache group on the "
                           "CPU attention backend; here %d group(s), backends %s: each request "
                           "verifies one candidate.", len(groups), sorted(backends))
        self.pending: dict[str, list[tuple[int, ...]]] = {}  # req_id -> extra candidates
        # req_id -> how its candidates fared in the step just verified
        self.outcomes: dict[str, Scored] = {}
        self.stats = ScorerStats()
        self._rows: list[ExtraRow] = []
        self._hidden: torch.Tensor | None = None  # [E, hidden_size] of the last forward
        self._sampled: dict[int, float] = {}  # sampled rows of the last forward -> temperature
        self._target_logits: dict[int, torch.Tensor] = {}  # row -> [1 + K, vocab_size]
        self._zeroed = False

    def check_scheduled_blocks(self, scheduler_output) -> None:
        """Count any scratch block id in the scheduler's output (there must be none)."""
        groups = [r.block_ids for r in scheduler_output.scheduled_new_reqs]
        groups += [g for g in scheduler_output.scheduled_cached_reqs.new_block_ids if g]
        ids = [b for group in groups for blocks in group for b in blocks]
        if ids:
            self.stats.max_scheduled_block = max(self.stats.max_scheduled_block, max(ids))
            self.stats.scheduled_scratch_blocks += sum(b >= self.first_scratch for b in ids)

    def describe(self) -> dict:
        """Where the scratch pool sits (for tests and logs)."""
        return {"first_scratch_block": self.first_scratch, "num_scratch_blocks": self.num_scratch,
                "block_size": self.block_size}

    # -- drafting side ------------------------------------------------------------------
    def remember(self, req_ids, alternates) -> None:
        """Extra candidates of the drafts just proposed (``alternates[row]``: token lists)."""
        self.pending = {req_ids[r]: [tuple(int(t) for t in c) for c in cands]
                        for r, cands in enumerate(alternates) if cands}

    def forget(self) -> None:
        self.pending = {}

    # -- forward ------------------------------------------------------------------------
    def forward(self, runner, forward, input_ids, positions, **kwargs):
        """Run ``forward`` over the batch plus extra rows; return the batch's own hidden
        states ``[T, hidden_size]``."""
        self._rows, self._hidden, self._sampled, self.outcomes = [], None, {}, {}
        pending, self.pending = self.pending, {}
        if not pending or not self.usable or positions is None or positions.dim() != 1:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        context = get_forward_context()
        plan = self._plan(runner, pending, context, input_ids, positions)
        if plan is None:
            return forward(input_ids=input_ids, positions=positions, **kwargs)
        rows, extra_ids, extra_positions, expanded = plan
        num_tokens = input_ids.shape[0]
        with override_forward_context(expanded):
            output = forward(input_ids=torch.cat([input_ids, extra_ids]),
                             positions=torch.cat([positions, extra_positions]), **kwargs)
        if not isinstance(output, torch.Tensor):  # e.g. auxiliary hidden states
            raise RuntimeError("specplugin's scorer expects the target to return one tensor")
        self._rows, self._hidden = rows, output[num_tokens:]
        self.stats.steps += 1
        self.stats.extra_rows += len(rows)
        self.stats.extra_tokens += sum(1 + len(r.draft_ids) for r in rows)
        return output[:num_tokens]

    def _plan(self, runner, pending, context, input_ids, positions):
        metadata = context.attn_metadata
        if not isinstance(metadata, dict) or not metadata:
            self.stats.skipped["no attention metadata"] += len(pending)
            return None
        meta = next(iter(metadata.values()))
        num_tokens = input_ids.shape[0]
        if meta.num_actual_tokens != num_tokens:  # padded batch: skip
            self.stats.skipped["padded batch"] += len(pending)
            return None
        self._zero_scratch_once()
        scheduled = runner.step_scheduler_output.scheduled_spec_decode_tokens
        query_start = meta.query_start_loc.tolist()  # [num_reqs + 1]
        index_of = runner.input_batch.req_id_to_index
        rows: list[ExtraRow] = []
        tables: list[torch.Tensor] = []
        next_block, start_of_row = self.first_scratch, num_tokens
        for row, req_id in sorted((index_of[r], r) for r in pending if r in index_of):
            for index, cand in enumerate(pending[req_id]):
                k = min(len(cand), len(scheduled.get(req_id, ())))
                if k == 0 or len(rows) == MAX_EXTRA_ROWS:
                    continue
                params = runner.requests[req_id].sampling_params
                kind = acceptance_kind(params)
                if kind is None:
                    self.stats.skipped["sampling not reproduced"] += 1
                    continue
                start, first = query_start[row], int(positions[query_start[row]])
                own_table = meta.block_table[row]
                own = meta.slot_mapping[start:start + 1 + k]
                if not torch.equal(self._slots(own_table, first, k), own):
                    self.stats.skipped["block table not understood"] += 1
                    continue
                if kind == SAMPLED:
                    self._sampled[row] = params.temperature
                table, blocks = self._row_table(own_table, first, k, next_block)
                next_block += len(blocks)
                rows.append(ExtraRow(row, index, cand[:k], start_of_row, first, blocks,
                                     self._slots(table, first, k)))
                start_of_row += 1 + k
                tables.append(table)
        if not rows:
            return None
        extra_ids = torch.cat([torch.tensor((int(input_ids[query_start[r.row]]),) + r.draft_ids,
                                            dtype=input_ids.dtype) for r in rows])
        extra_positions = torch.cat([positions[query_start[r.row]] + torch.arange(
            1 + len(r.draft_ids), dtype=positions.dtype) for r in rows])
        expanded = self._expanded_context(runner, context, rows, tables, extra_positions)
        return rows, extra_ids.to(input_ids.device), extra_positions.to(positions.device), expanded

    def _row_table(self, own_table: torch.Tensor, first_position: int, k: int,
                   next_block: int) -> tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]:
        """The request's block table with the blocks of positions ``first_position ..
        first_position + k`` replaced by scratch blocks (the first copied if partly filled)."""
        table = own_table.clone()  # [max_num_blocks_per_req]
        first, last = first_position // self.block_size, (first_position + k) // self.block_size
        blocks = tuple((b, next_block + i, int(own_table[b]))
                       for i, b in enumerate(range(first, last + 1)))
        for b, scratch, _ in blocks:
            table[b] = scratch
        if first_position % self.block_size:
            self._copy_block(int(own_table[first]), next_block)
            self.stats.copied_blocks += 1
        else:
            self.stats.aligned_starts += 1
        return table, blocks

    def _slots(self, table: torch.Tensor, first_position, k: int) -> torch.Tensor:  # [1 + k]
        pos = int(first_position) + torch.arange(1 + k)
        return (table[pos // self.block_size].long() * self.block_size
                + pos % self.block_size).to(torch.int64)

    def _expanded_context(self, runner, context, rows, tables, extra_positions):
        """The expanded batch's forward context (per-group metadata, extended slot mappings)."""
        extra_slots = torch.cat([r.slots for r in rows])
        by_group = {}
        for group in runner.attn_groups[0]:
            original = context.attn_metadata[group.layer_names[0]]
            common = self._common_metadata(original, rows, tables, extra_positions, extra_slots)
            built = group.get_metadata_builder().build(0, common)
            by_group.update({name: built for name in group.layer_names})
        metadata = {name: by_group.get(name, meta) for name, meta in context.attn_metadata.items()}
        slot_mapping = {name: torch.cat([s, extra_slots.to(s.dtype)])
                        for name, s in context.slot_mapping.items()}
        is_padding = context.is_padding
        if is_padding is not None:
            is_padding = torch.cat([is_padding, is_padding.new_zeros(len(extra_slots))])
        return dataclasses.replace(context, attn_metadata=metadata, slot_mapping=slot_mapping,
                                   is_padding=is_padding)

    def _common_metadata(self, meta, rows, tables, extra_positions, extra_slots):
        lengths = torch.tensor([1 + len(r.draft_ids) for r in rows], dtype=torch.int32)
        query_start = torch.cat([meta.query_start_loc,
                                 meta.query_start_loc[-1] + torch.cumsum(lengths, 0).to(
                                     meta.query_start_loc.dtype)])
        first = extra_positions[torch.cumsum(lengths, 0) - lengths]
        seq_lens = torch.cat([meta.seq_lens, (first + lengths).to(meta.seq_lens.dtype)])
        block_table = torch.cat([meta.block_table, torch.stack(tables).to(meta.block_table.dtype)])
        slot_mapping = torch.cat([meta.slot_mapping, extra_slots.to(meta.slot_mapping.dtype)])
        return CommonAttentionMetadata(
            query_start_loc=query_start, query_start_loc_cpu=query_start.cpu(),
            seq_lens=seq_lens, num_reqs=len(seq_lens),
            num_actual_tokens=int(query_start[-1]),
            max_query_len=max(meta.max_query_len, int(lengths.max())),
            max_seq_len=int(seq_lens.max()), block_table_tensor=block_table,
            slot_mapping=slot_mapping, causal=True)

    # -- acceptance ---------------------------------------------------------------------
    def keep_target_logits(self, logits: torch.Tensor, spec_decode_metadata) -> None:
        """Before vLLM's sampler (which may scale logits in place): copy the sampled rows'
        target logits. ``logits``: [num_logits, vocab_size]."""
        self._target_logits = {}
        if not self._sampled or spec_decode_metadata is None:
            return
        ends = spec_decode_metadata.cu_num_sampled_tokens.tolist()  # [num_reqs]
        for row in self._sampled:
            size = spec_decode_metadata.num_draft_tokens[row] + 1
            self._target_logits[row] = logits[ends[row] - size: ends[row]].clone()

    def resolve(self, runner, sampler_output) -> None:
        """After vLLM's rejection sampler: apply multi-draft acceptance to rows with extras;
        a winning extra's tokens replace the row's and its KV the request's."""
        rows, hidden, sampled_rows = self._rows, self._hidden, self._sampled
        target_logits, self._target_logits = self._target_logits, {}
        self._rows, self._hidden, self._sampled = [], None, {}
        if not rows:
            return
        logits = runner.model.compute_logits(hidden)  # [E, vocab_size]
        offset = rows[0].start
        by_row: dict[int, list[tuple[ExtraRow, torch.Tensor]]] = {}
        for r in rows:
            span = logits[r.start - offset: r.start - offset + 1 + len(r.draft_ids)]
            by_row.setdefault(r.row, []).append((r, span))  # span: [1 + k, vocab_size]
        sampled = sampler_output.sampled_token_ids  # [num_reqs, max_spec_len + 1] int32
        for row, extras in by_row.items():
            if row in sampled_rows:
                tokens, winner, outcome = self._sample_row(
                    runner, row, extras, target_logits.get(row), sampled_rows[row])
            else:
                tokens, winner, outcome = self._greedy_row(sampled[row], extras)
            if outcome is not None:
                self.outcomes[runner.input_batch.req_ids[row]] = outcome
            if tokens is None:
                continue
            sampled[row] = PLACEHOLDER_TOKEN_ID
            sampled[row, :len(tokens)] = torch.tensor(tokens, dtype=sampled.dtype)
            if winner is not None:
                self.stats.wins += 1
                self._keep_winner(winner, len(tokens) - 1)

    def _greedy_row(self, own_output: torch.Tensor, extras):
        """(tokens, winner, outcome); tokens None when the row's own output stands (it wins
        ties, then the lower index)."""
        own = best = int((own_output != PLACEHOLDER_TOKEN_ID).sum()) - 1  # accepted by vLLM
        choice, accepted_by_index = None, {}
        for r, span in extras:
            target = span.argmax(-1).cpu()  # [1 + k]
            accepted = longest_accepted(torch.tensor(r.draft_ids), target)
            accepted_by_index[r.index] = (accepted, len(r.draft_ids))
            if accepted > best:
                best, choice = accepted, (r, target)
        outcome = _outcome(own, accepted_by_index, None if choice is None else choice[0].index)
        if choice is None:
            return None, None, outcome
        r, target = choice
        self.stats.won_tokens += best - own
        return list(r.draft_ids[:best]) + [int(target[best])], r, outcome

    def _sample_row(self, runner, row: int, extras, own_logits, temperature: float):
        """Recursive rejection sampling over own draft + extras, replacing vLLM's draw."""
        if own_logits is None:
            return None, None, None
        req_id = runner.input_batch.req_ids[row]
        own_ids = torch.tensor(runner.step_scheduler_output.scheduled_spec_decode_tokens[req_id])
        probs = [torch.softmax(own_logits.float() / temperature, -1)]
        probs += [torch.softmax(span.float() / temperature, -1) for _, span in extras]
        result = one_hot_multi_draft_verify(
            [own_ids] + [torch.tensor(r.draft_ids) for r, _ in extras], probs)
        winner = None if result.winner == 0 else extras[result.winner - 1][0]
        accepted = len(result.token_ids) - 1
        # only the winner's acceptance is known
        outcome = _outcome(accepted if winner is None else None,
                           {} if winner is None else {winner.index: (accepted, len(winner.draft_ids))},
                           None if winner is None else winner.index)
        return result.token_ids.tolist(), winner, outcome

    def _keep_winner(self, r: ExtraRow, accepted: int) -> None:
        """Copy the scratch blocks holding the winner's accepted positions over the request's
        (later positions are stale in both and rewritten before they are read)."""
        last = (r.first_position + accepted) // self.block_size
        for b, scratch, own in r.blocks:
            if b <= last:
                self._copy_block(scratch, own)

    # -- KV blocks ----------------------------------------------------------------------
    def kv_caches(self) -> list[torch.Tensor]:  # per target layer: [num_blocks, ...]
        """Read from the layers each time: vLLM binds them after profiling."""
        return [self._layers[name].kv_cache for name in self._layer_names]

    def _zero_scratch_once(self) -> None:
        if not self._zeroed:  # vLLM never touches them
            for cache in self.kv_caches():
                cache[self.first_scratch:].zero_()
            self._zeroed = True

    def _copy_block(self, src: int, dst: int) -> None:
        """Whole blocks: a block's interior layout is backend-specific."""
        for cache in self.kv_caches():  # [num_blocks, ...]
            cache[dst].copy_(cache[src])


def _outcome(own: int | None, accepted_by_index: dict[int, tuple[int, int]],
             winner: int | None) -> Scored:
    """The drafter's record of one request's candidates (extras by their sent index)."""
    size = 1 + max(accepted_by_index, default=-1)
    accepted = tuple(accepted_by_index.get(i, (None, 0))[0] for i in range(size))
    lengths = tuple(accepted_by_index.get(i, (None, 0))[1] for i in range(size))
    return Scored(own, accepted, lengths, winner)


def reserve_scratch_blocks(initialize_kv_caches, engine_core, vllm_config):
    """Around ``EngineCore._initialize_kv_caches``: with the scorer on, the scheduler gets
    ids ``[0, n - S)``; ``[n - S, n)`` are the scorer's scratch blocks."""
    from vllm.v1.engine import core

    from specplugin.vllm_layer import patches
    from specplugin.vllm_layer.config_hook import plugin_config, selects_plugin

    if not selects_plugin(vllm_config):
        return initialize_kv_caches(engine_core, vllm_config)
    config = plugin_config(vllm_config)
    if config.max_candidates < 2:
        return initialize_kv_caches(engine_core, vllm_config)
    original = core.generate_scheduler_kv_cache_config

    def scheduler_config(kv_cache_configs):
        cfg = original(kv_cache_configs)
        block_size = cfg.kv_cache_groups[0].kv_cache_spec.block_size
        scratch = num_scratch_blocks(config, block_size)
        if cfg.num_blocks <= 2 * scratch:
            raise ValueError(
                f"specplugin: max_candidates = {config.max_candidates} reserves {scratch} KV "
                f"blocks for extra candidates, but the KV cache has only {cfg.num_blocks}; "
                "give vLLM more KV cache (VLLM_CPU_KVCACHE_SPACE, or "
                "gpu_memory_utilization) or set max_candidates to 1.")
        logger.info("specplugin: %d of %d KV blocks reserved for the batch-expanding scorer",
                    scratch, cfg.num_blocks)
        cfg.num_blocks -= scratch
        return cfg

    with patches.swapped(core, "generate_scheduler_kv_cache_config", scheduler_config):
        return initialize_kv_caches(engine_core, vllm_config)

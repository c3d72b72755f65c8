"""What the draft model's run reads: the step's batch as the proposers see it and each row's
draft cap; on CPU, attention metadata built without vLLM's chain of builder calls; the
positions, slots and buffers of every decode pass computed at once for a run
(:func:`decode_passes`), kept from run to run. See docs/design.md."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.llm_base_proposer import PADDING_SLOT_ID

from specplugin import host_kernels
from specplugin.profiling import phase
from specplugin.proposers.base import StepBatch


def cpu_metadata_builder(groups):
    """The draft's one attention group's builder if it is vLLM's CPU builder for decoder
    layers over the group's own block table; else None (vLLM builds each pass's metadata)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
    except ImportError:  # (a build without the CPU backend)
        return None
    if len(groups) != 1 or getattr(groups[0], "kernel_block_size", None) is not None:
        return None
    builder = groups[0].get_metadata_builder()
    if (type(builder) is not CPUAttentionMetadataBuilder or builder.is_cross_attention
            or builder.is_encoder_only_attention):
        return None
    return builder


def cpu_attn_metadata(builder, cad):
    """What vLLM's ``CPUAttentionMetadataBuilder.build`` returns for ``cad`` (causal,
    decoder layers), without vLLM's chain of drafting-build calls that reaches it."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata
    return CPUAttentionMetadata(
        num_actual_tokens=cad.num_actual_tokens, max_query_len=cad.max_query_len,
        query_start_loc=cad.query_start_loc, max_seq_len=cad.max_seq_len,
        seq_lens=cad.seq_lens, block_table=cad.block_table_tensor,
        slot_mapping=cad.slot_mapping, causal=True,
        scheduler_metadata=_scheduler_metadata(builder, cad, cad.query_start_loc, True, None))


def update_cpu_decode_metadata(builder, per_layer: dict, cad) -> None:
    """Update the previous pass's CPU attention metadata in place (vLLM's CPU builder lacks
    ``update_draft_decode_metadata``): only seq lens, slots and scheduler metadata change."""
    metadata = next(iter(per_layer.values()))
    metadata.seq_lens = cad.seq_lens
    metadata.slot_mapping = cad.slot_mapping
    metadata.max_seq_len = cad.max_seq_len
    metadata.scheduler_metadata = _scheduler_metadata(
        builder, cad, metadata.query_start_loc, metadata.causal, metadata.dynamic_causal)


def _scheduler_metadata(builder, cad, query_start_loc: torch.Tensor, causal: bool,
                        dynamic_causal) -> torch.Tensor:
    """vLLM's CPU attention scheduler metadata: the C++ op called positionally with cached
    constants (:func:`_scheduler_call`), about half the cost of vLLM's wrapper."""
    op, heads, rest = _scheduler_call(builder)
    return op(cad.num_reqs, *heads, cad.seq_lens, builder.dtype, query_start_loc, causal,
              *rest, dynamic_causal, builder.kv_cache_dtype)


@functools.cache
def _scheduler_call(builder) -> tuple:
    """(the op, (query heads, KV heads, head size), (window, ISA, KV split)) for
    :func:`_scheduler_metadata`, in the op's argument order."""
    import vllm.envs as envs
    return (torch.ops._C.get_scheduler_metadata.default,
            (builder.num_heads, builder.num_kv_heads, builder.head_dim),
            (builder.window_size, builder.isa, envs.VLLM_CPU_ATTN_SPLIT_KV))


@dataclasses.dataclass(frozen=True)
class DecodePasses:
    """A run's decode-pass inputs, one row per pass, as vLLM's per-pass update leaves them,
    computed once per run (:func:`decode_passes`; a call per pass cost ~0.08 ms).
    ``views``: each pass's views made once (host buffers), else None (sliced per pass)."""

    positions: torch.Tensor  # [num_passes, num_padded] int64
    slots: torch.Tensor  # [num_passes, num_padded] int64; padding columns: padding slot
    seq_lens: torch.Tensor  # [num_passes, num_rows] int32
    seq_lens_cpu: torch.Tensor  # [num_passes, num_rows] int32
    max_model_len: int
    views: list[PassViews] | None = None

    @phase("draft: metadata")
    def set_pass(self, index: int, cad, input_ids: torch.Tensor,
                 layer_names) -> tuple[dict, dict]:
        """Set pass ``index`` (0: the first decode pass) into ``cad``; returns its model
        inputs (``input_ids``: the [num_padded] buffer the loop writes) and slot mapping."""
        views = (self.views[index] if self.views is not None
                 else PassViews.of(self, index, layer_names))
        cad.slot_mapping = views.slots
        cad.seq_lens = views.seq_lens
        cad.seq_lens_cpu_upper_bound = views.seq_lens_cpu
        cad.max_seq_len = min(cad.max_seq_len + 1, self.max_model_len)
        return ({"input_ids": input_ids, "positions": views.positions,
                 "inputs_embeds": None}, views.slot_mapping)


@dataclasses.dataclass(frozen=True)
class PassViews:
    """One decode pass's rows of :class:`DecodePasses`, and its slot mapping per layer."""

    positions: torch.Tensor  # [num_padded]
    slots: torch.Tensor  # [num_rows]
    seq_lens: torch.Tensor  # [num_rows]
    seq_lens_cpu: torch.Tensor  # [num_rows]
    slot_mapping: dict

    @classmethod
    def of(cls, passes: DecodePasses, index: int, layer_names) -> PassViews:
        num_rows = passes.seq_lens.shape[1]
        slots = passes.slots[index]  # [num_padded]
        return cls(passes.positions[index],
                   slots if slots.shape[0] == num_rows else slots[:num_rows],
                   passes.seq_lens[index], passes.seq_lens_cpu[index],
                   dict.fromkeys(layer_names, slots))


class DecodePassBuffers:
    """Host tensors for :func:`decode_passes` and their views, kept per (passes, rows, padded)."""

    def __init__(self, layer_names):
        self.layer_names = layer_names
        # (passes, rows, padded) -> (the DecodePasses, [2, passes, padded] int64 numpy,
        # [passes, rows] int32 numpy)
        self._kept: dict[tuple[int, int, int], tuple] = {}

    def get(self, num_passes: int, num_rows: int, num_padded: int,
            max_model_len: int) -> tuple:
        key = (num_passes, num_rows, num_padded)
        kept = self._kept.get(key)
        if kept is None:
            both = _row_aligned((2, num_passes, num_padded))
            seq_lens = torch.empty((num_passes, num_rows), dtype=torch.int32)
            passes = DecodePasses(both[0], both[1], seq_lens, seq_lens, max_model_len)
            views = [PassViews.of(passes, j, self.layer_names) for j in range(num_passes)]
            kept = self._kept[key] = (dataclasses.replace(passes, views=views),
                                      both.numpy(), seq_lens.numpy())
        return kept


@phase("draft: inputs")
def decode_passes(block_table: torch.Tensor,  # [num_rows, max_blocks] the rows' own tables
                  ends: np.ndarray,  # [num_rows] context length, the newest token included
                  num_passes: int, block_size: int, max_model_len: int,
                  num_padded: int | None = None,
                  buffers: DecodePassBuffers | None = None) -> DecodePasses:
    """What vLLM's ``eagle_step_update_slot_mapping_and_metadata`` gives for passes
    1..``num_passes``: pass j reads ``ends - 1 + j``, or past ``max_model_len`` position 0
    into the padding slot (sequence of 1). Dummy rows up to ``num_padded`` write the
    padding slot, never real draft KV. ``buffers``: kept host tensors."""
    # positions and slots in one int64 [2, num_passes, num_padded], one compiled pass
    num_padded = num_padded or ends.size
    ends = ends.astype(np.int64, copy=False)
    if buffers is not None:
        passes, both, seq_lens = buffers.get(num_passes, ends.size, num_padded, max_model_len)
        host_kernels.decode_pass_inputs(host_view(block_table), ends, block_size, max_model_len,
                                        PADDING_SLOT_ID, both, seq_lens)
        return passes
    both = _row_aligned((2, num_passes, num_padded))
    seq_lens = np.empty((num_passes, ends.size), dtype=np.int32)
    host_kernels.decode_pass_inputs(host_view(block_table), ends, block_size, max_model_len,
                                    PADDING_SLOT_ID, both.numpy(), seq_lens)
    seq_lens_cpu = torch.from_numpy(seq_lens)
    device = block_table.device
    if device.type == "cpu":  # (no copy, nor a call that would return the same tensors)
        device_seq_lens = seq_lens_cpu
    else:
        both, device_seq_lens = both.to(device), seq_lens_cpu.to(device)
    return DecodePasses(both[0], both[1], device_seq_lens, seq_lens_cpu, max_model_len)


def _row_aligned(shape: tuple[int, int, int]) -> torch.Tensor:  # int64
    """An int64 tensor of ``shape`` whose rows start on 64 bytes (stride rounded up to 8),
    like the proposer's buffers: each row is a compiled model's input."""
    *outer, num_padded = shape
    return torch.empty((*outer, -(-num_padded // 8) * 8), dtype=torch.int64)[..., :num_padded]


# first-pass views are cached per token count up to this (long prompt reads are one-off)
KEPT_FIRST_VIEWS = 256


@dataclasses.dataclass(frozen=True)
class FirstPassBuffers:
    """Where ``host_kernels.first_pass_inputs`` writes a first pass's inputs when the
    proposer's buffers are host memory of its types (CPU, 1-D positions, int32 ids): numpy
    views of them, plus host tensors for query starts and seq lens."""

    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    # (cu_query_lens, seq_lens, positions [max_positions] int64, input_ids
    # [max_num_tokens] int32, slots [max_positions] int64), numpy
    host: tuple
    _views: dict = dataclasses.field(default_factory=dict)  # rows -> row_views

    def row_views(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_rows + 1] query starts and [num_rows] seq lens, views made once per count."""
        views = self._views.get(num_rows)
        if views is None:
            views = self._views[num_rows] = (self.query_start_loc[:num_rows + 1],
                                             self.seq_lens[:num_rows])
        return views

    @classmethod
    def of(cls, proposer, vllm_config) -> FirstPassBuffers | None:
        """The proposer's buffers for the kernel; None if not host memory of its types."""
        buffers = (proposer.input_ids, getattr(proposer, "positions", None),
                   proposer._slot_mapping_buffer)
        types = (torch.int32, torch.int64, torch.int64)
        if (not proposer._one_dim_positions
                or any(b is None or b.device.type != "cpu" or b.dtype != t or b.dim() != 1
                       for b, t in zip(buffers, types))):
            return None
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
        seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)
        input_ids, positions, slots = (b.numpy() for b in buffers)
        return cls(query_start_loc, seq_lens,
                   (query_start_loc.numpy(), seq_lens.numpy(), positions, input_ids, slots))

    @staticmethod
    def host_arrays(num_padded: int, num_rows: int) -> tuple:
        """Host arrays of :attr:`host`'s kinds for one pass (``_copy_first_pass``). Ids and
        positions start at 0: padding tokens' are copied too, and garbage would index the
        embedding or rotary table out of range."""
        return (np.empty(num_rows + 1, dtype=np.int32), np.empty(num_rows, dtype=np.int32),
                np.zeros(num_padded, dtype=np.int64), np.zeros(num_padded, dtype=np.int32),
                np.empty(num_padded, dtype=np.int64))


def host_view(table: torch.Tensor) -> np.ndarray:
    """A block table on the host: a view on CPU, else a copy (the step has synced already)."""
    return table.numpy() if table.device.type == "cpu" else table.cpu().numpy()


@phase("plugin: context")
def step_batch(input_batch, context, sampled: list[bool], caps: list[int],
                num_accepted: list[int], next_tokens: list[int]) -> StepBatch:
    """The batch as token-level proposers see it (tokens, accepted drafts, sampled token):
    a view of the runner's token buffer, each drafting row's sampled token written where
    vLLM writes it later. A row with no room left drafts nothing (``caps`` set to 0)."""
    num_reqs = len(caps)
    known = [n + a for n, a in zip(input_batch.num_tokens_no_spec[:num_reqs].tolist(),
                                   num_accepted)]  # [num_reqs]
    buffer = input_batch.token_ids_cpu  # [max_num_reqs, max_model_len]
    for r, n in enumerate(known):
        if n >= buffer.shape[1]:  # at max_model_len: no room for its token, nor drafts
            caps[r] = 0
    rows = tuple(r for r, c in enumerate(caps) if c > 0)
    for r in rows:
        buffer[r, known[r]] = next_tokens[r]
    room = buffer.shape[1]  # max_model_len
    remaining = [min(left, room - n - 1) for left, n in zip(context.remaining_tokens, known)]
    return StepBatch(tuple(context.req_ids[:num_reqs]), buffer,
                     np.array([n + 1 for n in known], dtype=np.int64),
                     context.num_prompt_tokens[:num_reqs],
                     np.array(caps, dtype=np.int64), np.array(sampled, dtype=bool), rows,
                     context.allowed, remaining)


def num_accepted_drafts(scheduled: list[int], rejected: list[int] | None) -> list[int]:
    """[num_reqs] draft tokens each row had accepted in the step just verified, from the
    [num_reqs] drafts it verified (vLLM passes no rejection counts when no row had drafts)."""
    if rejected is None:
        return scheduled
    return [s - r if s > r else 0 for s, r in zip(scheduled, rejected)]


def sampled_rows(input_batch, num_reqs: int) -> np.ndarray:  # [num_reqs] bool
    """Which rows sample (temperature >= ``_SAMPLING_EPS``), from the batch's host copy of
    the temperatures (greedy rows hold 0): one reading for every drafter and the peek."""
    return input_batch.temperature_cpu[:num_reqs] >= _SAMPLING_EPS


def draft_caps(remaining_tokens: list[int], max_k, prefilling: list[bool]) -> list[int]:
    """[num_reqs] useful draft tokens per row: at most ``max_k``, 0 in chunked prefill, at
    most n - 1 when n tokens may still be emitted (the last comes as the bonus). As
    ``remaining_tokens`` excludes this step's token(s), ``remaining - 2`` cuts nothing useful."""
    return [0 if p else min(max(r - 2, 0), k)
            for r, k, p in zip(remaining_tokens, max_k, prefilling)]


@phase("plugin: hand back")
def mixed_draft_probs(draft_probs: torch.Tensor | None, drafts,
                      draft_rows: np.ndarray) -> torch.Tensor | None:
    """[num_reqs, k_out, vocab] probabilities of the rows' chosen ``drafts`` when sampling
    (None: greedy): ``draft_probs`` [num_reqs, positions, vocab] for ``draft_rows``, one-hot
    for the other rows' deterministic guesses."""
    num_reqs, k_out = len(drafts), max(1, max(len(d) for d in drafts))
    probs = None
    guessed = [bool(d) and not draft_rows[r] for r, d in enumerate(drafts)]
    if draft_probs is not None and not any(guessed):
        # vLLM reads only each row's first len(draft) positions: usable as they are
        probs = draft_probs
    elif draft_probs is not None:
        probs = torch.zeros((num_reqs, k_out, draft_probs.shape[-1]),
                            dtype=draft_probs.dtype, device=draft_probs.device)
        lengths = np.array([len(d) for d in drafts], dtype=np.int64)  # [num_reqs]
        for r in np.flatnonzero(draft_rows & (lengths > 0)).tolist():
            probs[r, :lengths[r]] = draft_probs[r, :lengths[r]]
        # deterministic guesses: one-hot draft probabilities, all at once
        guess = (~draft_rows & (lengths > 0))[:, None] & (
            np.arange(k_out)[None, :] < lengths[:, None])  # [num_reqs, k_out]
        if guess.any():
            rows, positions = np.nonzero(guess)
            tokens = [drafts[r][j] for r, j in zip(rows.tolist(), positions.tolist())]
            r, j, t = (torch.as_tensor(a, dtype=torch.int64, device=probs.device)
                       for a in (rows, positions, tokens))
            probs[r, j, t] = 1.0
    return probs

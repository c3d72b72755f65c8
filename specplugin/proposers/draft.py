"""Draft-model proposer: the parts that need no vLLM.

The vLLM layer (``vllm_layer/draft_proposer.py``) runs the draft on the paged KV cache.
Here: the per-request draft KV cursor, drawing draft tokens and their confidence, and
the candidates handed to the union. Draft length policy: :mod:`specplugin.adaptive.draft_rule`.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from specplugin import host_kernels
from specplugin.profiling import phase
from specplugin.proposers.base import Candidate, StepBatch
from specplugin.requests import Requests


class DraftKVCursor:
    """How far each request's draft KV is written (its record's ``draft_kv_end``), so the
    draft runs only for rows that use it. A skipped row's next first pass re-reads
    ``[draft_kv_end, num_tokens)``; a preempted one is reset (:meth:`forget`)."""

    def __init__(self, requests: Requests | None = None):
        self.requests = requests if requests is not None else Requests()
        # req id -> positions past its written end already written by the last run (drafted)
        self._ahead: dict[str, int] = {}

    def _end(self, req_id: str) -> int:
        state = self.requests.get(req_id)
        return 0 if state is None else state.draft_kv_end

    def starts(self, req_ids: Sequence[str],  # [n] the rows that will draft
               num_tokens: Sequence[int],  # [n] context length, newest token included
               budget: int) -> list[int]:  # [n] first position to read; -1: not this step
        """Rows whose re-read would overflow ``budget`` tokens in all wait for a later step.
        (A plain loop: after the target's forward each numpy call costs microseconds.)"""
        starts, total = [], 0
        for req_id, n in zip(req_ids, num_tokens):
            start = self._end(req_id)
            if start >= n:  # a context that shrank: re-read all
                start = 0
            total += n - start
            starts.append(start if total <= budget else -1)
        return starts

    def behind(self, req_ids: Sequence[str],  # [n]
               num_tokens: np.ndarray) -> list[int]:  # [n] context length, newest included
        """Tokens each row's first pass would read beyond its newest one (the catch-up cost)."""
        return [n - 1 - (w if w < n else 0)
                for w, n in zip(map(self._end, req_ids), num_tokens.tolist())]

    def advance(self, req_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        requests = self.requests
        for req_id, n in zip(req_ids, num_tokens):
            requests[req_id].draft_kv_end = n

    def drafted(self, req_ids: Sequence[str],  # [n] the rows the run drafted for
                ahead: Sequence[int]) -> None:  # [n] see below
        """After a run: decode pass ``j`` already wrote draft KV for draft token ``j``.
        ``ahead[i]``: ``min(tokens sent, passes run)`` for row i (0 if it verifies another
        proposer's tokens). Replaces the last run's."""
        self._ahead = {r: a for r, a in zip(req_ids, ahead) if a > 0}

    def accepted(self, req_ids: Sequence[str],  # [num_reqs]
                 num_accepted: Sequence[int]) -> None:  # [num_reqs] of the step just verified
        """Advance past accepted drafts whose draft KV a decode pass already wrote. Call once
        per verified step, before :meth:`starts` or :meth:`behind`."""
        ahead, self._ahead = self._ahead, {}
        if not ahead:
            return
        requests = self.requests
        for req_id, a in zip(req_ids, num_accepted):
            n = ahead.get(req_id, 0)
            state = requests.get(req_id) if n and a > 0 else None
            if state is not None and state.draft_kv_end > 0:
                state.draft_kv_end += min(a, n)

    def forget_pending(self) -> None:
        """The last run's drafts will not be verified (the step failed or was skipped)."""
        self._ahead = {}

    def forget(self, req_ids: Iterable[str]) -> None:
        """Their draft KV is gone (preempted): the next run re-reads their context."""
        req_ids = list(req_ids)
        self.requests.restart(req_ids)
        for req_id in req_ids:
            self._ahead.pop(req_id, None)


@phase("draft: draw")
def sample_draft_tokens(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    temperature: torch.Tensor,  # [num_reqs]
    sampled: torch.Tensor | None,  # [num_reqs] bool: the request samples (None: all do)
    generator: torch.Generator | None = None,
    all_sampled: bool = False,
    unit_temperature: bool = False,
    uniform: torch.Tensor | np.ndarray | None = None,  # [num_reqs, 1] in (0, 1]; None: drawn
    next_ids: np.ndarray | None = None,  # [num_reqs] int32: the tokens again (host draws)
) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """Draw one draft token per row from ``draft_probs = softmax(logits / temperature)``
    (greedy rows: the argmax). Returns token ids [num_reqs], confidences (top probability)
    and ``draft_probs`` [num_reqs, vocab_size].

    Any exact draw is lossless; an inverse-CDF draw is ~20x cheaper on CPU than vLLM's
    exponential race. ``all_sampled`` / ``unit_temperature``: every row samples (at T=1).
    ``uniform``: pre-drawn, in (0, 1]; numpy ones take the compiled host path, which also
    writes the tokens as int32 to ``next_ids``.
    """
    if unit_temperature:
        all_sampled = True
    host = logits.device.type == "cpu" and not isinstance(uniform, torch.Tensor)
    if host and logits.dtype == torch.float32 and not logits.requires_grad:
        return _softmax_draw_on_host(logits, temperature, sampled, generator, all_sampled,
                                     unit_temperature, uniform, next_ids)
    if unit_temperature:
        draft_probs = logits.softmax(dim=-1, dtype=torch.float32)
    else:
        scale = temperature if all_sampled else torch.where(sampled, temperature,
                                                            torch.ones_like(temperature))
        draft_probs = (logits / scale.unsqueeze(1)).softmax(dim=-1, dtype=torch.float32)
    if uniform is None:
        uniform = draft_uniforms((logits.shape[0], 1), logits.device, generator)
        if logits.device.type == "cpu":
            uniform = uniform.numpy()
    if isinstance(uniform, np.ndarray):  # on the host
        num_rows = draft_probs.shape[0]
        greedy = _no_greedy_rows(num_rows) if all_sampled else (~sampled).numpy()
        token_ids, confidence = np.empty(num_rows, np.int64), np.empty(num_rows, np.float32)
        host_kernels.draw_rows(draft_probs.numpy(),
                               uniform if uniform.ndim == 1 else uniform.reshape(num_rows),
                               greedy, token_ids, confidence,
                               _NO_IDS if next_ids is None else next_ids)
        return torch.from_numpy(token_ids), confidence.tolist(), draft_probs
    token_ids = inverse_cdf_draw(draft_probs, uniform)
    if not all_sampled:
        token_ids = torch.where(sampled, token_ids, draft_probs.argmax(dim=-1))
    return token_ids, confidence_of(draft_probs), draft_probs


def _softmax_draw_on_host(logits, temperature, sampled, generator, all_sampled: bool,
                          unit_temperature: bool, uniform, next_ids):
    """:func:`sample_draft_tokens` for float32 logits on the host, via :class:`HostDraws`."""
    num_rows = logits.shape[0]
    if uniform is None:
        uniform = draft_uniforms((num_rows, 1), logits.device, generator).numpy()
    rows_sampled = ([True] * num_rows if all_sampled or sampled is None
                    else sampled.tolist())
    draws = HostDraws(uniform.reshape(1, num_rows),
                      None if unit_temperature else temperature.numpy().astype(np.float32),
                      rows_sampled, next_ids)
    token_ids, confidence, _ = draws.draw(0, logits)
    return torch.from_numpy(token_ids), confidence, draws.probs[0]


@functools.cache
def _unit_scales(num_rows: int) -> np.ndarray:  # [num_rows] float32, all 1 (only read)
    return np.ones(num_rows, dtype=np.float32)


@functools.cache
def _exponent_bits(vocab_size: int) -> np.ndarray:  # [vocab_size] int32 scratch
    """softmax_draw_rows's scratch per vocabulary size (draws run on one thread only)."""
    return np.empty(vocab_size, dtype=np.int32)


_NO_IDS = np.empty(0, dtype=np.int32)  # draw_rows writes no int32 copy of the tokens


@functools.cache
def _no_greedy_rows(num_rows: int) -> np.ndarray:  # [num_rows] bool, all False
    """Greedy flags when every row samples, cached per batch size; only read (not flagged
    read-only: the compiled kernel's signature would refuse it)."""
    return np.zeros(num_rows, dtype=bool)


def draft_uniforms(shape: tuple[int, ...], device,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniforms in (0, 1] (float64): 0 would pick the first token even at probability 0."""
    return 1.0 - torch.rand(shape, dtype=torch.float64, device=device, generator=generator)


class UniformPool:
    """Uniforms in (0, 1] handed out as slices of one block drawn ahead (each value once,
    so draws stay independent): cheaper than drawing fresh per run. Redrawn when used up."""

    def __init__(self, device, size: int = 1 << 14,
                 generator: torch.Generator | None = None):
        self.device, self.size, self.generator = device, size, generator
        self._block: torch.Tensor | None = None  # [size] float64
        self._host: np.ndarray | None = None  # its numpy view (take_host)
        self._next = 0  # the first value not handed out yet

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:  # [*shape] float64 in (0, 1]
        start = self._reserve(math.prod(shape))
        return self._block[start:self._next].view(shape)

    def take_host(self, shape: tuple[int, ...]) -> np.ndarray:  # [*shape] float64 in (0, 1]
        """:meth:`take` as a numpy view, for a CPU pool (the compiled draws read numpy)."""
        start = self._reserve(math.prod(shape))
        if self._host is None:
            self._host = self._block.numpy()
        return self._host[start:self._next].reshape(shape)

    def _reserve(self, count: int) -> int:
        """Reserve the next ``count`` values (new block if too few left); returns the start."""
        if self._block is None or self._next + count > self._block.numel():
            self._block = draft_uniforms((max(self.size, count),), self.device, self.generator)
            self._host, self._next = None, 0
        start, self._next = self._next, self._next + count
        return start


class HostDraws:
    """One draft run's host draws for float32 logits: each position's softmax, token and
    confidence from one compiled call into blocks allocated once per run (saves ~0.02 ms
    a position). Probabilities are position-major: [k_max, num_rows, vocab]."""

    def __init__(self, uniforms: np.ndarray,  # [k_max, num_rows] float64 in (0, 1]
                 temperature: np.ndarray | None,  # [num_rows] float32; None: all at 1
                 sampled: Sequence[bool],  # [num_rows]
                 next_ids: np.ndarray | None = None):  # [num_rows] int32
        k_max, num_rows = uniforms.shape
        self.probs: torch.Tensor | None = None  # [k_max, num_rows, vocab] (first draw)
        self._probs = self._bits = None
        self._tokens = np.empty((k_max, num_rows), dtype=np.int64)
        self._confidence = np.empty((k_max, num_rows), dtype=np.float32)
        self._uniforms = uniforms
        self._greedy = np.logical_not(np.asarray(sampled, dtype=bool))
        if temperature is None:
            self._scale = _unit_scales(num_rows)
        else:  # 1 / temperature where the row samples; a greedy row's confidence is at 1
            self._scale = np.ones(num_rows, dtype=np.float32)
            np.divide(np.float32(1.0), temperature, out=self._scale,
                      where=~self._greedy & (temperature > 0))
        self._ids = _NO_IDS if next_ids is None else next_ids

    def draw(self, position: int, logits: torch.Tensor  # [num_rows, vocab_size] float32
             ) -> tuple[np.ndarray, list[float], None]:
        """Tokens [num_rows] and confidences at ``position``; probabilities are in :attr:`probs`."""
        if self.probs is None:
            k_max, num_rows = self._tokens.shape
            self.probs = torch.empty((k_max, num_rows, logits.shape[1]), dtype=torch.float32)
            self._probs, self._bits = self.probs.numpy(), _exponent_bits(logits.shape[1])
        tokens, confidence = self._tokens[position], self._confidence[position]
        if not logits.is_contiguous():  # (e.g. the LM head's columns past the vocabulary)
            logits = logits.contiguous()
        host_kernels.softmax_draw_rows(
            logits.numpy(), self._scale, self._uniforms[position], self._greedy,
            self._probs[position], tokens, confidence, self._ids, self._bits)
        return tokens, confidence.tolist(), None


def inverse_cdf_draw(weights: torch.Tensor,  # [num_rows, vocab_size] >= 0, unnormalised
                     uniform: torch.Tensor,  # [num_rows, 1] float64 in (0, 1]
                     ) -> torch.Tensor:  # [num_rows] int64
    """One token per row, drawn in proportion to ``weights``: the first whose float64
    cumulative sum reaches ``uniform * total``. Since uniform is in (0, 1] the index is in
    range and weight-0 tokens never win; an all-zero row gets token 0."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [num_rows, vocab_size]
    return torch.searchsorted(cdf, uniform * cdf[:, -1:]).squeeze(1)


@phase("draft: draw")
def greedy_draft_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Argmax tokens [num_reqs] and their softmax probability, ``1 / sum(exp(logits - max))``
    (cheaper than a full softmax)."""
    top, token_ids = logits.max(dim=-1)
    total = (logits - top.unsqueeze(1)).exp_().sum(dim=-1, dtype=torch.float64)
    return token_ids, total.reciprocal_().tolist()


def confidence_of(draft_probs: torch.Tensor) -> list[float]:  # [num_reqs]
    """Top probability of each row of ``draft_probs`` [num_reqs, vocab_size]."""
    return draft_probs.amax(dim=-1).tolist()


def truncate_rows(draft_token_ids: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Cut each row's draft to its length (rows beyond ``lengths`` are left whole)."""
    return [row[: lengths[i]] if i < len(lengths) else row
            for i, row in enumerate(draft_token_ids)]


class DraftCandidates:
    """The draft model's place among the union's proposers (its name, its estimator cells):
    the vLLM layer runs it inside :meth:`Union.step <specplugin.adaptive.union.Union.step>`,
    which takes its candidates from the run; asked like a proposer, it has none."""

    name = "draft"

    @phase("propose: draft")
    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        return [None] * batch.num_reqs

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """The draft's per-request state is its KV in vLLM's cache, freed by vLLM."""

"""Single-draft verification: speculative (rejection) sampling, one oracle and one batched version.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192):

- **draft tokens**: the k tokens a proposer guessed for a request, drawn from
  ``draft_probs`` (or fixed, for n-gram drafts: a one-hot draft distribution).
- **accepted tokens**: the leading draft tokens the target kept. Draft token ``x`` at
  position ``i`` is accepted with probability ``min(1, target_probs[i, x] / draft_probs[i, x])``.
- **recovered token**: at the first rejection, a token drawn from the residual
  ``norm(max(0, target_probs[i] - draft_probs[i]))``; it replaces the rejected draft.
- **bonus token**: after all k drafts were accepted, a token drawn from
  ``target_probs[k]`` (the target scored k + 1 positions, so it comes for free).
- **acceptance length** = accepted + 1 tokens emitted per verification step.

Every emitted token then follows the target's distribution exactly. Greedy requests:
accept while ``draft == argmax(target_probs)``, then emit that argmax.

Randomness comes in a :class:`VerifyNoise`, so batched code is testable token for token
against the reference. Per request: ``num_draft_tokens`` uniforms (all drawn), then
``vocab_size`` Exp(1) variates; the recovered/bonus token is ``argmax(probs /
exponentials)`` (exponential race: unnormalised, element-wise). Greedy uses no noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specplugin import host_kernels
from specplugin.profiling import phase
from specplugin.proposers.draft import inverse_cdf_draw

# Fills output slots past a row's emitted tokens.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class VerifyNoise:
    """The random numbers one verification step consumes, in the documented order."""

    uniforms: torch.Tensor  # [num_draft_tokens] in [0, 1): one acceptance test per draft token
    exponentials: torch.Tensor  # [num_reqs, vocab_size] Exp(1), > 0: the recovered/bonus draw


@dataclass(frozen=True)
class VerifyOutput:
    """Emitted tokens per row, padded with ``PLACEHOLDER_TOKEN_ID``."""

    output_token_ids: torch.Tensor  # [num_reqs, max_num_draft_tokens + 1]
    num_emitted: torch.Tensor  # [num_reqs] int64: accepted + 1, the acceptance length

    @property
    def num_accepted(self) -> torch.Tensor:  # [num_reqs]
        return self.num_emitted - 1


def draw_noise(
    num_draft_tokens: int, vocab_size: int, generator: torch.Generator | None
) -> VerifyNoise:
    """Draw one request's noise from its own generator (seeded requests stay reproducible
    in a batch); None uses torch's global CPU generator."""
    device = generator.device if generator is not None else None
    uniforms = torch.rand(num_draft_tokens, generator=generator, device=device)
    exponentials = torch.empty(1, vocab_size, device=device).exponential_(generator=generator)
    # Exp(1) can round to 0.0; 0/0 would then win the race for a zero-probability token.
    exponentials.clamp_min_(torch.finfo(exponentials.dtype).tiny)
    return VerifyNoise(uniforms, exponentials)


def concat_noise(noises: Sequence[VerifyNoise]) -> VerifyNoise:
    """Stack per-request noise into batch noise, rows in the order given."""
    return VerifyNoise(
        torch.cat([n.uniforms for n in noises]),
        torch.cat([n.exponentials for n in noises]),
    )


def draw_batch_noise(
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs]
    vocab_size: int,
    generator: torch.Generator | None = None,
) -> VerifyNoise:
    """Draw a whole batch's noise at once from one generator: fast, but not per-request seeded."""
    num_reqs = cu_num_draft_tokens.shape[0]
    num_draft_tokens = int(cu_num_draft_tokens[-1]) if num_reqs else 0
    device = cu_num_draft_tokens.device
    uniforms = torch.rand(num_draft_tokens, generator=generator, device=device)
    exponentials = torch.empty(num_reqs, vocab_size, device=device)  # [num_reqs, vocab_size]
    exponentials.exponential_(generator=generator)
    exponentials.clamp_min_(torch.finfo(exponentials.dtype).tiny)
    return VerifyNoise(uniforms, exponentials)


def reference_verify(
    draft_token_ids: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab_size]; None: deterministic (one-hot) drafts
    target_probs: torch.Tensor,  # [k + 1, vocab_size]
    generator: torch.Generator | None,
    greedy: bool = False,
) -> torch.Tensor:  # [num_emitted]: accepted draft tokens + one recovered or bonus token
    """One verification step for one request, written to read like the paper: the oracle
    :func:`verify_batch` is tested against."""
    num_draft_tokens, vocab_size = target_probs.shape[0] - 1, target_probs.shape[1]
    _check_request(draft_token_ids, draft_probs, num_draft_tokens)
    emitted: list[int] = []
    if greedy:
        for i, token in enumerate(draft_token_ids.tolist()):
            best = int(target_probs[i].argmax())
            if token != best:
                return torch.tensor(emitted + [best])  # recovered token
            emitted.append(token)
        return torch.tensor(emitted + [int(target_probs[-1].argmax())])  # bonus token
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_token_ids.long(), vocab_size)
        draft_probs = draft_probs.to(target_probs.dtype)  # [k, vocab_size]
    noise = draw_noise(num_draft_tokens, vocab_size, generator)
    exponentials = noise.exponentials[0]  # [vocab_size]
    for i, token in enumerate(draft_token_ids.tolist()):
        if noise.uniforms[i] < target_probs[i, token] / draft_probs[i, token]:
            emitted.append(token)  # accepted
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)  # [vocab_size], unnormalised
        if residual.sum() == 0:  # only by rounding: rejection implies residual mass > 0
            residual = target_probs[i]
        return torch.tensor(emitted + [int((residual / exponentials).argmax())])  # recovered
    return torch.tensor(emitted + [int((target_probs[-1] / exponentials).argmax())])  # bonus


def _check_request(draft_token_ids, draft_probs, num_draft_tokens: int) -> None:
    if draft_token_ids.shape != (num_draft_tokens,):
        raise ValueError(
            f"target_probs has {num_draft_tokens + 1} rows, so draft_token_ids must have shape "
            f"({num_draft_tokens},); got {tuple(draft_token_ids.shape)}."
        )
    if draft_probs is not None and draft_probs.shape[0] != num_draft_tokens:
        raise ValueError(
            f"draft_probs must have one row per draft token ({num_draft_tokens}); "
            f"got shape {tuple(draft_probs.shape)}."
        )


@dataclass(frozen=True)
class _Layout:
    """Where each request's rows live in the flat inputs."""

    num_draft_tokens: torch.Tensor  # [num_reqs] int64: k per request
    draft_starts: torch.Tensor  # [num_reqs]: first row of each request in draft_token_ids
    req_ids: torch.Tensor  # [num_draft_tokens_total]: request of each draft token
    positions: torch.Tensor  # [num_draft_tokens_total]: 0-based position inside its draft

    @property
    def target_starts(self) -> torch.Tensor:  # [num_reqs]: first row of each request's targets
        num_reqs = len(self.draft_starts)
        return self.draft_starts + torch.arange(num_reqs, device=self.draft_starts.device)


def _layout(cu_num_draft_tokens: torch.Tensor, num_draft_tokens_total: int) -> _Layout:
    cu = cu_num_draft_tokens.long()  # [num_reqs]
    num_draft_tokens = torch.diff(cu, prepend=cu.new_zeros(1))  # [num_reqs]
    draft_starts = cu - num_draft_tokens  # [num_reqs]
    req_ids = torch.repeat_interleave(
        torch.arange(len(cu), device=cu.device),
        num_draft_tokens,
        output_size=num_draft_tokens_total,
    )  # [num_draft_tokens_total]
    positions = torch.arange(num_draft_tokens_total, device=cu.device) - draft_starts[req_ids]
    return _Layout(num_draft_tokens, draft_starts, req_ids, positions)


def verify_batch(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int
    cu_num_draft_tokens: torch.Tensor,  # [num_reqs] inclusive cumulative k, vLLM style
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size]; None: one-hot drafts
    target_probs: torch.Tensor,  # [num_draft_tokens_total + num_reqs, vocab_size]: k_i + 1 per req
    is_greedy: torch.Tensor,  # [num_reqs] bool
    noise: VerifyNoise,
) -> VerifyOutput:
    """Verify a ragged batch in one vectorised pass; same tokens as :func:`reference_verify`
    given the same noise. Request ``i`` owns draft rows ``cu[i-1]:cu[i]`` and target rows
    ``cu[i-1]+i : cu[i]+i+1`` (k_i draft positions, then its bonus position).
    """
    num_draft_tokens_total = draft_token_ids.shape[0]
    _check_batch(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, noise)
    layout = _layout(cu_num_draft_tokens, num_draft_tokens_total)
    draft_token_ids = draft_token_ids.long()
    target_argmax = target_probs.argmax(-1)  # [num_draft_tokens_total + num_reqs]
    accepted = _accept_mask(
        draft_token_ids, draft_probs, target_probs, target_argmax, is_greedy, noise, layout
    )  # [num_draft_tokens_total] bool
    num_accepted = _count_leading(accepted, layout)  # [num_reqs]
    final_rows = layout.target_starts + num_accepted  # [num_reqs]: target row, last emitted token
    is_rejected = num_accepted < layout.num_draft_tokens  # [num_reqs]
    rejected_rows = layout.draft_starts + num_accepted  # [num_reqs]: draft row, first rejection
    residual = _residual_probs(
        target_probs[final_rows], draft_token_ids, draft_probs, rejected_rows, is_rejected
    )  # [num_reqs, vocab_size]
    sampled_ids = (residual / noise.exponentials).argmax(-1)  # [num_reqs]
    final_ids = torch.where(is_greedy, target_argmax[final_rows], sampled_ids)  # [num_reqs]
    return _assemble(draft_token_ids, num_accepted, final_ids, layout)


def _check_batch(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, noise) -> None:
    num_reqs, num_draft_tokens_total = cu_num_draft_tokens.shape[0], draft_token_ids.shape[0]
    if num_reqs and int(cu_num_draft_tokens[-1]) != num_draft_tokens_total:
        raise ValueError(
            f"cu_num_draft_tokens[-1] ({int(cu_num_draft_tokens[-1])}) must equal the number of "
            f"draft tokens ({num_draft_tokens_total})."
        )
    if target_probs.shape[0] != num_draft_tokens_total + num_reqs:
        raise ValueError(
            f"target_probs needs k_i + 1 rows per request "
            f"({num_draft_tokens_total + num_reqs} in all); got {target_probs.shape[0]}."
        )
    expected_draft_shape = (num_draft_tokens_total, target_probs.shape[1])
    if draft_probs is not None and draft_probs.shape != expected_draft_shape:
        raise ValueError(
            f"draft_probs must have shape {expected_draft_shape}; got {tuple(draft_probs.shape)}."
        )
    assert noise.uniforms.shape == (num_draft_tokens_total,), noise.uniforms.shape
    assert noise.exponentials.shape == (num_reqs, target_probs.shape[1]), noise.exponentials.shape


def _accept_mask(
    draft_token_ids, draft_probs, target_probs, target_argmax, is_greedy, noise, layout
) -> torch.Tensor:  # [num_draft_tokens_total] bool
    """Per draft token: would it pass its own test? (Only a leading run of passes counts.)"""
    target_rows = torch.arange(len(draft_token_ids), device=draft_token_ids.device) + layout.req_ids
    target_of_draft = target_probs[target_rows, draft_token_ids]  # [num_draft_tokens_total]
    if draft_probs is None:
        draft_of_draft = torch.ones_like(target_of_draft)  # one-hot drafts: q(x) = 1
    else:
        draft_of_draft = draft_probs.gather(1, draft_token_ids[:, None]).squeeze(1)
    sampled_accept = noise.uniforms < target_of_draft / draft_of_draft  # [num_draft_tokens_total]
    greedy_accept = draft_token_ids == target_argmax[target_rows]  # [num_draft_tokens_total]
    return torch.where(is_greedy[layout.req_ids], greedy_accept, sampled_accept)


def _count_leading(accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:  # [num_reqs]
    """Length of each request's leading run of accepted draft tokens."""
    num_reqs = layout.num_draft_tokens.shape[0]
    max_k = int(layout.num_draft_tokens.max()) if num_reqs else 0
    padded = torch.zeros(num_reqs, max_k, dtype=torch.int64, device=accepted.device)
    padded[layout.req_ids, layout.positions] = accepted.long()
    return padded.cumprod(dim=1).sum(dim=1)


def _residual_probs(
    final_target_probs: torch.Tensor,  # [num_reqs, vocab_size]: target row, last emitted token
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total]
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size]
    rejected_rows: torch.Tensor,  # [num_reqs]: draft row of the first rejection (if any)
    is_rejected: torch.Tensor,  # [num_reqs] bool
) -> torch.Tensor:  # [num_reqs, vocab_size], unnormalised
    """max(0, target - draft) where a draft was rejected, the target itself where all passed."""
    if draft_token_ids.shape[0] == 0:
        return final_target_probs
    rejected_rows = rejected_rows.clamp(max=draft_token_ids.shape[0] - 1)
    if draft_probs is None:
        vocab_size = final_target_probs.shape[1]
        rejected_draft_probs = torch.nn.functional.one_hot(
            draft_token_ids[rejected_rows], vocab_size
        ).to(final_target_probs.dtype)  # [num_reqs, vocab_size]
    else:
        rejected_draft_probs = draft_probs[rejected_rows]  # [num_reqs, vocab_size]
    residual = (final_target_probs - rejected_draft_probs).clamp_min(0)
    residual = torch.where(is_rejected[:, None], residual, final_target_probs)
    no_mass = residual.sum(dim=-1, keepdim=True) == 0  # [num_reqs, 1]: only by rounding
    return torch.where(no_mass, final_target_probs, residual)


def _assemble(draft_token_ids, num_accepted, final_ids, layout: _Layout) -> VerifyOutput:
    """Accepted drafts, then the recovered/bonus token, then placeholders."""
    num_reqs = num_accepted.shape[0]
    max_k = int(layout.num_draft_tokens.max()) if num_reqs else 0
    output = torch.full(
        (num_reqs, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=final_ids.device
    )  # [num_reqs, max_k + 1]
    keep = layout.positions < num_accepted[layout.req_ids]  # [num_draft_tokens_total]
    output[layout.req_ids[keep], layout.positions[keep]] = draft_token_ids[keep]
    output[torch.arange(num_reqs, device=final_ids.device), num_accepted] = final_ids
    return VerifyOutput(output, num_accepted + 1)


@phase("plugin: verify")
def expected_acceptance(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab_size]; None: every draft one-hot
    target_probs: torch.Tensor,  # [num_tokens, vocab_size]
) -> torch.Tensor:  # [num_tokens] float32
    """Probability each draft token is accepted: ``sum(min(p, q))`` for a draw from ``q``,
    ``p[x]`` for a one-hot guess. A lower-noise learning signal than the verdict itself."""
    if draft_probs is None:
        return target_probs.gather(1, draft_token_ids.long().unsqueeze(1)).squeeze(1)
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)


@phase("plugin: verify")
def draw_recovered(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab_size]; None: every draft one-hot
    target_probs: torch.Tensor,  # [num_tokens, vocab_size]
    uniform: torch.Tensor,  # [num_tokens, 1] float64 in (0, 1]
) -> torch.Tensor:  # [num_tokens] int64
    """A recovered token per draft position from its residual ``norm(max(0, p - q))`` by
    inverse CDF (~10x cheaper on CPU than vLLM's exponential race). A residual with no
    mass gets token 0, as in vLLM's kernel."""
    if draft_probs is None:
        residual = target_probs.clone()
        residual.scatter_(1, draft_token_ids.long().unsqueeze(1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_min_(0.0)
    return inverse_cdf_draw(residual, uniform)


def greedy_verify(
    logits: torch.Tensor,  # [num_draft_tokens_total + num_reqs, vocab_size] on CPU
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] on CPU
    num_draft_tokens: Sequence[int],  # [num_reqs]
) -> torch.Tensor:  # [num_reqs, max(num_draft_tokens) + 1] int32
    """Verify an all-greedy batch on the host: keep drafts while they equal the target's
    argmax, then emit the argmax. ``logits``: each request's draft rows then its bonus row
    (vLLM's layout). Same result as vLLM's sampler without its fixed costs (numpy's
    argmax is ~10x cheaper than torch's here). Ties go to the lowest index."""
    values = logits if not logits.requires_grad else logits.detach()
    if values.dtype == torch.bfloat16:  # (numpy has none; to float32 is exact)
        values = values.float()
    counts = np.array(num_draft_tokens, dtype=np.int64)  # [num_reqs]
    output = np.empty((counts.size, max(num_draft_tokens, default=0) + 1),
                      dtype=np.int32)  # [num_reqs, max_k + 1]
    host_kernels.greedy_rows(values.numpy().argmax(axis=-1), draft_token_ids.numpy(), counts,
                             output, PLACEHOLDER_TOKEN_ID)
    return torch.from_numpy(output)


def sampled_verify(
    logits: torch.Tensor,  # [num_draft_tokens_total + num_reqs, vocab_size] on CPU
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] on CPU
    num_draft_tokens: Sequence[int],  # [num_reqs]
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size]; None: one-hot
    temperature: np.ndarray,  # [num_reqs] > 0 samples at that temperature, 0 is greedy
    uniforms: np.ndarray,  # [num_draft_tokens_total + num_reqs] float64 in (0, 1]
) -> tuple[torch.Tensor, np.ndarray]:  # [num_reqs, max_k + 1] int32, [num_draft_tokens_total]
    """Verify sampled (and greedy, ``T`` = 0) requests on the host as :func:`reference_verify`
    does, ``p = softmax(logits / T)``; ``uniforms``: one per draft token, then one per
    request (recovered/bonus draw). Returns the emitted tokens and each draft's expected
    acceptance (greedy: its 0/1 verdict). Avoids vLLM's sampler (~0.45 ms a step on CPU)."""
    # few numpy/torch calls on the common path (all sampled at T=1, float32 draft probs)
    values = logits.detach() if logits.requires_grad else logits
    if values.dtype != torch.float32:  # (float32 holds bfloat16 exactly)
        values = values.float()
    temperatures = temperature.tolist()  # [num_reqs]
    counts = np.array(num_draft_tokens, dtype=np.int64)  # [num_reqs]
    greedy = temperature == 0  # [num_reqs]
    # softmax only the sampled requests' rows; greedy ones need the argmax alone
    sampled_values = values
    if 0.0 in temperatures:
        sampled_values = values[torch.from_numpy(np.repeat(~greedy, counts + 1))]
    if sampled_values.shape[0] and any(t not in (0.0, 1.0) for t in temperatures):
        scale = np.repeat(temperature[~greedy].astype(np.float32), counts[~greedy] + 1)
        sampled_values = sampled_values / torch.from_numpy(scale)[:, None]
    # torch's fused softmax: ~4x faster than numpy's
    target_probs = sampled_values.softmax(dim=-1).numpy()  # [num_sampled_rows, vocab_size]
    has_q = draft_probs is not None
    if not has_q:
        q = np.zeros((0, values.shape[1]), dtype=np.float32)  # (one-hot drafts: unread)
    elif draft_probs.dtype == torch.float32 and not draft_probs.requires_grad:
        q = draft_probs.numpy()  # [num_drafted, vocab_size]
    else:
        q = draft_probs.detach().float().numpy()
    if not q.flags.c_contiguous:  # (the kernel reads rows as contiguous)
        q = np.ascontiguousarray(q)
    drafts = draft_token_ids.numpy()  # [num_drafted]
    if drafts.dtype != np.int64:
        drafts = drafts.astype(np.int64)
    output = np.full((counts.size, max(num_draft_tokens, default=0) + 1),
                     PLACEHOLDER_TOKEN_ID, dtype=np.int32)  # [num_reqs, max_k + 1]
    expected = np.zeros(drafts.size, dtype=np.float32)  # a greedy draft's: its verdict
    if uniforms.dtype != np.float64 or not uniforms.flags.c_contiguous:
        uniforms = np.ascontiguousarray(uniforms, dtype=np.float64)
    host_kernels.verify_rows(values.numpy(), target_probs, counts, greedy, drafts, q, has_q,
                             uniforms, output, expected, _scratch(values.shape[1]))
    return torch.from_numpy(output), expected


_SCRATCH: dict[int, np.ndarray] = {}  # vocab size -> a float64 row (see _scratch)


def _scratch(vocab_size: int) -> np.ndarray:  # [vocab_size] float64
    """The kernel's residual scratch row per vocabulary size (overwritten before read)."""
    row = _SCRATCH.get(vocab_size)
    if row is None:
        row = _SCRATCH[vocab_size] = np.empty(vocab_size, dtype=np.float64)
    return row

"""Multi-draft verification: several candidate drafts for one request, one winner.

Each candidate ``c`` has its own ``target_probs[c]`` [k_c + 1, vocab_size] (one target row
per candidate); shared prefixes agree, so the target at each depth is read from the
lowest-index candidate still in play.

Greedy: the longest accepted prefix wins (ties: lowest index), plus the target's argmax.

Sampling: recursive rejection sampling (SpecInfer arXiv 2305.09781, SpecTr arXiv
2310.15141). At each depth, candidates agreeing with the emitted prefix are tried in
order: ``x`` is accepted with probability ``min(1, residual[x] / draft_probs[c][depth, x])``;
on rejection ``residual = norm(max(0, residual - draft_probs[c][depth]))``, starting from
the target. If none is accepted, a recovered (or bonus) token is drawn from the residual.

Lossless when each tried token is an independent draw from its own ``draft_probs``:
i.i.d. sampled candidates, deterministic ones passed as ``None`` (one-hot), or a mix.
NOT lossless for candidates sampled without replacement: pass those as ``None``. A
repeated token is tried again, not skipped: its residual update is part of the proof.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MultiDraftOutput:
    """The emitted tokens and the candidate whose KV holds the accepted prefix."""

    token_ids: torch.Tensor  # [num_emitted]: accepted tokens + one recovered or bonus token
    winner: int  # index of the candidate to keep (lowest index among those holding the prefix)


def longest_accepted(
    draft_ids: torch.Tensor,  # [k]
    target_ids: torch.Tensor,  # [k + 1] the target's argmax after each prefix of the draft
) -> int:
    """Greedy acceptance of one candidate: how many of its tokens match the target's argmax
    before the first mismatch."""
    matches = draft_ids.long() == target_ids[: draft_ids.shape[0]].long()  # [k]
    return int(matches.long().cumprod(0).sum())


def greedy_multi_draft_verify(
    candidate_draft_ids: Sequence[torch.Tensor],  # num_candidates x [k_c]
    candidate_target_probs: Sequence[torch.Tensor],  # num_candidates x [k_c + 1, vocab_size]
) -> MultiDraftOutput:
    """Temperature 0: the candidate with the longest run of draft == argmax(target) wins."""
    _check_candidates(candidate_draft_ids, None, candidate_target_probs)
    best_len, winner = -1, 0
    for c, (draft_ids, target_probs) in enumerate(zip(candidate_draft_ids, candidate_target_probs)):
        matches = (draft_ids.long() == target_probs[:-1].argmax(-1)).long()  # [k_c]
        num_accepted = int(matches.cumprod(0).sum())
        if num_accepted > best_len:  # strict: ties keep the lowest index
            best_len, winner = num_accepted, c
    accepted = candidate_draft_ids[winner][:best_len].long()
    final = candidate_target_probs[winner][best_len].argmax().reshape(1)
    return MultiDraftOutput(torch.cat([accepted, final]), winner)


def reference_multi_draft_verify(
    candidate_draft_ids: Sequence[torch.Tensor],  # num_candidates x [k_c]
    candidate_draft_probs: Sequence[torch.Tensor | None] | None,  # num_candidates x [k_c, vocab]
    candidate_target_probs: Sequence[torch.Tensor],  # num_candidates x [k_c + 1, vocab_size]
    generator: torch.Generator | None,
) -> MultiDraftOutput:
    """Recursive rejection sampling over candidates (the oracle; see the module docstring).
    A None ``candidate_draft_probs`` (or entry) means one-hot drafts."""
    _check_candidates(candidate_draft_ids, candidate_draft_probs, candidate_target_probs)
    if candidate_draft_probs is None:
        candidate_draft_probs = [None] * len(candidate_draft_ids)
    drafts = [ids.tolist() for ids in candidate_draft_ids]
    emitted: list[int] = []
    alive = list(range(len(drafts)))  # candidates whose draft starts with `emitted`
    for depth in range(max(map(len, drafts)) + 1):
        residual = _normalised(candidate_target_probs[alive[0]][depth])  # [vocab_size]
        accepted = None
        for c in (c for c in alive if len(drafts[c]) > depth):
            token = drafts[c][depth]
            draft_row = _draft_row(candidate_draft_probs[c], depth, token, residual)  # [vocab_size]
            if torch.rand((), generator=generator) < residual[token] / draft_row[token]:
                accepted = token
                break
            residual = _residual_after_rejection(residual, draft_row)
        if accepted is None:  # recovered token (or bonus, if nothing was tried)
            final = int(torch.multinomial(residual, 1, generator=generator))
            return MultiDraftOutput(torch.tensor(emitted + [final]), alive[0])
        emitted.append(accepted)
        alive = [c for c in alive if len(drafts[c]) > depth and drafts[c][depth] == accepted]
    raise AssertionError("unreachable: the last depth has no candidate token to try")


def one_hot_multi_draft_verify(
    candidate_draft_ids: Sequence[torch.Tensor],  # num_candidates x [k_c]
    candidate_target_probs: Sequence[torch.Tensor],  # num_candidates x [k_c + 1, vocab_size]
    generator: torch.Generator | None = None,
) -> MultiDraftOutput:
    """:func:`reference_multi_draft_verify` for one-hot candidates, the serving path: all
    candidates of a depth judged at once. Candidate i is accepted with probability
    ``p[x_i] / (1 - sum of p over distinct earlier tokens)`` (0 for a repeat); the first
    under its uniform wins, the same law as trying them in turn."""
    _check_candidates(candidate_draft_ids, None, candidate_target_probs)
    lengths = torch.tensor([len(ids) for ids in candidate_draft_ids])  # [num_candidates]
    width = int(lengths.max())
    drafts = torch.full((len(lengths), max(width, 1)), -1, dtype=torch.long)  # [C, width]
    for c, ids in enumerate(candidate_draft_ids):
        drafts[c, : len(ids)] = ids.long()
    alive = torch.ones(len(lengths), dtype=torch.bool)  # [C] drafts that start with `emitted`
    emitted: list[int] = []
    for depth in range(width + 1):
        first = int(alive.nonzero()[0])
        residual = _normalised(candidate_target_probs[first][depth].double())  # [vocab_size]
        tried = (alive & (lengths > depth)).nonzero().flatten()  # [m] in index order
        if len(tried):
            tokens = drafts[tried, depth]  # [m]
            accepted = _first_accepted(residual, tokens, generator)
            if accepted is not None:
                emitted.append(accepted)
                alive &= (lengths > depth) & (drafts[:, depth] == accepted)
                continue
            residual = _without(residual, tokens)
        final = int(torch.multinomial(residual, 1, generator=generator))
        return MultiDraftOutput(torch.tensor(emitted + [final]), first)
    raise AssertionError("unreachable: the last depth has no candidate token to try")


def _first_accepted(residual: torch.Tensor, tokens: torch.Tensor,
                    generator: torch.Generator | None) -> int | None:
    """The token of the first candidate accepted at this depth (None: all rejected)."""
    m = tokens.shape[0]
    earlier = torch.ones(m, m, dtype=torch.bool).tril(-1)  # [m, m] j < i
    repeat = ((tokens[:, None] == tokens[None, :]) & earlier).any(1)  # [m] already tried
    probs = residual[tokens] * ~repeat  # [m] mass of each distinct token, once
    rejected_before = torch.cumsum(probs, 0) - probs  # [m]
    accept = probs / (1.0 - rejected_before).clamp_min(1e-30)  # [m] (0 for repeats)
    hits = (torch.rand(m, generator=generator, dtype=residual.dtype) < accept).nonzero()
    return int(tokens[hits[0, 0]]) if len(hits) else None


def _without(residual: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [vocab_size]
    """The residual after one-hot rejections of ``tokens``: those tokens removed."""
    updated = residual.clone()
    updated[tokens] = 0.0
    total = updated.sum()
    return residual if total == 0 else updated / total


def _draft_row(
    draft_probs: torch.Tensor | None, depth: int, token: int, like: torch.Tensor
) -> torch.Tensor:  # [vocab_size]
    """The candidate's draft distribution at ``depth``; one-hot for deterministic drafts."""
    if draft_probs is None:
        row = torch.zeros_like(like)  # [vocab_size]
        row[token] = 1.0
        return row
    return draft_probs[depth].to(like.dtype)


def _residual_after_rejection(residual: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, residual - draft_row)): the target's law given this candidate's rejection."""
    updated = (residual - draft_row).clamp_min(0)  # [vocab_size]
    total = updated.sum()
    if total == 0:  # only by rounding: a rejection implies leftover mass
        return residual
    return updated / total


def _normalised(probs: torch.Tensor) -> torch.Tensor:  # [vocab_size]
    return probs / probs.sum()


def _check_candidates(candidate_draft_ids, candidate_draft_probs, candidate_target_probs) -> None:
    if len(candidate_draft_ids) == 0:
        raise ValueError("multi-draft verification needs at least one candidate (it may be empty).")
    if len(candidate_target_probs) != len(candidate_draft_ids):
        raise ValueError(
            f"got {len(candidate_draft_ids)} candidates but "
            f"{len(candidate_target_probs)} target_probs."
        )
    if candidate_draft_probs is not None and len(candidate_draft_probs) != len(candidate_draft_ids):
        raise ValueError(
            f"got {len(candidate_draft_ids)} candidates but "
            f"{len(candidate_draft_probs)} draft_probs."
        )
    for c, (ids, target) in enumerate(zip(candidate_draft_ids, candidate_target_probs)):
        if target.shape[0] != ids.shape[0] + 1:
            raise ValueError(
                f"candidate {c}: target_probs needs k + 1 = {ids.shape[0] + 1} rows; "
                f"got {target.shape[0]}."
            )

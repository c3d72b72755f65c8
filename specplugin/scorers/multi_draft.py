"""Multi-draft verification: several candidate drafts for one request, one winner.

The batch-expanding scorer turns each candidate into its own target row, so each
candidate ``c`` comes with its own ``target_probs[c]`` (``[k_c + 1, vocab_size]``, the
target's distribution after each prefix of that candidate). Candidates that share a
prefix share the context there, so their target rows agree on it; the code reads the
target at each depth from the lowest-index candidate still in play.

Greedy: the candidate with the longest accepted prefix wins (ties: lowest index), and
emits its accepted tokens plus the target's argmax after them.

Sampling: recursive rejection sampling (SpecInfer, arXiv 2305.09781; SpecTr,
arXiv 2310.15141). At each depth, the candidates still agreeing with the emitted
prefix are tried in index order. Candidate ``c`` proposes ``x`` and is accepted with
probability ``min(1, residual[x] / draft_probs[c][depth, x])``; on rejection the
residual becomes ``norm(max(0, residual - draft_probs[c][depth]))``. The residual
starts as the target's distribution. When no candidate is accepted (or none has a token at
this depth) the step ends with a token drawn from the residual: a recovered token, or a
bonus token if nothing was ever rejected.

When this is exactly lossless (output distribution == target's): each step of the loop
is an ordinary speculative-sampling step with target ``residual`` and draft
``draft_probs[c][depth]``, so the whole is lossless whenever each tried candidate's token
at this depth is a draw from *its own* ``draft_probs[c][depth]``, independent of the
other candidates' tokens at this depth. That covers:

- candidates sampled i.i.d. (each an independent autoregressive sample from the draft
  model), with their draft probabilities passed;
- deterministic candidates (n-gram matches, or the draft's top-k) passed with
  ``draft_probs[c] = None``, i.e. one-hot: acceptance is ``residual[x]`` and rejection
  zeroes ``x`` in the residual;
- any mix of the two, as long as the sampled ones were sampled independently.

It is NOT lossless for candidates sampled *without replacement* (distinct siblings of a
sampled tree): their tokens are not independent draws. Treat such candidates as
deterministic (``None``), which stays lossless, or use a without-replacement rule.
A repeated token is tried again rather than skipped: after its rejection
``residual[x] == 0``, so it is rejected surely, but with sampled drafts the residual
update ``max(0, residual - draft_probs)`` it triggers is part of the proof (skipping it
biases the output); with one-hot drafts that update changes nothing, so the loop then
equals "try each distinct token once".
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
    """Recursive rejection sampling over candidates (see the module docstring for when
    it is lossless). ``candidate_draft_probs`` None, or a None entry, means one-hot drafts.

    Noise: one uniform per tried candidate, then one ``torch.multinomial`` draw for the
    final token, all from ``generator`` in the order they are needed.
    """
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
    """:func:`reference_multi_draft_verify` for deterministic (one-hot) candidates, the
    serving path: all candidates of one depth are judged at once.

    With one-hot drafts, after rejecting tokens ``x_1 .. x_{i-1}`` the residual is the
    target with those tokens removed, so candidate i is accepted with probability
    ``p[x_i] / (1 - sum of p over the distinct earlier tokens)`` (0 if ``x_i`` was
    already rejected). One uniform is drawn per candidate tried at the depth and the
    first candidate under its probability wins: the same law as trying them in turn
    (uniforms of candidates after the winner are unused). If none wins, the recovered
    token (bonus if nothing was tried) is drawn from the target without the tried
    tokens."""
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

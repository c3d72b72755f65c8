"""Prompt-lookup (n-gram) drafting: copy what followed the last time the context's tail appeared.

For each request the longest suffix of its context (``max_n`` tokens down to
``min_n``) that also occurs earlier in the same context is found, and the tokens
that followed that earlier occurrence become the draft. Among occurrences of the
longest matching suffix the most recent one wins: recent text is the best
predictor of what repeats next (an edit copies the span just quoted; a loop
repeats its last turn).

A match close to the end (a loop) would leave only a few tokens to copy; the
draft then continues the copy periodically (see :func:`continuation`).

The search is vectorised over positions with numpy: ``max_n`` passes of one
element-wise comparison over the context, no per-token Python loop.

Signal (for the difficulty estimator): ``match_len / max_n`` for every token of the
draft, lowered to ``0.5 * match_len / max_n`` for tokens copied past the end of the
context (the periodic continuation of a loop, a guess about a guess).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from specplugin.proposers.base import Candidate, StepBatch


def longest_suffix_match(
    context: np.ndarray,  # [num_tokens]
    min_n: int,
    max_n: int,
) -> tuple[int, int]:
    """Return ``(match_len, end)``: the earlier span ``context[end - match_len + 1 : end + 1]``
    equals the context's last ``match_len`` tokens, with ``end < num_tokens - 1`` so at
    least one token follows it. ``match_len`` is the longest in ``[min_n, max_n]`` and
    ``end`` the latest such position; ``(0, -1)`` when there is none.
    """
    match_len, ends = suffix_match_ends(context, min_n, max_n)
    return (match_len, int(ends[-1])) if match_len else (0, -1)


def suffix_match_ends(
    context: np.ndarray,  # [num_tokens]
    min_n: int,
    max_n: int,
) -> tuple[int, np.ndarray]:
    """Like :func:`longest_suffix_match`, with every ``end`` of the longest match, in
    ascending order (``(0, [])`` when there is none)."""
    num_tokens = context.shape[0]
    none = np.empty(0, dtype=np.int64)
    if num_tokens < min_n + 1:
        return 0, none
    # candidate ends e = 0 .. num_tokens - 2; alive[e] <=> suffix of length d+1 matches at e
    alive = context[: num_tokens - 1] == context[num_tokens - 1]
    best_len, best_ends = 0, none
    for d in range(1, max_n + 1):
        hits = np.flatnonzero(alive)
        if hits.size == 0:
            break
        # offset: alive[i] describes end e = i + (d - 1)
        if d >= min_n:
            best_len, best_ends = d, hits + d - 1
        if d == max_n or d >= num_tokens - 1:
            break
        # extend by one token to the left: compare context[e - d] with context[-1 - d]
        alive = alive[1:] & (context[: num_tokens - 1 - d] == context[num_tokens - 1 - d])
    return best_len, best_ends


def continuation(
    context: np.ndarray,  # [num_tokens]
    start: int,
    limit: int,
) -> np.ndarray:  # [limit]
    """The ``limit`` tokens that follow a match ending at ``start - 1``.

    When the copy runs into the end of the context it goes on copying its own
    output, exactly as the text would if it kept repeating: the continuation of
    a match ``period = num_tokens - start`` tokens back is periodic with that period.
    """
    return np.resize(context[start:], limit)


class NgramProposer:
    """Drafts by prompt lookup over each request's own prompt and output."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 8, num_alternatives: int = 0):
        """``num_alternatives``: also offer the continuations of up to that many earlier
        occurrences of the match, each starting with a token no later one starts with
        (for the batch-expanding scorer)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_alternatives = num_alternatives

    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        candidates: list[Candidate | None] = [None] * batch.num_reqs
        for row in batch.rows:
            limit = int(batch.max_draft_lens[row])
            if limit <= 0:
                continue
            context = batch.context(row)
            match_len, ends = suffix_match_ends(context, self.min_n, self.max_n)
            if not match_len:
                continue
            # the most recent occurrence, then earlier ones that go on differently
            chosen, firsts = [], set()
            for end in ends[::-1].tolist():
                if context[end + 1] not in firsts:
                    chosen.append(end)
                    firsts.add(context[end + 1])
                if len(chosen) > self.num_alternatives:
                    break
            found = [self._candidate(context, end, match_len, limit) for end in chosen]
            candidates[row] = (found[0] if len(found) == 1 else
                               dataclasses.replace(found[0], alternatives=tuple(found[1:])))
        return candidates

    def _candidate(self, context: np.ndarray, end: int, match_len: int, limit: int) -> Candidate:
        token_ids = continuation(context, end + 1, limit).astype(np.int64)
        signal = np.full(limit, match_len / self.max_n)
        signal[len(context) - end - 1:] *= 0.5  # copied from the draft itself
        return Candidate(token_ids, signal)

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """Stateless: everything it reads is in the batch."""

"""Prompt-lookup (n-gram) drafting: copy what followed the last time the context's tail appeared.

For each request the longest suffix of its context (``max_n`` tokens down to
``min_n``) that also occurs earlier in the same context is found, and the tokens
that followed that earlier occurrence become the draft. Among occurrences of the
longest matching suffix the most recent one wins: recent text is the best
predictor of what repeats next (an edit copies the span just quoted; a loop
repeats its last turn).

A match close to the end (a loop) would leave only a few tokens to copy; the
draft then continues the copy periodically (:func:`draft_rows`; for the scorer's
alternatives, the same rule in Python, :meth:`NgramProposer._candidate`).

Every row the step asks for is matched in one compiled call (:func:`draft_rows`,
numba, as vLLM's own n-gram proposer is): for each row it scans the row's context in the
engine's token buffer from its newest position back, extending each occurrence of the last
token to the left (at most ``max_n`` tokens), and writes the draft and its signal. A loop
over a few thousand tokens costs a few microseconds compiled, less than the per-request
index of ``min_n``-gram ends in Python dicts it replaced, whose upkeep and look-ups were a
dozen calls per row on caches the target's forward had just swept (measured in an engine:
see ``docs/benchmarks.md``). The scorer's alternatives (every end of
the longest match) come from the vectorised search, :func:`suffix_match_ends`: ``max_n``
passes of one element-wise comparison over the context. Both find the same match, the one
:func:`longest_suffix_match` defines.

Signal (for the difficulty estimator): ``match_len / max_n`` for every token of the
draft, lowered to ``0.5 * match_len / max_n`` for tokens copied past the end of the
context (the periodic continuation of a loop, a guess about a guess).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numba
import numpy as np

from specplugin.host_kernels import JIT
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


# (token buffer, row lengths): the engine's int32 buffer and lengths, or int64 ones
_DRAFT_ROWS = [f"void({tokens}[:, :], {lengths}[::1], int64[::1], int64[::1], int64, int64, "
               "int64[:, ::1], float64[:, ::1], int64[::1])"
               for tokens in ("int32", "int64") for lengths in ("int32", "int64")]


@numba.njit(_DRAFT_ROWS, **JIT)
def draft_rows(token_ids, num_tokens, rows, limits, min_n, max_n, drafts, signals, lengths):
    """Each asked row's draft, as :class:`NgramProposer` defines it: ``token_ids``
    [num_rows_in_buffer, max_len] holds each row's context in its first ``num_tokens[r]``
    positions; ``rows`` [num_asked] the rows asked for; ``limits`` [num_rows] most draft
    tokens per row. For the i-th asked row, the :func:`longest_suffix_match` of its context
    (the longest earlier occurrence of its last ``min_n`` to ``max_n`` tokens, the latest
    on a tie), then ``drafts[i, :limit]`` the tokens that followed it, repeated with their
    period where they run into the context's end, ``signals[i, :limit]`` ``match_len /
    max_n`` (half that on the repeated tokens) and ``lengths[i]`` the limit; 0 where
    nothing matched or the limit is 0."""
    for i in range(rows.shape[0]):
        r = rows[i]
        limit, n = limits[r], num_tokens[r]
        lengths[i] = 0
        if limit <= 0 or n < min_n + 1:
            continue
        last = n - 1
        tail = token_ids[r, last]
        best_len, best_end = 0, -1
        for e in range(last - 1, min_n - 2, -1):  # newest first: a tie keeps the later end
            if token_ids[r, e] != tail:
                continue
            length = 1
            while (length < max_n and e - length >= 0
                   and token_ids[r, e - length] == token_ids[r, last - length]):
                length += 1
            if length >= min_n and length > best_len:
                best_len, best_end = length, e
                if length == max_n:
                    break
        if best_len == 0:
            continue
        period = min(last - best_end, limit)  # the tokens after the match, the limit's at most
        score = best_len / max_n
        for j in range(limit):
            drafts[i, j] = token_ids[r, best_end + 1 + j % period]
            signals[i, j] = score if j < period else 0.5 * score
        lengths[i] = limit


def _warm_up() -> None:
    """Call :func:`draft_rows` once for each kind of batch an engine builds (the drafting
    step's lengths in int64, the plain step's peek at vLLM's int32 ones): a kernel's first
    call in a process costs milliseconds beyond its compile (see
    :mod:`specplugin.host_kernels`), which would land in an engine's first drafted step."""
    for lengths in (np.int64, np.int32):
        draft_rows(np.zeros((1, 4), dtype=np.int32), np.full(1, 4, dtype=lengths),
                   np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), 1, 2,
                   np.empty((1, 1), dtype=np.int64), np.empty((1, 1)), np.empty(1, dtype=np.int64))


_warm_up()


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
        if self.num_alternatives:
            return self._propose_with_alternatives(batch)
        candidates: list[Candidate | None] = [None] * batch.num_reqs
        rows = batch.rows
        if not rows:
            return candidates
        limits = batch.max_draft_lens  # [num_reqs]
        width = int(limits.max())
        drafts = np.empty((len(rows), width), dtype=np.int64)  # [num_asked, max limit]
        signals = np.empty((len(rows), width))  # [num_asked, max limit]
        lengths = np.empty(len(rows), dtype=np.int64)  # [num_asked]
        draft_rows(batch.token_ids, batch.num_tokens, np.array(rows, dtype=np.int64), limits,
                   self.min_n, self.max_n, drafts, signals, lengths)
        for i, (row, k) in enumerate(zip(rows, lengths.tolist())):
            if k:
                candidates[row] = Candidate(drafts[i, :k], signals[i, :k])
        return candidates

    def _propose_with_alternatives(self, batch: StepBatch) -> list[Candidate | None]:
        """:meth:`propose` with the continuations of earlier occurrences of each match too
        (the vectorised search: every end of the longest match)."""
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
            found = [self._candidate(context[end + 1:end + 1 + limit].tolist(), match_len, limit)
                     for end in chosen]
            candidates[row] = (found[0] if len(found) == 1 else
                               dataclasses.replace(found[0], alternatives=tuple(found[1:])))
        return candidates

    def _candidate(self, copied: list[int], match_len: int, limit: int) -> Candidate:
        """The ``limit`` tokens that follow a match (``copied``: the context after it, or
        its first ``limit`` tokens).

        When the copy runs into the end of the context it goes on copying its own
        output, exactly as the text would if it kept repeating: the continuation of a
        match ``period = len(copied)`` tokens back is periodic with that period. Those
        tokens' signal is halved (copied from the draft itself). The alternatives' path
        only: :func:`draft_rows` applies the same rule to every row's main draft."""
        token_ids = (copied * (limit // len(copied) + 1))[:limit]
        score = match_len / self.max_n
        own = min(len(copied), limit)
        signal = [score] * own + [0.5 * score] * (limit - own)
        return Candidate(np.array(token_ids, dtype=np.int64), np.array(signal))

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """Nothing kept per request: every proposal reads the context as it is."""

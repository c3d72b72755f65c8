"""Prompt-lookup (n-gram) drafting: copy what followed the last time the context's tail appeared.

The longest context suffix (``max_n`` down to ``min_n`` tokens) that occurs earlier in
the same context is found, its most recent occurrence wins, and the tokens that
followed become the draft; a copy running into the context's end repeats periodically.

Main drafts come from one compiled numba call for all rows (:func:`draft_rows`);
the alternatives from the vectorised :func:`suffix_match_ends`. Both find the match
:func:`longest_suffix_match` defines.

Signal: ``match_len / max_n`` per token, halved for the periodic continuation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numba
import numpy as np

from specplugin.host_kernels import JIT
from specplugin.profiling import phase
from specplugin.proposers.base import Candidate, StepBatch


def longest_suffix_match(
    context: np.ndarray,  # [num_tokens]
    min_n: int,
    max_n: int,
) -> tuple[int, int]:
    """``(match_len, end)``: ``context[end - match_len + 1 : end + 1]`` equals the last
    ``match_len`` tokens, ``end < num_tokens - 1``. Longest ``match_len`` in
    ``[min_n, max_n]``, latest ``end``; ``(0, -1)`` if none.
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
    """Each asked row's draft: ``token_ids`` [num_rows_in_buffer, max_len], ``rows``
    [num_asked], ``limits`` [num_rows]. Writes ``drafts[i, :limit]``,
    ``signals[i, :limit]`` and ``lengths[i]`` (0 where nothing matched)."""
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
    """Call :func:`draft_rows` once per length dtype an engine passes: a kernel's first
    call costs milliseconds beyond its compile (see :mod:`specplugin.host_kernels`)."""
    for lengths in (np.int64, np.int32):
        draft_rows(np.zeros((1, 4), dtype=np.int32), np.full(1, 4, dtype=lengths),
                   np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), 1, 2,
                   np.empty((1, 1), dtype=np.int64), np.empty((1, 1)), np.empty(1, dtype=np.int64))


_warm_up()


class NgramProposer:
    """Drafts by prompt lookup over each request's own prompt and output."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 8, num_alternatives: int = 0):
        """``num_alternatives``: also offer up to that many earlier occurrences' continuations,
        each with a distinct first token."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_alternatives = num_alternatives

    @phase("propose: ngram")
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
        """:meth:`propose` plus earlier occurrences' continuations (vectorised search)."""
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
        """The ``limit`` tokens after a match (``copied``: the context after it), repeated
        periodically past the context's end with halved signal, as :func:`draft_rows` does."""
        token_ids = (copied * (limit // len(copied) + 1))[:limit]
        score = match_len / self.max_n
        own = min(len(copied), limit)
        signal = [score] * own + [0.5 * score] * (limit - own)
        return Candidate(np.array(token_ids, dtype=np.int64), np.array(signal))

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """Nothing kept per request: every proposal reads the context as it is."""

"""Prompt-lookup (n-gram) drafting: copy what followed the last time the context's tail appeared.

For each request the longest suffix of its context (``max_n`` tokens down to
``min_n``) that also occurs earlier in the same context is found, and the tokens
that followed that earlier occurrence become the draft. Among occurrences of the
longest matching suffix the most recent one wins: recent text is the best
predictor of what repeats next (an edit copies the span just quoted; a loop
repeats its last turn).

A match close to the end (a loop) would leave only a few tokens to copy; the
draft then continues the copy periodically (see :meth:`NgramProposer._candidate`).

Each request keeps an index of its own context (:class:`_ContextIndex`): the end
positions of every ``min_n``-gram, fed only the tokens that are new since the last step;
a proposal looks up where the context's last ``min_n`` tokens occurred before and extends
each occurrence to the left, at most ``max_n`` tokens, newest first (a few dict and list
operations: this runs every step right after the target's forward, where each numpy call
costs several microseconds of cold caches). Where the ``min_n``-gram occurred very often
(a run of one repeated token), and for the scorer's alternatives, the search is the
vectorised one, :func:`suffix_match_ends`: ``max_n`` passes of one element-wise
comparison over the context. Both find the same match.

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


# Occurrences of the last min_n tokens past which a proposal searches with numpy.
MAX_SCANNED_OCCURRENCES = 128


class _ContextIndex:
    """One request's context as a list, and the end positions of each ``min_n``-gram."""

    def __init__(self, min_n: int):
        self.min_n = min_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # min_n-gram -> ends, ascending

    def extend(self, new_tokens: list[int]) -> None:
        tokens, ends, n = self.tokens, self.ends, self.min_n
        first = len(tokens)
        tokens += new_tokens
        for e in range(max(first, n - 1), len(tokens)):
            key = tuple(tokens[e - n + 1:e + 1])
            at = ends.get(key)
            if at is None:
                ends[key] = [e]
            else:
                at.append(e)

    def longest_match(self, max_n: int) -> tuple[int, int] | None:
        """:func:`longest_suffix_match` of the context, or None where the search is
        better left to numpy (more than :data:`MAX_SCANNED_OCCURRENCES` occurrences)."""
        tokens, n = self.tokens, self.min_n
        last = len(tokens) - 1
        if last < n:
            return 0, -1
        at = self.ends.get(tuple(tokens[last - n + 1:]))
        if at is None or len(at) < 2:  # only the context's own tail
            return 0, -1
        if len(at) > MAX_SCANNED_OCCURRENCES:
            return None
        best_len, best_end = 0, -1
        for e in reversed(at[:-1]):  # newest first: a tie keeps the later end
            length = n
            while length < max_n and e - length >= 0 and tokens[e - length] == tokens[last - length]:
                length += 1
            if length > best_len:
                best_len, best_end = length, e
                if length == max_n:
                    break
        return best_len, best_end


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
        self._indexes: dict[str, _ContextIndex] = {}  # req id -> its context's index

    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        candidates: list[Candidate | None] = [None] * batch.num_reqs
        for row in batch.rows:
            limit = int(batch.max_draft_lens[row])
            if limit <= 0:
                continue
            context = batch.context(row)
            if not self.num_alternatives:
                index = self._index(batch.req_ids[row], context)
                found = index.longest_match(self.max_n)
                if found is not None:
                    match_len, end = found
                    if match_len:  # (the limit's tokens at most: the rest may be long)
                        candidates[row] = self._candidate(
                            index.tokens[end + 1:end + 1 + limit], match_len, limit)
                    continue
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
        tokens' signal is halved (copied from the draft itself)."""
        token_ids = (copied * (limit // len(copied) + 1))[:limit]
        score = match_len / self.max_n
        own = min(len(copied), limit)
        signal = [score] * own + [0.5 * score] * (limit - own)
        return Candidate(np.array(token_ids, dtype=np.int64), np.array(signal))

    def _index(self, req_id: str, context: np.ndarray) -> _ContextIndex:
        """The request's index, fed the context's new tokens (rebuilt if the context is
        not the one it indexed plus new tokens: shorter, or a different last token)."""
        index = self._indexes.get(req_id)
        fed = 0 if index is None else len(index.tokens)
        if index is None or fed > len(context) or (fed and index.tokens[-1] != context[fed - 1]):
            index = self._indexes[req_id] = _ContextIndex(self.min_n)
            fed = 0
        if len(context) > fed:
            index.extend(context[fed:].tolist())
        return index

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """Drop the requests' context indexes."""
        for req_id in req_ids:
            self._indexes.pop(req_id, None)

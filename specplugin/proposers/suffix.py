"""Suffix drafting: continue the context the way it most often continued before.

**Where it looks.** The request's own context, and a bounded *store* of finished
requests' outputs. In each, the longest context suffix (``min_match`` to ``max_match``
tokens) that occurred before with a token after it is found; the longer match wins,
the request's own context on a tie.

**What it drafts.** A greedy walk, as down a suffix tree: among the places agreeing
with the matched suffix + draft so far, the next token is the most frequent follower::

    support[j]     = places agreeing with draft[:j] that have a (j+1)-th token
    confidence[j]  = (places among them followed by draft[j]) / support[j]

Ties go to the most recent place; stops at ``max_tokens`` or below the (default off)
``min_support`` / ``min_confidence`` floors; counts only the ``max_counted`` latest places.

**Index.** Per text and anchor length (``min_match`` x 1, 2, 4, 8), a hash table from
n-gram to ascending end positions; a lookup takes the longest anchor hit and extends it
left with one numpy gather. A ``SEP`` precedes each output so matches never cross
outputs; the store evicts whole outputs, oldest first.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from specplugin.profiling import phase
from specplugin.proposers.base import Candidate, StepBatch
from specplugin.requests import Requests

SEP = -1  # separator between texts in a buffer: never a token id, so it never matches
_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_IDS.setflags(write=False)


@dataclass(frozen=True)
class SuffixConfig:
    """Matching, drafting and store limits; see the module docstring for what each does."""

    min_match: int = 1
    max_match: int = 32
    min_confidence: float = 0.0
    min_support: int = 1
    max_counted: int = 64
    store_max_tokens: int = 100_000
    store_max_outputs: int = 1_000

    def __post_init__(self):
        for key in ("min_match", "max_match", "min_support", "max_counted"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1; got {value!r}.")
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must be <= max_match "
                             f"({self.max_match}); lower min_match or raise max_match.")
        for key in ("store_max_tokens", "store_max_outputs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0 (0 disables the store); "
                                 f"got {value!r}.")
        c = self.min_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise ValueError(f"min_confidence must be a number from 0 to 1 (0: never stop "
                             f"on confidence); got {c!r}.")

    @property
    def anchor_lens(self) -> tuple[int, ...]:
        """Indexed n-gram lengths: ``min_match`` x 1, 2, 4, 8, at most ``max_match``. None
        past 8x: longer n-grams mostly occur once, and comparison finds them as fast."""
        lens = (self.min_match * factor for factor in (1, 2, 4, 8))
        return tuple(n for n in lens if n <= self.max_match)


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value
class SuffixCandidate:
    """One draft with the evidence behind it (read-only arrays; see the module docstring).

    ``source``: ``"request"``, ``"store"``, or ``"none"`` when nothing matched.
    """

    token_ids: np.ndarray  # [num_tokens] int64
    confidences: np.ndarray  # [num_tokens] float64, each in (0, 1]
    support: np.ndarray  # [num_tokens] int64, each >= 1, non-increasing
    match_len: int
    num_occurrences: int
    source: str
    # less frequent branches of the same walk (_branches)
    alternatives: tuple[SuffixCandidate, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)


def _frozen(values: list, dtype) -> np.ndarray:
    out = np.array(values, dtype=dtype)
    out.setflags(write=False)
    return out


NO_CANDIDATE = SuffixCandidate(_NO_IDS, _frozen([], np.float64), _NO_IDS, 0, 0, "none")


def _add_end(table: dict[int, int | array], key: int, end: int) -> None:
    """Record that n-gram ``key`` ends at ``end``. A single end is a plain int (saves ~80
    bytes; most long n-grams occur once)."""
    ends = table.get(key)
    if ends is None:
        table[key] = end
    elif type(ends) is int:
        table[key] = array("q", (ends, end))
    else:
        ends.append(end)


def _drop_ends_before(table: dict[int, int | array], key: int, stop: int) -> None:
    """Forget the ends of the n-gram ``key`` before position ``stop`` (evicted)."""
    ends = table.get(key)
    if ends is None:
        return
    if type(ends) is int:
        if ends < stop:
            del table[key]
        return
    del ends[: bisect_left(ends, stop)]
    if not ends:
        del table[key]


class _IndexedText:
    """Token ids in a growing buffer, with where each anchor-length n-gram ends.

    Positions are global, never reused: p lives at ``_buf[p - _base]``. Segments start
    after a ``SEP`` (the first live position is one); n-grams never span segments.
    Invariant: a ``SEP`` follows the last token, so reading one past the end is safe.
    """

    def __init__(self, anchor_lens: tuple[int, ...]):
        self.anchor_lens = anchor_lens
        self._ends: dict[int, dict[int, int | array]] = {n: {} for n in anchor_lens}
        self._buf = np.full(64, SEP, dtype=np.int64)  # [capacity]
        self._base = 0  # global position of _buf[0]
        self.num_positions = 0  # global position the next token will take
        self.segment_start = 0  # global position of the current segment's first token

    def tokens(self, positions: np.ndarray) -> np.ndarray:  # same shape as positions
        return self._buf[positions - self._base]

    def span(self, start: int, stop: int) -> np.ndarray:  # [stop - start]
        return self._buf[start - self._base : stop - self._base]

    def start_segment(self) -> None:
        self._write(np.array([SEP], dtype=np.int64))
        self.segment_start = self.num_positions

    def extend(self, token_ids: np.ndarray, index_last: bool = True) -> None:
        """Append ``token_ids`` [num_new] to the current segment and index them.
        ``index_last=False`` leaves the last one out: nothing will ever follow it."""
        start = self.num_positions
        self._write(token_ids)
        stop = self.num_positions if index_last else self.num_positions - 1
        for n, first_end, keys in self._grams(start, stop, self.segment_start):
            table = self._ends[n]
            for end, key in enumerate(keys, first_end):
                _add_end(table, key, end)

    def ends(self, n: int, key: int, keep_last: int | None = None) -> tuple[int, np.ndarray]:
        """``(num_ends, ends)``: places ending n-gram ``key`` with a token after them, and
        their positions ascending (only the last ``keep_last`` if given)."""
        found = self._ends[n].get(key)
        if found is None:
            return 0, _NO_IDS
        if type(found) is int:
            if found == self.num_positions - 1:
                return 0, _NO_IDS
            return 1, np.array([found], dtype=np.int64)
        num = len(found) - (found[-1] == self.num_positions - 1)
        first = 0 if keep_last is None else max(0, num - keep_last)
        # a copy: the array's buffer must stay free to grow
        return num, np.frombuffer(found, np.int64, num - first, 8 * first).copy()

    def tokens_before(self, ends: np.ndarray, back: np.ndarray) -> np.ndarray:
        """``[num_ends, num_back]``: the token ``back[j]`` positions before ``ends[i]``
        (``SEP`` before the first live position)."""
        rel = ends[:, None] - back[None, :] - self._base
        return self._buf[np.maximum(rel, 0)]

    def forget(self, start: int, stop: int) -> None:
        """Drop positions before ``stop`` from the index; ``[start, stop)`` must be the
        oldest live segment (its leading SEP included)."""
        for n, _, keys in self._grams(start + 1, stop, start + 1):
            table = self._ends[n]
            for key in keys:
                _drop_ends_before(table, key, stop)
        live = self.num_positions - stop
        if stop - self._base > live:  # compact: amortised O(1) per token
            self._buf[:live] = self.span(stop, self.num_positions)
            self._buf[live:] = SEP
            self._base = stop

    def windows(self, ends: np.ndarray, num_steps: int, periodic: bool) -> np.ndarray:
        """[num_ends, num_steps]: the tokens after each place (its text ends at its first
        ``SEP``). ``periodic``: a place running into the end repeats its own copy."""
        steps = np.arange(num_steps)
        if periodic:
            period = self.num_positions - 1 - ends  # [num_ends], >= 1
            return self.tokens(ends[:, None] + 1 + steps[None, :] % period[:, None])
        rel = np.minimum(ends[:, None] + 1 + steps[None, :] - self._base,
                         self.num_positions - self._base)  # one past the end reads SEP
        return self._buf[rel]

    def _write(self, token_ids: np.ndarray) -> None:
        used = self.num_positions - self._base
        need = used + len(token_ids) + 1  # + 1: keep a SEP past the end
        if need > len(self._buf):
            grown = np.full(max(need, 2 * len(self._buf)), SEP, dtype=np.int64)
            grown[:used] = self._buf[:used]
            self._buf = grown
        self._buf[used : used + len(token_ids)] = token_ids
        self.num_positions += len(token_ids)

    def _grams(self, start: int, stop: int, segment_start: int):
        """Per anchor length n, ``(n, first_end, keys)``: hashes of the n-grams ending at
        ``first_end .. stop - 1`` inside the segment. Many n-grams are hashed via zip/map,
        a few by slicing (cheaper setup)."""
        first = max(segment_start, start - self.anchor_lens[-1] + 1)
        ids = self.span(first, stop).tolist()
        for n in self.anchor_lens:
            first_end = max(start, segment_start + n - 1)
            if first_end >= stop:
                break
            lo = first_end - n + 1 - first  # ids[lo : lo + n] is the first n-gram
            if stop - first_end <= 4:
                keys = [hash(tuple(ids[i : i + n])) for i in range(lo, len(ids) - n + 1)]
            else:
                keys = map(hash, zip(*(ids[lo + j : len(ids) - n + 1 + j] for j in range(n))))
            yield n, first_end, keys


class _OutputStore:
    """Outputs of finished requests, each its own segment, oldest evicted first."""

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.text = _IndexedText(config.anchor_lens)
        self._segments: deque[tuple[int, int]] = deque()  # (start, stop), oldest first
        self.num_tokens = 0

    @property
    def num_outputs(self) -> int:
        return len(self._segments)

    def add(self, token_ids: np.ndarray) -> None:  # [num_tokens]
        """Store one output (its last ``store_max_tokens`` tokens), then evict to the limits."""
        max_tokens, max_outputs = self.config.store_max_tokens, self.config.store_max_outputs
        if len(token_ids) == 0 or max_tokens == 0 or max_outputs == 0:
            return
        token_ids = token_ids[-max_tokens:]
        start = self.text.num_positions
        self.text.start_segment()
        self.text.extend(token_ids, index_last=False)
        self._segments.append((start, self.text.num_positions))
        self.num_tokens += len(token_ids)
        while self.num_tokens > max_tokens or len(self._segments) > max_outputs:
            old_start, old_stop = self._segments.popleft()
            self.text.forget(old_start, old_stop)
            self.num_tokens -= old_stop - old_start - 1


def _as_token_ids(token_ids: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)  # [num_tokens]
    if ids.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of token ids; got shape {ids.shape}.")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{what} must be token ids >= 0; got {int(ids.min())}.")
    return ids


def _extend_left(text: _IndexedText, ends: np.ndarray, back_ids: np.ndarray, match_len: int,
                 limit: int) -> tuple[int, np.ndarray]:
    """Lengthen a match ending at ``ends`` [num_ends] to at most ``limit`` tokens
    (``back_ids``: the context, last first); keeps the places of the longest agreement."""
    back = np.arange(match_len, limit)  # [width]: distances before a place's last token
    agree = text.tokens_before(ends, back) == back_ids[match_len:limit]  # [num_ends, width]
    run = np.where(agree.all(axis=1), len(back), agree.argmin(axis=1))  # [num_ends]
    best = int(run.max())
    return match_len + best, ends[run == best] if best else ends


def _longest_match(text: _IndexedText, back_ids: np.ndarray, keys: dict[int, int],
                   min_len: int, keep_last: int) -> tuple[int, int, np.ndarray]:
    """``(match_len, num_occurrences, ends)`` of the longest context suffix found in
    ``text`` with a token after it (last ``keep_last`` ends); ``(0, 0, [])`` if none
    reaches ``min_len``."""
    lens, limit = text.anchor_lens, len(back_ids)
    for i in range(len(lens) - 1, -1, -1):
        n = lens[i]
        # the next anchor length did not match, so the match is shorter than it
        upper = min(lens[i + 1] - 1, limit) if i + 1 < len(lens) else limit
        if upper < min_len:
            break
        if n > limit:
            continue
        num, ends = text.ends(n, keys[n], None if upper > n else keep_last)
        if num and upper > n:
            match_len, ends = _extend_left(text, ends, back_ids, n, upper)
            return match_len, len(ends), ends[-keep_last:]
        if num:
            return n, num, ends
    return 0, 0, _NO_IDS


def _most_frequent(values: list[int]) -> tuple[int, int]:
    """``(token, count)``: the most frequent of ``values``; a tie goes to the last one."""
    counts = Counter(values)
    top = max(counts.values())
    return next(t for t in reversed(values) if counts[t] == top), top


def _greedy_walk(windows: np.ndarray, min_confidence: float, min_support: int):
    """Walk ``windows`` [num_places, num_steps] column by column, keeping the places that
    agree; returns lists ``(token_ids, confidences, support)``. Plain Python: for a
    handful of places numpy is 3-4x slower."""
    rows = windows.tolist()
    token_ids, confidences, support = [], [], []
    for step in range(windows.shape[1]):
        if len(rows) == 1:  # one place left: the rest is a plain copy
            rest = rows[0][step:]
            rest = rest[: rest.index(SEP)] if SEP in rest else rest
            if min_support <= 1:
                token_ids += rest
                confidences += [1.0] * len(rest)
                support += [1] * len(rest)
            break
        column = [row[step] for row in rows]
        if column[0] != SEP and column.count(column[0]) == len(column):  # all agree
            token, count, num_values = column[0], len(column), len(column)
        else:
            values = [v for v in column if v != SEP]
            if not values:
                break
            (token, count), num_values = _most_frequent(values), len(values)
        if num_values < min_support or count / num_values < min_confidence:
            break
        token_ids.append(token)
        confidences.append(count / num_values)
        support.append(num_values)
        if count < len(rows):
            rows = [row for row, value in zip(rows, column) if value == token]
    return token_ids, confidences, support


def _branches(windows: np.ndarray, token_ids: list[int], confidences: list[float],
              support: list[int], count: int, min_confidence: float, min_support: int):
    """Up to ``count`` other walks, each starting at a runner-up token where the agreeing
    places disagree (earlier branch points, then more frequent tokens, first)."""
    branches = []
    agree = np.ones(windows.shape[0], dtype=bool)  # [num_places]
    for step, token in enumerate(token_ids):
        if len(branches) == count:
            break
        column = windows[agree, step]  # [num_agreeing]
        values = column[column != SEP]
        for other, n in Counter(values[values != token].tolist()).most_common():
            if len(branches) == count:
                break
            places = windows[agree & (windows[:, step] == other)]  # [n, num_steps]
            ids, conf, sup = _greedy_walk(places[:, step:], min_confidence, min_support)
            if ids:
                conf[0], sup[0] = n / len(values), len(values)  # the branch token's own
                branches.append((token_ids[:step] + ids, confidences[:step] + conf,
                                 support[:step] + sup))
        agree &= windows[:, step] == token
    return branches


class SuffixCache:
    """Per-request suffix indexes plus the cross-request store of finished outputs.

    Lifecycle: :meth:`start_request`, :meth:`add_tokens` / :meth:`propose` per step,
    :meth:`stop_request` (the output joins the store). Not thread-safe.
    """

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        # request id -> (its context, global position where its output starts)
        self._requests: dict[Hashable, tuple[_IndexedText, int]] = {}
        self._store = _OutputStore(self.config)

    def start_request(self, req_id: Hashable,
                      prompt_token_ids: np.ndarray | Sequence[int]) -> None:
        """Index the prompt; a request id that is still active is refused."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already started; call stop_request "
                             "before starting it again.")
        text = _IndexedText(self.config.anchor_lens)
        text.start_segment()
        text.extend(_as_token_ids(prompt_token_ids, "prompt_token_ids"))
        self._requests[req_id] = (text, text.num_positions)

    def add_tokens(self, req_id: Hashable, token_ids: np.ndarray | Sequence[int]) -> None:
        """Append newly emitted output tokens (one or more) to the request's context."""
        self._text(req_id).extend(_as_token_ids(token_ids, "token_ids"))

    def stop_request(self, req_id: Hashable) -> bool:
        """Move the request's output into the store; returns whether it was active."""
        entry = self._requests.pop(req_id, None)
        if entry is None:
            return False
        text, output_start = entry
        self._store.add(text.span(output_start, text.num_positions).copy())
        return True

    def propose(self, req_id: Hashable, max_tokens: int,
                num_alternatives: int = 0) -> SuffixCandidate:
        """At most ``max_tokens`` draft tokens with evidence and up to ``num_alternatives``
        branches (:data:`NO_CANDIDATE` if nothing matched)."""
        text = self._text(req_id)
        if max_tokens <= 0:
            return NO_CANDIDATE
        tail = text.span(max(text.segment_start, text.num_positions - self.config.max_match),
                         text.num_positions)  # [<= max_match]
        tail_ids = tail.tolist()
        keys = {n: hash(tuple(tail_ids[-n:])) for n in text.anchor_lens if n <= len(tail)}
        back_ids, keep = tail[::-1], self.config.max_counted  # [<= max_match]: last first
        match = _longest_match(text, back_ids, keys, self.config.min_match, keep)
        source, source_text = "request", text
        store_match = _longest_match(self._store.text, back_ids, keys, match[0] + 1, keep)
        if store_match[0] > match[0]:  # the longer match wins; a tie goes to the request
            match, source, source_text = store_match, "store", self._store.text
        match_len, num_occurrences, ends = match
        if match_len == 0:
            return NO_CANDIDATE
        windows = source_text.windows(ends, max_tokens, periodic=source == "request")
        ids, confidences, support = _greedy_walk(windows, self.config.min_confidence,
                                                 self.config.min_support)
        branches = _branches(windows, ids, confidences, support, num_alternatives,
                             self.config.min_confidence, self.config.min_support)
        return SuffixCandidate(
            _frozen(ids, np.int64), _frozen(confidences, np.float64), _frozen(support, np.int64),
            match_len, num_occurrences, source,
            tuple(SuffixCandidate(_frozen(b_ids, np.int64), _frozen(b_conf, np.float64),
                                  _frozen(b_sup, np.int64), match_len, num_occurrences, source)
                  for b_ids, b_conf, b_sup in branches))

    def _text(self, req_id: Hashable) -> _IndexedText:
        entry = self._requests.get(req_id)
        if entry is None:
            raise ValueError(f"request {req_id!r} was never started (or already stopped); "
                             "call start_request with its prompt first.")
        return entry[0]


def _as_candidate(found: SuffixCandidate, alternatives: tuple[Candidate, ...] = ()) -> Candidate:
    count = found.confidences * found.support
    signal = (count + 1.0) / (found.support + 2.0)
    return Candidate(np.array(found.token_ids, dtype=np.int64), signal, alternatives)


class ArcticSuffixIndex:
    """:class:`SuffixCache`'s role on ``arctic_inference``'s C++ suffix trees, where installed.

    Same two texts and greedy walk at ~1/3 the cost; no per-token support (the signal is
    the walk's frequency) and no alternative branches."""

    def __init__(self, config: SuffixConfig):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.config = config
        self._cache = SuffixDecodingCache(max_tree_depth=config.max_match,
                                          max_cached_requests=config.store_max_outputs)
        # private fields of the cache (None if this arctic_inference lacks them)
        self._trees = _split_trees(self._cache)
        self._global_feed: list[tuple[int, list[int]]] = []  # (output's sequence id, tokens)

    def start_request(self, req_id: Hashable, prompt_token_ids: np.ndarray) -> None:
        self.extend_outputs()  # (a start may evict an output: its sequence ids change)
        if req_id in self._cache.cached_requests:  # an id seen before: its old output goes
            self._cache.evict_cached_response(req_id)
        self._cache.start_request(req_id, np.ascontiguousarray(prompt_token_ids, np.int32))

    def add_tokens(self, req_id: Hashable, token_ids: np.ndarray) -> None:
        """Extend the request's own tree now; the tree of all outputs later, at
        :meth:`extend_outputs` (it may lag a step, and costs twice as much)."""
        # a list: the array path validates in Python
        tokens = np.asarray(token_ids).tolist()
        if self._trees is None:
            self._cache.add_active_response(req_id, tokens)
            return
        tree_type, local_trees, _, seq_ids = self._trees
        tree_type.extend(local_trees[req_id], 0, tokens)
        seq_id = seq_ids.get(req_id)  # (None: the store is off, or evicted it already)
        if seq_id is not None:
            self._global_feed.append((seq_id, tokens))

    @property
    def outputs_behind(self) -> bool:
        """Tokens wait for the tree of all outputs (:meth:`extend_outputs`)."""
        return bool(self._global_feed)

    def extend_outputs(self) -> None:
        """Feed the held-back tokens to the tree of all outputs. :meth:`start_request` (the
        only evicting call) runs this first, so no held token belongs to an evicted output."""
        feed, self._global_feed = self._global_feed, []
        if feed:
            tree_type, _, global_tree, _ = self._trees
            for seq_id, tokens in feed:
                tree_type.extend(global_tree, seq_id, tokens)

    def stop_request(self, req_id: Hashable) -> None:
        if req_id in self._cache.active_requests:
            self._cache.stop_request(req_id)

    def propose(self, req_id: Hashable, context: np.ndarray,  # [num_tokens]
                max_tokens: int) -> Candidate | None:
        pattern = np.ascontiguousarray(context[-self.config.max_match:], np.int32)
        # no length cap, no frequency floor: what is worth verifying is the controller's call
        draft = self._speculate(req_id, pattern, max_tokens)
        token_ids = draft.token_ids  # (a new list at each read)
        if not token_ids or draft.match_len < self.config.min_match:
            return None
        return Candidate(np.array(token_ids, dtype=np.int64),
                         np.array(draft.probs, dtype=np.float64))

    def _speculate(self, req_id: Hashable, pattern: np.ndarray,  # [<= max_match] int32
                   max_tokens: int):
        """The cache's ``speculate`` bypassing its (costly) wrapper when the trees are
        reachable: the higher-scoring of both trees' drafts, the request's own on a tie. A
        score is a sum of probabilities <= 1, so ``max_tokens`` is unbeatable."""
        factor = float(max_tokens)
        if self._trees is None:
            return self._cache.speculate(req_id, pattern, max_spec_tokens=max_tokens,
                                         max_spec_factor=factor, min_token_prob=0.0)
        tree_type, local_trees, global_tree, _ = self._trees
        own = tree_type.speculate_ndarray(local_trees[req_id], pattern, max_tokens, factor,
                                          0.0, 0.0, False)
        own_score = own.score
        if own_score >= max_tokens:  # every token certain: no draft scores higher (see above)
            return own
        stored = tree_type.speculate_ndarray(global_tree, pattern, max_tokens, factor,
                                             0.0, 0.0, False)
        return own if own_score >= stored.score else stored


def _split_trees(cache):
    """(tree type, per-request trees, tree of all outputs, request -> sequence id) of an
    ``arctic_inference`` cache; None where its private fields differ from 0.3.0's (then
    the public calls are used)."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree

        fields = (SuffixTree, cache._local_trees, cache._global_tree, cache._req_to_seq_id)
    except (ImportError, AttributeError):
        return None
    native = ("extend", "speculate_ndarray")
    return fields if all(callable(getattr(SuffixTree, n, None)) for n in native) else None


def _run_now(job: Callable[[], None]) -> None:
    job()


def arctic_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except Exception:  # not installed, or built for another torch: the Python index
        return False
    return True


class SuffixProposer:
    """A suffix index behind the :class:`~specplugin.proposers.base.Proposer` interface.

    Signal per token: rule of succession ``(count + 1) / (support + 2)`` (1 in 1 scores
    2/3, 50 in 50 scores 0.98); with the arctic index, the walk's frequency alone.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None, num_alternatives: int = 0,
                 index: str = "auto", requests: Requests | None = None):
        """``num_alternatives``: up to that many less frequent branches per walk. ``index``:
        ``"python"``, ``"arctic"``, or ``"auto"`` (arctic if installed and no alternatives).
        ``requests``: the running requests' records, where each one's feed position is kept
        (default: the proposer's own)."""
        if index not in ("auto", "python", "arctic"):
            raise ValueError(f"suffix index must be auto, python or arctic; got {index!r}.")
        if index == "auto":
            index = "arctic" if not num_alternatives and arctic_available() else "python"
        if index == "arctic" and num_alternatives:
            raise ValueError("the arctic suffix index offers no alternatives: use "
                             "index='python' with num_alternatives > 0.")
        self.index = index
        self.cache = (ArcticSuffixIndex(config or SuffixConfig()) if index == "arctic"
                      else SuffixCache(config))
        self.num_alternatives = num_alternatives
        self.requests = requests if requests is not None else Requests()
        # where deferrable work goes (see Proposer)
        self.defer: Callable[[Callable[[], None]], None] = _run_now

    @phase("propose: suffix")
    def propose(self, batch: StepBatch) -> list[Candidate | None]:
        for row, req_id in enumerate(batch.req_ids):
            self._feed(req_id, batch.context(row), int(batch.num_prompt_tokens[row]))
        candidates: list[Candidate | None] = [None] * batch.num_reqs
        if self.index == "arctic":
            for row in batch.rows:
                candidates[row] = self.cache.propose(batch.req_ids[row], batch.context(row),
                                                     int(batch.max_draft_lens[row]))
            if self.cache.outputs_behind:
                self.defer(self.cache.extend_outputs)
            return candidates
        for row in batch.rows:
            found = self.cache.propose(batch.req_ids[row], int(batch.max_draft_lens[row]),
                                       self.num_alternatives)
            if len(found):
                candidates[row] = _as_candidate(found, tuple(
                    _as_candidate(b) for b in found.alternatives))
        return candidates

    def _feed(self, req_id: str, context: np.ndarray, num_prompt_tokens: int) -> None:
        state = self.requests[req_id]
        fed = state.suffix_fed
        if fed is None or fed > len(context):  # new (or restarted from its prompt)
            if fed is not None:
                self.cache.stop_request(req_id)
            fed = min(num_prompt_tokens, len(context))
            self.cache.start_request(req_id, context[:fed])
        if len(context) > fed:
            self.cache.add_tokens(req_id, context[fed:])
        state.suffix_fed = len(context)

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None and state.suffix_fed is not None:
                state.suffix_fed = None
                self.cache.stop_request(req_id)

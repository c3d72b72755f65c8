"""The n-gram matcher on hand-built token lists, and against a brute-force oracle."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specplugin.proposers import StepBatch
from specplugin.proposers.ngram import NgramProposer, longest_suffix_match


def _batch(contexts: list[list[int]], k: int = 4, max_model_len: int = 64, rows=None):
    token_ids = np.zeros((len(contexts) + 2, max_model_len), dtype=np.int32)
    for i, c in enumerate(contexts):
        token_ids[i, : len(c)] = c
    num_tokens = np.array([len(c) for c in contexts])
    max_draft_lens = np.clip(max_model_len - num_tokens, 0, k)
    rows = tuple(range(len(contexts))) if rows is None else tuple(rows)
    num = len(contexts)
    return StepBatch(tuple(f"r{i}" for i in range(num)), token_ids, num_tokens,
                     np.zeros(num, dtype=int), max_draft_lens, np.zeros(num, dtype=bool), rows)


def propose(contexts, k=4, min_n=2, max_n=8, **kw):
    candidates = NgramProposer(min_n, max_n).propose(_batch(contexts, k, **kw))
    return [[] if c is None else c.token_ids.tolist() for c in candidates]


def test_signal_is_match_length_and_halves_past_the_end_of_the_context():
    [c] = NgramProposer(2, 4).propose(_batch([[1, 2, 3, 9, 1, 2, 3]], k=6))
    assert c.token_ids.tolist() == [9, 1, 2, 3, 9, 1]
    assert c.signal.tolist() == [0.75] * 4 + [0.375] * 2  # 9 1 2 3 are in the context


def test_no_match_gives_empty_draft():
    assert propose([[1, 2, 3, 4, 5, 6]]) == [[]]


def test_single_match_copies_what_followed():
    assert propose([[1, 2, 3, 9, 8, 7, 6, 1, 2, 3]]) == [[9, 8, 7, 6]]


def test_longest_match_wins_over_more_recent_shorter_one():
    # suffix [5, 1, 2] occurs at the start (followed by 7); [1, 2] alone more recently (followed by 9)
    ctx = [5, 1, 2, 7, 7, 7, 1, 2, 9, 9, 5, 1, 2]
    assert propose([ctx], k=2, min_n=2) == [[7, 7]]


def test_most_recent_of_equally_long_matches_wins():
    ctx = [1, 2, 10, 11, 0, 1, 2, 20, 21, 0, 1, 2]
    assert propose([ctx], k=2, max_n=2) == [[20, 21]]


def test_match_at_the_very_end_continues_periodically():
    # a loop: the latest match leaves one token to copy; the draft keeps repeating the period
    assert propose([[4, 4, 4, 4]], k=5) == [[4, 4, 4, 4, 4]]
    assert propose([[1, 2, 3, 1, 2, 3, 1, 2]], k=5) == [[3, 1, 2, 3, 1]]


def test_min_n_is_respected():
    ctx = [1, 2, 9, 3, 2]  # only a 1-token match ([2])
    assert propose([ctx], min_n=2) == [[]]
    # copies what followed the earlier [2], then keeps repeating that period
    assert propose([ctx], min_n=1) == [[9, 3, 2, 9]]


def test_drafts_cut_at_model_length_limit():
    ctx = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert propose([ctx], k=8, max_model_len=11) == [[4, 5]]
    assert propose([ctx], k=8, max_model_len=9) == [[]]


def test_empty_and_tiny_contexts():
    assert propose([[], [7], [7, 7]], min_n=1) == [[], [], [7, 7, 7, 7]]


def test_rows_not_requested_get_no_draft():
    ctx = [1, 2, 3, 1, 2]
    assert propose([ctx, ctx], rows=[1]) == [[], [3, 1, 2, 3]]


def _oracle(ctx: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """Brute force: longest n, then latest end, among earlier occurrences of the suffix."""
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        suffix = ctx[len(ctx) - n :]
        ends = [e for e in range(n - 1, len(ctx) - 1) if ctx[e - n + 1 : e + 1] == suffix]
        if ends:
            return n, ends[-1]
    return 0, -1


@settings(max_examples=300, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
)
def test_matcher_agrees_with_brute_force(ctx, min_n, extra):
    got = longest_suffix_match(np.array(ctx, dtype=np.int32), min_n, min_n + extra)
    assert got == _oracle(ctx, min_n, min_n + extra)


def test_alternatives_are_earlier_matches_that_go_on_differently():
    # "1 2" occurs three times before the tail: followed by 3, then 4, then 3 again
    context = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 8, 1, 2]
    [cand] = NgramProposer(min_n=2, max_n=2, num_alternatives=2).propose(_batch([context], k=3))
    assert cand.token_ids.tolist() == [3, 8, 1]  # the most recent occurrence
    assert [a.token_ids.tolist() for a in cand.alternatives] == [[4, 9, 1]]  # not "3" again
    [plain] = NgramProposer(min_n=2, max_n=2).propose(_batch([context], k=3))
    assert plain.token_ids.tolist() == [3, 8, 1] and plain.alternatives == ()


def _expected_draft(ctx: list[int], min_n: int, max_n: int, limit: int) -> tuple[list, list]:
    """The draft and signal the proposer's docstring defines, from the vectorised search."""
    match_len, end = longest_suffix_match(np.array(ctx, dtype=np.int64), min_n, max_n)
    if not match_len or limit <= 0:
        return [], []
    copied = ctx[end + 1:end + 1 + limit]
    tokens = [copied[j % len(copied)] for j in range(limit)]
    score = match_len / max_n
    return tokens, [score if j < len(copied) else 0.5 * score for j in range(limit)]


@settings(max_examples=300, deadline=None)
@given(
    contexts=st.lists(st.lists(st.integers(0, 3), max_size=60), min_size=1, max_size=4),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
    limits=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    engine_dtypes=st.booleans(),
)
def test_the_compiled_search_drafts_what_the_vectorised_search_finds(contexts, min_n, extra,
                                                                      limits, engine_dtypes):
    """Every row of a batch in one compiled call: the tokens after the longest match (the
    vectorised search's), periodic where they run into the context's end, and their
    signals; in the engine's buffers (int32 tokens and lengths) and in int64 ones."""
    dtype = np.int32 if engine_dtypes else np.int64
    token_ids = np.full((len(contexts) + 1, 64), 7, dtype=dtype)  # (7: never in a context)
    for r, c in enumerate(contexts):
        token_ids[r, :len(c)] = c
    num_tokens = np.array([len(c) for c in contexts], dtype=dtype)
    max_draft_lens = np.array(limits[:len(contexts)], dtype=np.int64)
    batch = StepBatch(tuple(f"r{r}" for r in range(len(contexts))), token_ids, num_tokens,
                      np.zeros(len(contexts), dtype=np.int64), max_draft_lens,
                      np.zeros(len(contexts), dtype=bool), tuple(range(len(contexts))))
    got = NgramProposer(min_n, min_n + extra).propose(batch)
    for c, limit, cand in zip(contexts, max_draft_lens.tolist(), got):
        tokens, signal = _expected_draft(c, min_n, min_n + extra, limit)
        assert ([] if cand is None else cand.token_ids.tolist()) == tokens
        assert ([] if cand is None else cand.signal.tolist()) == signal


def test_the_proposer_reads_each_context_as_it_is_now():
    """Nothing is kept per request: a request whose context changed (a new one under the
    same id) is matched on what it holds now."""
    proposer = NgramProposer(2, 4)
    first = proposer.propose(_batch([[1, 2, 3, 9, 1, 2]], k=3))
    assert first[0].token_ids.tolist() == [3, 9, 1]
    grown = proposer.propose(_batch([[1, 2, 3, 9, 1, 2, 3, 9]], k=3))
    assert grown[0].token_ids.tolist() == [1, 2, 3]
    other = proposer.propose(_batch([[5, 6, 7, 5, 6, 8, 8, 5, 6]], k=2))
    assert other[0].token_ids.tolist() == [8, 8]
    proposer.finish_requests(["r0"])


def test_an_older_longer_match_wins_over_a_newer_shorter_one():
    # "2 3" ends at 2 and 5; "1 2 3" at 2 only
    context = [1, 2, 3, 0, 2, 3, 9, 1, 2, 3]
    assert longest_suffix_match(np.array(context), 2, 3) == (3, 2)
    assert propose([context], k=3, min_n=2, max_n=3) == [[0, 2, 3]]

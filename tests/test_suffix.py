"""The suffix cache on hand-built token lists, and against a brute-force oracle."""

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specplugin.proposers.suffix import SuffixCache, SuffixConfig


def _cache(finished=(), **config) -> SuffixCache:
    """A cache whose store holds the outputs of ``finished`` (prompt, output) pairs."""
    cache = SuffixCache(SuffixConfig(**config))
    for i, (prompt, output) in enumerate(finished):
        cache.start_request(f"old{i}", prompt)
        if output:
            cache.add_tokens(f"old{i}", output)
        cache.stop_request(f"old{i}")
    return cache


def _propose(context, k=4, finished=(), **config):
    cache = _cache(finished, **config)
    cache.start_request("r", context)
    return cache.propose("r", k)


def test_copies_from_own_prompt():
    got = _propose([1, 2, 3, 9, 8, 7, 6, 1, 2, 3])
    assert got.token_ids.tolist() == [9, 8, 7, 6]
    assert got.confidences.tolist() == [1.0] * 4 and got.support.tolist() == [1] * 4
    assert (got.match_len, got.num_occurrences, got.source) == (3, 1, "request")


def test_copies_from_an_earlier_requests_output_after_it_stopped():
    cache = SuffixCache()
    cache.start_request("a", [100, 101])
    cache.add_tokens("a", [5, 6])
    cache.add_tokens("a", [7, 8, 9])
    cache.start_request("b", [20, 5, 6])
    assert len(cache.propose("b", 4)) == 0  # a's output joins the store only when a stops
    assert cache.stop_request("a")
    got = cache.propose("b", 4)
    # the copy ends with a's output: the store does not run on into other texts
    assert got.token_ids.tolist() == [7, 8, 9]
    assert (got.match_len, got.num_occurrences, got.source) == (2, 1, "store")
    assert (cache._store.num_outputs, cache._store.num_tokens) == (1, 5)


def test_a_match_at_the_end_of_a_stored_output_is_no_place():
    # [1, 2] ends the first output, so nothing follows it there; the shorter [2] does go on
    got = _propose([1, 2], k=2, finished=[([0], [1, 2]), ([0], [2, 7]), ([0], [4])])
    assert got.token_ids.tolist() == [7]
    assert (got.match_len, got.num_occurrences, got.source) == (1, 1, "store")


def test_prompts_do_not_join_the_store():
    got = _propose([3, 100], finished=[([100, 101, 102], [7])])
    assert len(got) == 0 and got.source == "none"


def test_prefers_the_most_frequent_continuation_and_reports_its_frequency():
    # [5, 1] occurred three times, followed by 7, 7, 9; after [5, 1, 7]: 11 once, 12 once
    ctx = [10, 5, 1, 7, 11, 5, 1, 7, 12, 5, 1, 9, 13, 5, 1]
    got = _propose(ctx, k=3)
    assert got.token_ids.tolist() == [7, 12, 5]  # the tie 11 / 12 goes to the most recent
    np.testing.assert_allclose(got.confidences, [2 / 3, 1 / 2, 1.0])
    assert got.support.tolist() == [3, 2, 1]
    assert (got.match_len, got.num_occurrences) == (2, 3)


def test_frequencies_count_across_stored_outputs():
    finished = [([0], [5, 1, 7]), ([0], [5, 1, 9]), ([0], [5, 1, 7, 8])]
    got = _propose([3, 5, 1], k=3, finished=finished)
    # 7 follows twice in three; then only one of the two places goes on (with 8)
    assert got.token_ids.tolist() == [7, 8]
    np.testing.assert_allclose(got.confidences, [2 / 3, 1.0])
    assert got.support.tolist() == [3, 1] and got.source == "store"


def test_min_confidence_and_min_support_stop_the_draft():
    ctx = [10, 5, 1, 7, 11, 5, 1, 7, 12, 5, 1, 9, 13, 5, 1]
    assert _propose(ctx, k=3, min_confidence=0.6).token_ids.tolist() == [7]
    assert _propose(ctx, k=3, min_confidence=0.7).token_ids.tolist() == []
    assert _propose(ctx, k=3, min_support=2).token_ids.tolist() == [7, 12]
    assert _propose(ctx, k=3, min_support=4).token_ids.tolist() == []


def test_max_counted_keeps_the_most_recent_places():
    ctx = [10, 5, 1, 7, 11, 5, 1, 7, 12, 5, 1, 9, 13, 5, 1]
    got = _propose(ctx, k=1, max_counted=1)
    assert got.token_ids.tolist() == [9] and got.num_occurrences == 3
    got = _propose(ctx, k=1, max_counted=2)  # 7 then 9: a tie, the most recent wins
    assert got.token_ids.tolist() == [9] and got.confidences.tolist() == [0.5]


def test_no_match_gives_an_empty_candidate():
    got = _propose([1, 2, 3, 4, 5])
    assert len(got) == 0 and got.confidences.shape == (0,)
    assert (got.match_len, got.num_occurrences, got.source) == (0, 0, "none")
    assert len(_propose([])) == 0


def test_min_match_is_respected():
    assert len(_propose([1, 2, 9, 3, 2], min_match=2)) == 0
    assert _propose([1, 2, 9, 3, 2], min_match=1).token_ids.tolist() == [9, 3, 2, 9]


def test_max_tokens_zero_gives_an_empty_candidate():
    assert len(_propose([1, 2, 1, 2], k=0)) == 0


def test_loops_continue_periodically():
    assert _propose([4, 4, 4, 4], k=5).token_ids.tolist() == [4] * 5
    assert _propose([1, 2, 3, 1, 2, 3, 1, 2], k=5).token_ids.tolist() == [3, 1, 2, 3, 1]


def test_longer_match_wins_across_sources_and_a_tie_goes_to_the_request():
    finished = [([0], [1, 2, 3, 50])]
    # own context matches [2, 3] only, the store [1, 2, 3]
    assert _propose([9, 2, 3, 60, 7, 1, 2, 3], k=1, finished=finished).token_ids.tolist() == [50]
    got = _propose([1, 2, 3, 60, 7, 1, 2, 3], k=1, finished=finished)
    assert got.token_ids.tolist() == [60] and got.source == "request"


def test_oldest_outputs_are_evicted_first():
    finished = [([0], [1, 2, 10, 11]), ([0], [1, 2, 20, 21]), ([0], [1, 2, 30, 31])]
    by_count = _cache(finished, store_max_outputs=2)
    by_tokens = _cache(finished, store_max_tokens=9)  # 4 + 4 fit, 4 + 4 + 4 do not
    for cache in (by_count, by_tokens):
        assert (cache._store.num_outputs, cache._store.num_tokens) == (2, 8)
        cache.start_request("r", [1, 2])
        got = cache.propose("r", 1)
        assert got.num_occurrences == 2 and got.token_ids.tolist() == [30]
        cache.start_request("s", [10])  # the evicted output's text is gone too
        assert len(cache.propose("s", 1)) == 0


def test_a_copy_from_the_newest_output_ends_with_it_after_evictions():
    # evicting the long first output compacts the store's buffer; the copy must still stop
    cache = _cache([([0], list(range(1, 11))), ([0], [7, 8])], store_max_outputs=1)
    cache.start_request("r", [7])
    assert cache.propose("r", 3).token_ids.tolist() == [8]


def test_an_output_longer_than_the_store_keeps_its_last_tokens():
    cache = _cache([([0], [1, 2, 3, 4, 5, 6])], store_max_tokens=3)
    assert cache._store.num_tokens == 3
    cache.start_request("r", [4, 5])
    assert cache.propose("r", 2).token_ids.tolist() == [6]
    cache.start_request("s", [2, 3])
    assert len(cache.propose("s", 2)) == 0


def test_a_disabled_store_keeps_nothing():
    cache = _cache([([0], [1, 2, 3])], store_max_tokens=0)
    assert cache._store.num_outputs == 0


def test_unknown_request_ids():
    cache = SuffixCache()
    with pytest.raises(ValueError, match="never started"):
        cache.propose("nope", 4)
    with pytest.raises(ValueError, match="never started"):
        cache.add_tokens("nope", [1])
    assert cache.stop_request("nope") is False  # ignored: aborted before its first step
    cache.start_request("r", [1])
    assert "r" in cache._requests and "nope" not in cache._requests
    with pytest.raises(ValueError, match="already started"):
        cache.start_request("r", [1])
    assert cache.stop_request("r") is True
    with pytest.raises(ValueError, match="never started"):
        cache.propose("r", 4)


def test_bad_token_ids_and_configs_are_refused():
    cache = SuffixCache()
    with pytest.raises(ValueError, match=">= 0"):
        cache.start_request("r", [1, -1])
    with pytest.raises(ValueError, match="flat"):
        cache.start_request("r", [[1, 2]])
    with pytest.raises(ValueError, match="min_match"):
        SuffixConfig(min_match=4, max_match=2)
    with pytest.raises(ValueError, match="min_confidence"):
        SuffixConfig(min_confidence=1.5)
    with pytest.raises(ValueError, match="store_max_tokens"):
        SuffixConfig(store_max_tokens=-1)


def test_candidate_arrays_are_read_only_with_their_dtypes():
    got = _propose([1, 2, 3, 1, 2])
    assert got.token_ids.dtype == np.int64 and got.confidences.dtype == np.float64
    with pytest.raises(ValueError):
        got.token_ids[0] = 0


def test_very_long_context_is_matched_far_back():
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 50_000, size=20_000)
    ctx[-12:] = ctx[100:112]
    cache = SuffixCache()
    cache.start_request("r", ctx[:10_000])
    for start in range(10_000, 20_000, 1_000):
        cache.add_tokens("r", ctx[start : start + 1_000])
    got = cache.propose("r", 8)
    assert got.token_ids.tolist() == ctx[112:120].tolist() and got.match_len >= 12


def test_anchor_lengths_cover_min_to_max_match():
    assert SuffixConfig(min_match=1, max_match=32).anchor_lens == (1, 2, 4, 8)
    assert SuffixConfig(min_match=3, max_match=20).anchor_lens == (3, 6, 12)
    assert SuffixConfig(min_match=3, max_match=3).anchor_lens == (3,)


# ---- brute-force oracle: the rule of the module docstring, written plainly ----

def _places(texts, suffix):
    """(text index, end) of every occurrence of ``suffix`` followed by a token, in order."""
    n = len(suffix)
    return [(t, e) for t, text in enumerate(texts) for e in range(n - 1, len(text) - 1)
            if text[e - n + 1 : e + 1] == suffix]


def _longest(texts, context, min_match, max_match):
    for n in range(min(max_match, len(context)), min_match - 1, -1):
        places = _places(texts, context[len(context) - n :])
        if places:
            return n, places
    return 0, []


def _walk(texts, places, k, min_confidence, min_support, periodic_text):
    draft, confidences, support = [], [], []

    def next_token(place, j):
        t, e = place
        # the request's own text goes on with the draft itself
        text = texts[t] + draft if t == periodic_text else texts[t]
        return text[e + 1 + j] if e + 1 + j < len(text) else None

    for j in range(k):
        values = [v for v in (next_token(p, j) for p in places) if v is not None]
        if not values or len(values) < min_support:
            break
        counts = Counter(values)
        top = max(counts.values())
        token = next(v for v in reversed(values) if counts[v] == top)  # tie: most recent place
        if top / len(values) < min_confidence:
            break
        draft.append(token)
        confidences.append(top / len(values))
        support.append(len(values))
        places = [p for p in places if next_token(p, j) == token]
    return draft, confidences, support


def _oracle(finished, context, k, cfg: SuffixConfig):
    store = []
    for _, output in finished:
        output = output[-cfg.store_max_tokens :] if cfg.store_max_tokens else []
        if output and cfg.store_max_outputs:
            store.append(output)
        while sum(map(len, store)) > cfg.store_max_tokens or len(store) > cfg.store_max_outputs:
            store.pop(0)
    own_len, own_places = _longest([context], context, cfg.min_match, cfg.max_match)
    store_len, store_places = _longest(store, context, cfg.min_match, cfg.max_match)
    if store_len > own_len:
        texts, places, periodic, match_len = store, store_places, None, store_len
    else:
        texts, places, periodic, match_len = [context], own_places, 0, own_len
    if match_len == 0 or k == 0:
        return [], [], [], match_len, len(places)
    walk = _walk(texts, places[-cfg.max_counted :], k, cfg.min_confidence, cfg.min_support,
                 periodic)
    return (*walk, match_len, len(places))


_tokens = st.lists(st.integers(0, 3), max_size=24)


@settings(max_examples=300, deadline=None)
@given(
    finished=st.lists(st.tuples(_tokens, _tokens), max_size=6),
    prompt=_tokens,
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=5),
    k=st.integers(0, 6),
    min_match=st.integers(1, 3),
    extra=st.integers(0, 6),
    min_confidence=st.sampled_from([0.0, 0.4, 0.6]),
    min_support=st.integers(1, 3),
    max_counted=st.sampled_from([1, 3, 64]),
    store_max_tokens=st.integers(0, 40),
    store_max_outputs=st.integers(0, 3),
)
def test_agrees_with_brute_force(finished, prompt, chunks, k, min_match, extra, min_confidence,
                                 min_support, max_counted, store_max_tokens, store_max_outputs):
    cfg = SuffixConfig(min_match=min_match, max_match=min_match + extra,
                       min_confidence=min_confidence, min_support=min_support,
                       max_counted=max_counted, store_max_tokens=store_max_tokens,
                       store_max_outputs=store_max_outputs)
    cache = _cache(finished, **dataclasses.asdict(cfg))
    cache.start_request("r", prompt)
    context = list(prompt)
    for chunk in [[]] + chunks:  # propose after the prompt and after every step
        cache.add_tokens("r", np.array(chunk, dtype=np.int64))
        context += chunk
        got = cache.propose("r", k)
        ids, confidences, support, match_len, num_occurrences = _oracle(finished, context, k, cfg)
        assert got.token_ids.tolist() == ids
        np.testing.assert_allclose(got.confidences, confidences)
        assert got.support.tolist() == support
        if k:
            assert (got.match_len, got.num_occurrences) == (match_len, num_occurrences)


# ------------------------------------------------------------------ the Proposer adapter


def _step(req_ids, contexts, num_prompt, k=4):
    from specplugin.proposers.base import StepBatch

    n = len(contexts)
    buf = np.zeros((n, 64), dtype=np.int32)
    for i, c in enumerate(contexts):
        buf[i, : len(c)] = c
    return StepBatch(tuple(req_ids), buf, np.array([len(c) for c in contexts]),
                     np.array(num_prompt), np.full(n, k), np.zeros(n, dtype=bool),
                     tuple(range(n)))


def test_adapter_feeds_the_cache_from_the_batch_and_stores_finished_outputs():
    from specplugin.proposers.suffix import SuffixProposer

    p = SuffixProposer(index="python")
    # request a: prompt [1, 2], then it generates 3 4 5 6 over two steps
    p.propose(_step(["a"], [[1, 2, 3, 4]], [2]))
    p.propose(_step(["a"], [[1, 2, 3, 4, 5, 6]], [2]))
    p.finish_requests(["a"])
    # request b: a different prompt that ends where a's output went on: copies from the store
    [cand] = p.propose(_step(["b"], [[9, 9, 3, 4]], [4]))
    assert cand.token_ids.tolist() == [5, 6]
    assert np.all((cand.signal > 0.5) & (cand.signal < 1.0))  # seen once: (1 + 1) / (1 + 2)
    p.finish_requests(["b", "never-seen"])  # unknown ids are ignored


def test_the_cpp_index_copies_from_the_request_and_the_store_like_the_python_one():
    """arctic_inference's suffix trees (installed by scripts/install.sh) behind the same
    adapter: the same feed, the same store of finished outputs, a loop continued
    periodically; picked by default where no alternatives are asked."""
    from specplugin.proposers.suffix import SuffixProposer, arctic_available

    assert arctic_available(), "arctic-inference is not importable (see .venv/arctic-inference-build.log)"
    assert SuffixProposer().index == "arctic"
    assert SuffixProposer(num_alternatives=1).index == "python"  # it has no alternatives
    for index in ("arctic", "python"):
        p = SuffixProposer(index=index)
        assert p.propose(_step(["a"], [[1, 2, 3, 4]], [2])) == [None]
        p.propose(_step(["a"], [[1, 2, 3, 4, 5, 6]], [2]))
        p.finish_requests(["a"])
        [cand] = p.propose(_step(["b"], [[9, 9, 3, 4]], [4]))
        assert cand.token_ids.tolist() == [5, 6], index
        assert np.all((cand.signal > 0.5) & (cand.signal <= 1.0))
        [loop] = p.propose(_step(["c"], [[1, 2, 7, 1, 2, 7, 1, 2]], [3], k=6))
        assert loop.token_ids.tolist() == [7, 1, 2, 7, 1, 2], index
        p.finish_requests(["b", "c", "never-seen"])
    with pytest.raises(ValueError, match="index"):
        SuffixProposer(index="tree")
    with pytest.raises(ValueError, match="alternatives"):
        SuffixProposer(index="arctic", num_alternatives=1)


def test_the_cpp_index_asks_its_trees_as_arctics_own_speculate_does():
    """The proposal calls arctic's native trees directly (its wrapper's checks cost the
    step): on repetitive random texts, some copying earlier outputs, every draft equals
    the public ``speculate``'s, tokens, probabilities and match length (seen red with the
    tie going to the tree of outputs, with a probability floor of 0.5, and with the tree of
    outputs left unasked for a draft one token short of certain)."""
    from specplugin.proposers.suffix import ArcticSuffixIndex

    rng = np.random.default_rng(3)
    index = ArcticSuffixIndex(SuffixConfig())
    assert index._trees is not None, "arctic_inference's fields moved: the direct path is off"
    shared = rng.integers(0, 12, size=60)
    compared = found = 0
    for r in range(12):
        req = f"r{r}"
        text = np.concatenate([rng.integers(0, 12, size=8), shared[rng.integers(0, 30):][:20]])
        index.start_request(req, text[:5].astype(np.int64))
        for end in range(6, len(text) + 1):
            index.add_tokens(req, text[end - 1:end])
            context = text[:end]
            pattern = np.ascontiguousarray(context[-index.config.max_match:], np.int32)
            for k in (1, 4, 8):
                direct = index._speculate(req, pattern, k)
                public = index._cache.speculate(req, pattern, max_spec_tokens=k,
                                                max_spec_factor=float(k), min_token_prob=0.0)
                assert list(direct.token_ids) == list(public.token_ids), (req, end, k)
                assert list(direct.probs) == list(public.probs), (req, end, k)
                assert direct.match_len == public.match_len
                compared += 1
                found += bool(public.token_ids)
            if r % 3 == 0:
                index.extend_outputs()  # (the tree of outputs sometimes up to date)
        index.extend_outputs()
        index.stop_request(req)
    assert compared > 500 and found > compared // 2, (compared, found)


def test_branches_start_where_the_places_disagree_most_frequent_first():
    cache = SuffixCache(SuffixConfig(min_match=2))
    # after "5 6": 7 8 (twice), 7 9 (once), 4 (once)
    cache.start_request("r", [5, 6, 7, 8, 0, 5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 4, 3, 5, 6])
    found = cache.propose("r", 2, num_alternatives=2)
    assert found.token_ids.tolist() == [7, 8]
    branches = [b.token_ids.tolist() for b in found.alternatives]
    assert branches[0] == [4, 3], branches  # the earliest branch point first
    assert {tuple(b) for b in branches} == {(7, 9), (4, 3)}
    assert all(0 < c <= 1 for b in found.alternatives for c in b.confidences)
    assert cache.propose("r", 2).alternatives == ()


def test_the_cpp_index_extends_the_tree_of_all_outputs_when_its_deferred_work_runs():
    """The tree of all outputs waits for the deferred job (the union runs it in the
    worker's wait); the request's own tree does not: its own copy is proposed at once,
    another request sees the output once the job ran; an output evicted while its tokens
    wait stays evicted (seen red with add_tokens extending both trees at once, and with
    start_request's extend_outputs removed)."""
    from specplugin.proposers.suffix import SuffixProposer

    jobs = []
    p = SuffixProposer(index="arctic")
    p.defer = jobs.append
    p.propose(_step(["a", "b"], [[1, 2, 3, 4], [9, 9, 9]], [2, 3]))
    # a's output goes on 5 6 7 3 4 (so 3 4 -> 5 6 7), b's just reached 5 6
    own, other = p.propose(_step(["a", "b"], [[1, 2, 3, 4, 5, 6, 7, 3, 4], [9, 9, 9, 5, 6]],
                                 [2, 3]))
    assert own.token_ids.tolist()[:3] == [5, 6, 7]
    assert jobs, "nothing deferred"
    # b copying a's output before the job ran: the tree of outputs lacks 5 6 7
    assert other is None, other
    while jobs:
        jobs.pop(0)()
    _, other = p.propose(_step(["a", "b"], [[1, 2, 3, 4, 5, 6, 7, 3, 4], [9, 9, 9, 5, 6]],
                               [2, 3]))
    assert other is not None and other.token_ids.tolist()[:1] == [7], other
    # an output evicted while its tokens wait stays evicted
    q = SuffixProposer(SuffixConfig(store_max_outputs=1), index="arctic")
    q.defer = jobs.append
    q.propose(_step(["x"], [[1, 2]], [2]))
    q.propose(_step(["x"], [[1, 2, 41, 42, 43]], [2]))  # 41 42 43 wait for the job
    q.finish_requests(["x"])
    q.propose(_step(["y"], [[8, 8]], [2]))  # the store holds one output: x's is evicted
    q.finish_requests(["y"])
    while jobs:
        jobs.pop(0)()
    [late] = q.propose(_step(["z"], [[5, 41, 42]], [3]))
    assert late is None, late

"""One record per request (specplugin.requests): made at a request's first step, shared by
the union, its proposers, the draft KV cursor and the options cache, dropped in one place."""

import numpy as np
import pytest

from specplugin.adaptive import build
from specplugin.config import parse
from specplugin.proposers.base import StepBatch
from specplugin.proposers.draft import DraftKVCursor
from specplugin.request_options import MAX_K_KEY, RequestOptionsCache


def _batch(req_ids, length=12):
    n = len(req_ids)
    tokens = np.tile(np.arange(32) % 5, (n, 1))  # text that repeats: candidates to find
    return StepBatch(tuple(req_ids), tokens, np.full(n, length), np.full(n, 4), np.full(n, 8),
                     np.zeros(n, dtype=bool), tuple(range(n)))


def test_a_requests_record_is_shared_and_dropped_in_one_place():
    """Seen red with ``Requests.finish`` keeping the records (a finished request's state
    outliving it) and with the suffix proposer keeping its feed in a registry of its own."""
    union = build(parse({"proposers": ["ngram", "suffix"]}, 8), 256)
    requests = union.requests
    suffix = next(p for p in union.proposers if p.name == "suffix")
    stopped = []
    stop = suffix.cache.stop_request
    suffix.cache.stop_request = lambda req_id: (stopped.append(req_id), stop(req_id))[1]
    options = RequestOptionsCache(8, ("ngram", "suffix"), requests)
    cursor = DraftKVCursor(requests)

    union.step(_batch(["a", "b"]), None)
    assert options.get("a", {MAX_K_KEY: 2}).max_k == 2
    cursor.advance(["a", "b"], [12, 12])
    a = requests.get("a")
    assert (a.suffix_fed, a.options.max_k, a.draft_kv_end) == (12, 2, 12)

    requests.restart(["a"])  # preempted: its draft KV is gone, nothing else
    assert (a.draft_kv_end, a.suffix_fed, a.options.max_k) == (0, 12, 2)

    union.finish_requests(["a"])
    assert requests.get("a") is None and [s.req_id for s in requests] == ["b"]
    assert stopped == ["a"] and not union.idle
    union.finish_requests(["b"])
    assert len(requests) == 0 and stopped == ["a", "b"] and union.idle
    # a request seen again after it ended starts from nothing
    assert options.get("a", {MAX_K_KEY: 5}).max_k == 5 and cursor.starts(["a"], [12], 100) == [0]


def test_recent_acceptance_averages_each_judged_token():
    from specplugin.requests import RequestState

    state = RequestState("a")
    state.average_in(3, 2)  # accepted, accepted, rejected: 1, 1, then 1 + 0.3 * (0 - 1)
    assert state.recent_acceptance == pytest.approx(0.7)
    state.average_in(0, 0)
    assert state.recent_acceptance == pytest.approx(0.7)

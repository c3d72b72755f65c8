"""Test-only fault injection: the setting, and that an injected failure costs a step's
drafts of that proposer only (the server-side proof is in tests/test_serve.py)."""

import numpy as np
import pytest

from specplugin.config import SpecPluginConfigError, parse
from specplugin.proposers.faults import EveryNth, FaultyProposer, InjectedFault
from specplugin.proposers import build_proposer
from specplugin.proposers.base import Candidate, StepBatch
from specplugin.adaptive.union import Union


def test_every_nth_call_fails():
    fault = EveryNth("x", 3)
    outcomes = []
    for _ in range(7):
        try:
            fault.tick()
            outcomes.append("ok")
        except InjectedFault:
            outcomes.append("fail")
    assert outcomes == ["ok", "ok", "fail", "ok", "ok", "fail", "ok"]


def test_the_setting_wraps_only_the_named_proposer():
    config = parse({"proposers": ["ngram", "suffix"],
                    "fault_injection": {"proposers": {"ngram": 2}}}, 8)
    assert isinstance(build_proposer("ngram", config), FaultyProposer)
    assert not isinstance(build_proposer("suffix", config), FaultyProposer)
    assert not isinstance(build_proposer("ngram", parse({}, 8)), FaultyProposer)


@pytest.mark.parametrize("faults, message", [
    ({"proposers": {"ngram": 0}}, "must be an integer >= 1"),
    ({"proposers": ["ngram"]}, "must be an object mapping proposer names"),
    ({"proposers": {"suffix": 2}}, "names 'suffix', which"),
    ({"proposers": {"draft": 2}}, 'injected with fault_injection["draft_forward"]'),
    ({"draft_forward": 2}, "needs the 'draft' proposer"),
    ({"draft_forward": True}, "draft_forward"),
    ({"rank": -1}, "must be a tensor-parallel rank"),
    ({"rank": True}, "must be a tensor-parallel rank"),
    ({"every": 2}, "unknown key(s) ['every']"),
])
def test_bad_fault_settings_are_refused_by_name(faults, message):
    with pytest.raises(SpecPluginConfigError) as e:
        parse({"proposers": ["ngram"], "fault_injection": faults}, 8)
    assert message in str(e.value) and "fault_injection" in str(e.value)


class _Offer:
    def __init__(self, name):
        self.name = name

    def propose(self, batch):
        return [Candidate(np.array([7, 8], dtype=np.int64), np.full(2, 0.99))
                for _ in range(batch.num_reqs)]

    def finish_requests(self, req_ids):
        pass


def test_a_failing_proposer_costs_its_own_candidates_and_is_counted():
    union = Union([FaultyProposer(_Offer("ngram"), 2), _Offer("suffix")], explore=False)
    batch = StepBatch(("a", "b"), np.zeros((2, 8), dtype=np.int64), np.array([4, 4]),
                      np.array([2, 2]), np.array([4, 4]), np.zeros(2, dtype=bool), (0, 1))
    first, second = union.ask(batch, range(2)), union.ask(batch, range(2))
    assert {union.proposers[i].name for _, i, _ in first} == {"ngram", "suffix"}
    assert {union.proposers[i].name for _, i, _ in second} == {"suffix"}  # ngram's 2nd call
    assert [f.count for f in union.failures] == [1, 0]


def test_faults_pinned_to_a_rank_fire_there_only():
    faults = parse({"proposers": ["ngram"], "step_arbiter": False, "fault_injection": {
        "proposers": {"ngram": 2}, "rank": 1, "alternate_blocks": True}}, 8).fault_injection
    assert faults.on_rank(1) is faults
    elsewhere = faults.on_rank(0)
    assert elsewhere.proposers == {} and elsewhere.draft_forward is None
    assert elsewhere.alternate_blocks  # a switch, not a failure: the same on every rank


def _agreeing_rank(rank: int, port: int, results) -> None:
    """One of two gloo ranks: rank 0 tells, both check readiness twice (rank 1 not ready,
    then sizes differing), both agree on timings; then rank 1 stays away (stuck or gone)."""
    import os
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from specplugin.vllm_layer.ranks import RankZeroClock, RanksDidNotAgree

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = SimpleNamespace(cpu_group=dist.group.WORLD, ranks=[0, 1], rank_in_group=rank)
    clock = RankZeroClock(group, wait_s=2.0)
    told = clock.tell([3, 1, 4] if rank == 0 else None, 5, "draft run")
    flags = [clock.all_ready(rank == 0, 7), clock.all_ready(True, 7 + rank)]
    timings = clock.agree([float(rank + 1), None])
    if rank == 1:
        results.put((rank, told, flags, timings, None))
        time.sleep(30)  # stuck
        return
    start = time.monotonic()
    try:
        clock.all_ready(True, 1)
        error = None
    except RanksDidNotAgree as err:
        error = (str(err), time.monotonic() - start)
    results.put((rank, told, flags, timings, error))


def test_a_rank_that_never_arrives_stops_the_engine_with_a_clear_error():
    """Tensor parallel: the agreement points wait a bounded time, then raise an error
    naming what happened (not an ``Exception``: the drafting guards must not swallow it)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_agreeing_rank, args=(r, port, results)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    got = {rank: rest for rank, *rest in (results.get(timeout=60) for _ in ranks)}
    for proc in ranks:
        proc.kill()
        proc.join()
    # rank 0's values; (all ready, same size) on both ranks; rank 0's timings
    assert got[0][:3] == got[1][:3] == [[3, 1, 4], [(False, True), (True, False)], [1.0, None]]
    message, waited = got[0][3]
    assert "rank 0 waited 2 s for the other ranks" in message and waited < 10

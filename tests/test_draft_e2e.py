"""The draft proposer inside real vLLM, on the zoo pair, through the plugin's worker layer.

Two engines for the module: one without speculation (the runner's child process), one
with ``additional_config={"specplugin": {"proposers": ["draft"], ...}}`` that runs a
greedy and a temperature-1 cell. The second runs vLLM in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, in its own Python process) so that a probe can
wrap vLLM's ``RejectionSampler.forward`` and see what the plugin hands it: that is
the only way to prove the draft probabilities reach the sampler (without them vLLM
silently verifies one-hot drafts, and acceptance stays > 0). The sampled distribution
itself is tested statistically by ``specplugin check-lossless`` (tests/test_lossless.py
runs it on every plugin method, this one included).
"""

from dataclasses import replace

import pytest

from specplugin.bench.runner import cell_payload, engine_kwargs, plugin_engine_kwargs
from specplugin.bench.workloads import QUICK_SIZES, Cell, cell_prompts, source_from_zoo
from specplugin.zoo import zoo_path
from tests.probe import run_probe
from tests.shared_engine import REFERENCE, add_cell

pytestmark = pytest.mark.vllm

K_MAX = 8  # num_speculative_tokens; the default draft length k is 4


@pytest.fixture(scope="module")
def models(zoo_root):
    return str(zoo_path("target", zoo_root)), str(zoo_path("draft", zoo_root))


def _cells(zoo_root):
    source = source_from_zoo(zoo_root)
    sizes = replace(QUICK_SIZES, max_tokens=48, min_requests=4)
    return [cell_payload(cell_prompts(source, sizes, Cell("mixed", 4, t), base_seed=11))
            for t in (0.0, 1.0)]


# the reference: the greedy cell decoded without drafts, in the suite's shared engine
REFERENCE_CELL = add_cell("draft_e2e/reference", options=REFERENCE,
                          build=lambda zoo_root: _cells(zoo_root)[0])


@pytest.fixture(scope="module")
def cells(zoo_root):
    return _cells(zoo_root)


@pytest.fixture(scope="module")
def baseline(shared_runs, cells):
    return {cells[0]["key"]: {"token_ids": shared_runs[REFERENCE_CELL].token_ids}}


# Runs in a fresh Python process: vLLM in-process, RejectionSampler.forward wrapped.
PROBE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm.v1.sample import rejection_sampler

seen = []  # one record per verification call that had drafts
original = rejection_sampler.RejectionSampler.forward

def record(metadata, draft_probs, sampling_metadata, path):
    draft_ids = metadata.draft_token_ids.long()  # [num_draft_tokens]
    record = {"num_draft_tokens": int(draft_ids.numel()), "path": path,
              "all_greedy": bool(sampling_metadata.all_greedy), "has_probs": draft_probs is not None}
    if draft_probs is not None:
        # [num_draft_tokens, vocab_size]: rows are distributions that drew the drafted tokens
        q = draft_probs[torch.arange(draft_ids.numel()), draft_ids]
        record.update(rows=int(draft_probs.shape[0]),
                      max_row_sum_error=float((draft_probs.sum(-1) - 1).abs().max()),
                      min_q_of_draft=float(q.min()), mean_q_of_draft=float(q.mean()))
    seen.append(record)

def forward(self, metadata, draft_probs, logits, sampling_metadata):
    record(metadata, draft_probs, sampling_metadata, "vllm")
    return original(self, metadata, draft_probs, logits, sampling_metadata)

rejection_sampler.RejectionSampler.forward = forward

# the plugin's own verification of sampled batches (its runner's shortcut past vLLM's)
from specplugin.vllm_layer import verification
original_sampled = verification.verify_sampled

def verify_sampled(logits, metadata, sampling_metadata, draft_probs, heard):
    record(metadata, draft_probs, sampling_metadata, "plugin")
    return original_sampled(logits, metadata, sampling_metadata, draft_probs, heard)

verification.verify_sampled = verify_sampled

# CUDA graphs run padded batches; CPU never pads. Pad every draft decode pass by PAD
# rows here, and check that the padding rows' slots are the padding slot id (a real
# slot there would let dummy rows overwrite real draft KV).
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID
from specplugin.vllm_layer.draft_proposer import PluginDraftProposer as P

PAD, pad_checks, meta_checks = 3, [], []
orig_pad, orig_decode, orig_forward = P._padding, P._decode_forward, P._forward
orig_meta = P._attn_metadata

def padded(self, num_tokens):
    mode, num_input, across = orig_pad(self, num_tokens)
    return mode, num_input + PAD, across

def same_metadata(mine, fresh):
    # field by field; the scheduler metadata is an opaque buffer holding pointers
    return (all(torch.equal(getattr(mine, f), getattr(fresh, f))
                for f in ("seq_lens", "slot_mapping", "block_table", "query_start_loc"))
            and all(getattr(mine, f) == getattr(fresh, f)
                    for f in ("num_actual_tokens", "max_query_len", "max_seq_len", "causal"))
            and mine.scheduler_metadata.shape == fresh.scheduler_metadata.shape
            and mine.scheduler_metadata is not fresh.scheduler_metadata)

def vllms_metadata(self, cad, draft_index):
    return self.draft_attn_groups[0].build_metadata_for_drafting(
        common_attn_metadata=cad, draft_index=draft_index)

def attn_metadata(self, cad, draft_index):
    # each pass whose metadata is built (the first, the first decode pass): the
    # plugin's build against vLLM's builder's
    built = orig_meta(self, cad, draft_index)
    if self._cpu_builder is not None:
        meta_checks.append(same_metadata(next(iter(built.values())),
                                         vllms_metadata(self, cad, draft_index)))
    return built

def first_pass(self, cad, num_tokens, views):
    # the first pass's padding tokens (PAD more than its tokens) read the padding slot
    kwargs, slot_mappings = views[:2]
    rows = [s[num_tokens:] for s in slot_mappings.values()]
    pad_checks.append(kwargs["input_ids"].shape[0] == num_tokens + PAD
                      and kwargs["positions"].shape[0] == num_tokens + PAD
                      and bool(rows) and all(r.shape[0] == PAD for r in rows)
                      and all(bool((r == PADDING_SLOT_ID).all()) for r in rows)
                      and torch.equal(views[2], cad.slot_mapping))
    return orig_forward(self, cad, num_tokens, views)

def decode_pass(self, context, cad, draft_index, inputs):
    # the pass's slot mapping, as the forward context gets it
    kwargs, slot_mappings = inputs
    num_tokens, num_padded = cad.num_actual_tokens, kwargs["input_ids"].shape[0]
    rows = [s[num_tokens:num_padded] for s in slot_mappings.values()]
    pad_checks.append(num_padded == num_tokens + PAD and bool(rows)
                      and kwargs["positions"].shape[0] == num_padded
                      and all(bool((r == PADDING_SLOT_ID).all()) for r in rows)
                      and all(r.shape[0] == PAD for r in rows))
    hidden = orig_decode(self, context, cad, draft_index, inputs)
    if draft_index > 1 and self._cpu_builder is not None:
        # the metadata carried from the pass before, against vLLM's build of this pass
        meta_checks.append(same_metadata(next(iter(context.attn_metadata.values())),
                                         vllms_metadata(self, cad, draft_index)))
    return hidden

P._padding, P._decode_forward, P._forward = padded, decode_pass, first_pass
P._attn_metadata = attn_metadata

# The draft runs only for rows that use it: force odd rows to skip every third step and
# record what each first pass re-reads, per request: [start, end) position ranges.
from specplugin.vllm_layer import draft_proposer

reads, calls = [], {"n": 0}
orig_caps, orig_inputs = draft_proposer.draft_caps, P._first_pass_inputs

def caps(remaining, k, prefilling):
    out = orig_caps(remaining, k, prefilling)
    calls["n"] += 1
    if calls["n"] % 3 == 0:
        out[1::2] = [0] * len(out[1::2])
    return out

def first_pass_inputs(self, batch, rows, starts, ends, cad, *args):
    reads.extend([batch.req_ids[r], int(a), int(batch.num_tokens[r]), calls["n"]]
                 for r, a in zip(rows, starts))
    return orig_inputs(self, batch, rows, starts, ends, cad, *args)

draft_proposer.draft_caps, P._first_pass_inputs = caps, first_pass_inputs
orig_draft = P._draft

def draft(self, run, batch, rows, *args):  # each read's run: how many decode passes ran
    first = len(reads)
    orig_draft(self, run, batch, rows, *args)
    for read in reads[first:]:
        read.append(run.num_positions - 1)

P._draft = draft

# Accepted draft tokens that a decode pass read need no re-read: record what the cursor
# credits each request (its accepted tokens, up to the passes that read them).
from specplugin.proposers.draft import DraftKVCursor

credits, orig_accepted = [], DraftKVCursor.accepted

def accepted(self, req_ids, num_accepted):
    credits.extend([r, min(a, self._ahead[r])] for r, a in zip(req_ids, num_accepted)
                   if a > 0 and self._ahead.get(r, 0) > 0)
    return orig_accepted(self, req_ids, num_accepted)

DraftKVCursor.accepted = accepted

# vLLM's preparation of the draft model's inputs, against the plugin's runs that skip it
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as Base

prepared = {"vllm": 0, "decided": 0}
orig_prepare, orig_step = Base.prepare_next_token_ids_padded, P.draft_step

def prepare(self, *args, **kwargs):
    prepared["vllm"] += 1
    return orig_prepare(self, *args, **kwargs)

def draft_step(self, *args, **kwargs):
    prepared["decided"] += 1
    return orig_step(self, *args, **kwargs)

Base.prepare_next_token_ids_padded, P.draft_step = prepare, draft_step

# These cells are short: every step speculates (the step arbiter, which would switch some
# to plain decoding, is tested on its own), so the draft's own rule has steps to learn from.
from specplugin.adaptive.arbiter import StepArbiter
StepArbiter.speculate = lambda self, num_reqs, sampled=False: True
job = json.loads(sys.argv[1])
from specplugin.bench.engine import run_cell
from vllm import LLM

llm = LLM(model=job["model"], **job["engine_kwargs"])
results = {}
for cell in job["cells"]:
    seen.clear()
    pad_checks.clear()
    meta_checks.clear()
    reads.clear()
    credits.clear()
    prepared.update(vllm=0, decided=0)
    results[cell["key"]] = {**run_cell(llm, cell, True), "probe": list(seen),
                            "pad_checks": list(pad_checks), "meta_checks": list(meta_checks),
                            "reads": list(reads),
                            "credits": list(credits), "prepared": dict(prepared)}
print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def with_draft(models, cells):
    # the draft runs in every speculative step (these tests check its mechanics; whether
    # it pays is the union's gate's call, tested in the core)
    options = {"proposers": ["draft"], "draft_model": models[1],
               "fault_injection": {"draft_always": True}}
    job = {"model": models[0], "cells": cells,
           "engine_kwargs": engine_kwargs(plugin_engine_kwargs(K_MAX, options), eager=True)}
    return run_probe(PROBE, job)


def test_greedy_output_is_identical_token_for_token(baseline, with_draft, cells):
    key = cells[0]["key"]
    want, got = baseline[key]["token_ids"], with_draft[key]["token_ids"]
    assert len(want) == len(got) == len(cells[0]["prompts"])
    for i, (a, b) in enumerate(zip(want, got)):
        first_diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"request {i}: first difference at output position {first_diff}"


def test_padded_draft_passes_give_padding_rows_the_padding_slot(with_draft, cells):
    """The module's draft engine pads every draft forward (first passes and decode
    passes) by 3 tokens, as CUDA graphs would; greedy output stays identical (above) and
    no padding token holds a real slot."""
    checks = [c for cell in cells for c in with_draft[cell["key"]]["pad_checks"]]
    assert checks and all(checks), checks.count(False)


def test_draft_passes_get_vllms_cpu_attention_metadata(with_draft, cells):
    """A run's first pass and first decode pass build their CPU attention metadata
    without vLLM's builder (``cpu_attn_metadata``), and past the first decode pass it is
    the previous pass's, updated in place (``update_cpu_decode_metadata``): either way
    field by field what vLLM's builder gives for the pass (its scheduler metadata is an
    opaque buffer holding pointers: rebuilt, of the same size)."""
    checks = [c for cell in cells for c in with_draft[cell["key"]]["meta_checks"]]
    assert checks and all(checks), (len(checks), checks.count(False))


def test_the_draft_rereads_exactly_what_it_skipped(with_draft, cells):
    """The module's draft engine makes odd rows skip drafting every third step. Each
    request's first passes must cover its context: each starts where the previous one
    ended (a skipped step's tokens are read later, none twice, none missed) or later by
    exactly the accepted draft tokens whose draft KV a decode pass of the previous run
    wrote (the cursor's credits: some in every cell; never more than that run's passes),
    the first at position 0 (the whole prompt), and some re-reads span skipped steps."""
    for cell in cells:
        ranges, steps, credited = {}, {}, {}
        for req_id, start, end, step, passes in with_draft[cell["key"]]["reads"]:
            ranges.setdefault(req_id, []).append((start, end, passes))
            steps.setdefault(req_id, []).append(step)
        for req_id, n in with_draft[cell["key"]]["credits"]:
            credited[req_id] = credited.get(req_id, 0) + n
        assert len(ranges) == len(cell["prompts"])
        for req_id, spans in ranges.items():
            assert spans[0][0] == 0, (req_id, spans[:3])
            gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
            # never past the positions the previous run's decode passes wrote
            assert all(0 <= g <= a[2] for g, a in zip(gaps, spans)), (req_id, spans)
            # (a request's last credit may come after its last read)
            assert 0 <= credited.get(req_id, 0) - sum(gaps) <= 8, (req_id, spans, credited)
        assert sum(credited.values()) > 0, cell["key"]
        # reads of one request more than one engine step apart: it skipped in between
        gaps = sum(b - a > 1 for s in steps.values() for a, b in zip(s, s[1:]))
        assert gaps > 0


def test_draft_runs_skip_vllms_preparation_of_the_draft_inputs(with_draft, cells):
    """Every step in which the draft model ran was decided before vLLM's preparation of
    its inputs, which then never runs (the decision holds what it computes)."""
    for cell in cells:
        prepared = with_draft[cell["key"]]["prepared"]
        assert prepared["decided"] > 0 and prepared["vllm"] == 0, (cell["key"], prepared)


def test_drafts_are_accepted_and_their_length_adapts(with_draft, cells):
    """The union's plan and the draft's stop rule make the mean draft shorter than K_MAX,
    with accepted tokens at several positions."""
    greedy = with_draft[cells[0]["key"]]
    assert greedy["num_drafts"] > 0 and greedy["num_accepted_tokens"] > 0
    assert greedy["num_draft_tokens"] < K_MAX * greedy["num_drafts"]
    per_pos = greedy["accepted_per_pos"]
    assert len(per_pos) == K_MAX
    assert sum(1 for n in per_pos if n > 0) >= 3, per_pos


def test_temperature_one_drafts_are_verified_against_draft_probabilities(with_draft, cells):
    """Every verification at temperature 1 gets the draft's probabilities, one row per
    draft token, each row a distribution under which its drafted token was likely; the
    plugin verifies these batches itself (``verify_sampled``)."""
    sampled = with_draft[cells[1]["key"]]
    assert len(sampled["token_ids"]) == len(cells[1]["prompts"])
    assert sampled["num_accepted_tokens"] > 0
    calls = [c for c in sampled["probe"] if c["num_draft_tokens"] > 0]
    assert calls and all(not c["all_greedy"] for c in calls)
    # verified by the plugin's host-side shortcut, not vLLM's rejection sampler
    assert all(c["path"] == "plugin" for c in calls), [c["path"] for c in calls][:5]
    assert all(c["has_probs"] for c in calls), [c for c in calls if not c["has_probs"]][:3]
    assert all(c["rows"] == c["num_draft_tokens"] for c in calls)
    assert max(c["max_row_sum_error"] for c in calls) < 1e-3
    assert min(c["min_q_of_draft"] for c in calls) > 0  # the drafted token was drawn from q
    # not one-hot: the draft is uncertain about some tokens it drew
    assert min(c["mean_q_of_draft"] for c in calls) < 0.99
    # vLLM's counters agree with what was verified
    assert sum(c["num_draft_tokens"] for c in calls) == sampled["num_draft_tokens"]


def test_a_draft_with_another_vocabulary_is_a_startup_error(models, tmp_path):
    """Refused in the user's own process while vLLM builds its config: no engine starts."""
    from vllm import LLM

    from specplugin.bench.tinymodel import TINY_DRAFT, build_tiny_llama

    other = build_tiny_llama(tmp_path / "tiny", TINY_DRAFT)
    options = {"proposers": ["draft"], "draft_model": str(other)}
    with pytest.raises(Exception) as err:
        LLM(model=models[0], **engine_kwargs(plugin_engine_kwargs(K_MAX, options), eager=True))
    assert "vocabulary of 12 tokens but the target has 4096" in str(err.value)


def test_a_failing_draft_step_costs_its_drafts_not_the_requests():
    """The drafter's guard, without an engine: an exception inside drafting yields empty
    drafts for every row (vLLM then decodes plainly) and is counted."""
    from types import SimpleNamespace

    import logging

    from specplugin.adaptive.cost import StepTimer
    from specplugin.metrics import FailureCounter
    from specplugin.adaptive.draft_rule import AcceptanceCalibration, OutcomeTracker
    from specplugin.proposers.draft import DraftKVCursor
    from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

    drafter = object.__new__(PluginDraftProposer)  # no vLLM config needed for the guard
    drafter.failures = FailureCounter("draft", logging.getLogger("test"))
    drafter.device, drafter.union = "cpu", _union_of_one()
    drafter.plugin_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"],
                                                                        num_reqs=2))
    drafter.outcomes = OutcomeTracker(AcceptanceCalibration())
    drafter.cursor = DraftKVCursor()
    drafter.proposer_stats = drafter.union.stats
    drafter.timer = StepTimer()
    drafter.background, drafter._held_jobs = drafter.union.background, []

    def broken(*args, **kwargs):
        raise RuntimeError("draft model exploded")

    drafter._propose = broken
    for _ in range(2):
        drafts = drafter.propose(num_speculative_tokens=8, target_token_ids=None)
        assert drafts == [[], []] and drafter.last_lengths == [0, 0]
    assert drafter.stats()["proposer_failures"] == {"draft": 2}


def _union_of_one():
    """The draft model alone, as the drafter builds it: a union of one proposer."""
    from specplugin.adaptive.arbiter import StepArbiter
    from specplugin.adaptive.cost import StepCostModel
    from specplugin.adaptive.union import Union
    from specplugin.proposers.draft import DraftCandidates

    return Union([DraftCandidates()], cost=StepCostModel(max_tokens=64), arbiter=StepArbiter())


def _bare_drafter(num_reqs: int, scheduled: list[int]):
    """A PluginDraftProposer with only what its step's decision reads (no vLLM config)."""
    from types import SimpleNamespace

    import logging

    from specplugin.adaptive.cost import StepTimer
    from specplugin.metrics import FailureCounter
    from specplugin.adaptive.draft_rule import AcceptanceCalibration, OutcomeTracker
    from specplugin.proposers.draft import DraftKVCursor
    from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

    drafter = object.__new__(PluginDraftProposer)
    drafter.failures = FailureCounter("draft", logging.getLogger("test"))
    drafter.device, drafter.union = "cpu", _union_of_one()
    drafter.costs, drafter.background = drafter.union.draft_costs, drafter.union.background
    context = SimpleNamespace(num_scheduled_drafts=scheduled)
    drafter.plugin_runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[f"r{i}" for i in range(num_reqs)],
                                    num_reqs=num_reqs, vocab_size=100),
        step_context=lambda: context)
    drafter.outcomes = OutcomeTracker(AcceptanceCalibration())
    drafter.cursor = DraftKVCursor()
    drafter.proposer_stats = drafter.union.stats
    drafter.timer = StepTimer()
    drafter._run = drafter._run_probs = None
    drafter._held_jobs = []
    return drafter, context


def test_the_drafter_forgets_its_calibration_and_its_prices_with_what_it_learned():
    """``specplugin_forget_learned`` (bench, after its warm-up): the draft's stop rule
    must start the timed cell from a fresh engine's tables, not the warm-up's."""
    from specplugin.adaptive.draft_rule import WARMUP_FORWARDS

    drafter, _ = _bare_drafter(1, [0])
    drafter._observed = False
    calibration = drafter.outcomes.calibration
    drafter.calibration = calibration
    calibration.update([0.9] * 80, [True] * 80, [True] * 80, [0] * 80)
    for _ in range(WARMUP_FORWARDS + 4):
        drafter.costs.observe_forward(0.004)
    assert calibration.warm_tables()[1], "the lesson did not take: the test tests nothing"
    assert drafter.costs.draft_forward_s == pytest.approx(0.004)
    drafter.forget_learned()
    assert drafter.costs.draft_forward_s is None
    assert calibration.warm_tables() == [False, False]
    assert calibration.estimate_rows([0.95], [1], 0) == [0.95]  # the bucket's own confidence


def test_the_draft_step_reads_next_tokens_and_rejections_as_vllm_counts_them():
    """Before vLLM prepares the draft model's inputs, the drafter reads from the step's
    sampled tokens ([rows, 1 + drafts], -1 past the accepted ones) what vLLM's preparation
    gives: each row's last valid token, and drafts verified + 1 - tokens emitted."""
    import torch

    drafter, context = _bare_drafter(3, [2, 0, 2])
    seen = []
    drafter._step = lambda *args: seen.append(args) or [[4], [], [9, 9]]
    sampled = torch.tensor([[5, 6, -1], [7, -1, -1], [8, 1, 2]])
    assert drafter.draft_step(sampled, "meta", "cad") == [[4], [], [9, 9]]
    ctx, num_reqs, rejected, next_tokens, meta, cad = seen[0]
    assert (ctx, num_reqs, meta, cad) == (context, 3, "meta", "cad")
    assert next_tokens == [6, 7, 2] and rejected == [1, 0, 0]
    context.num_scheduled_drafts = [0, 0, 0]  # no row had drafts: no rejection counts
    drafter.draft_step(sampled[:, :1], "meta", "cad")
    assert seen[1][2] is None and seen[1][3] == [5, 7, 8]


def test_a_failing_step_decision_costs_its_drafts_not_the_requests():
    import torch

    drafter, _ = _bare_drafter(2, [0, 0])

    def broken(*args):
        raise RuntimeError("union exploded")

    drafter._step = broken
    assert drafter.draft_step(torch.tensor([[3], [4]]), None, None) == [[], []]
    assert drafter.last_lengths == [0, 0] and drafter._run is None
    assert drafter.stats()["proposer_failures"] == {"draft": 1}


def test_the_step_that_read_new_prompts_teaches_the_drafts_cost_model_nothing():
    """The step in which requests joined the batch ran their prompts: the draft's cost
    model (seconds per emitted token, the verification slope) learns nothing from its
    time; the plain steps after it teach it as they would have without it."""
    from types import SimpleNamespace


    models = []
    for prefill in (False, True):
        drafter, _ = _bare_drafter(8, [0] * 8)
        drafter.clock = SimpleNamespace(shared=False)
        drafter._last_forwards = drafter._last_draft_tokens = 0
        drafter._last_draft_seconds, drafter._steps_since_run = 0.0, 2
        drafter._observed, drafter.last_lengths = False, None
        laps = iter([0.200] * prefill + [0.005] * 24)
        drafter.timer = SimpleNamespace(lap=lambda: next(laps))
        if prefill:
            drafter.new_requests(8, 8)
            drafter.skip_drafting(8, 1348, False, read_prompts=True)  # 1,348 tokens, 200 ms
        for _ in range(24):  # plain decode steps of 8 requests, 5 ms each
            drafter.skip_drafting(8, 8, False)
        drafter.costs.observe_step(0.005, 8, 0, 0)  # (hands on the steps still summed)
        models.append(drafter.costs)
    without, with_prefill = models
    assert with_prefill.token_s == pytest.approx(without.token_s)
    assert with_prefill._moments == pytest.approx(without._moments)

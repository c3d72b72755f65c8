"""The draft proposer inside real vLLM, on the zoo pair, through the plugin's worker layer.

Two engines for the module: one without speculation, one with
``additional_config={"specplugin": {"proposers": ["draft"], ...}}`` that runs a
greedy and a temperature-1 cell. The sampled distribution itself is tested
statistically by ``specplugin check-lossless`` (tests/test_lossless.py runs it on
every plugin method, this one included).
"""

from dataclasses import replace

import pytest

from specplugin.bench.runner import EngineJob, cell_payload, run_job
from specplugin.bench.workloads import QUICK_SIZES, Cell, cell_prompts, source_from_zoo
from specplugin.engine import ENGINE_DEFAULTS, plugin_engine_kwargs
from specplugin.zoo import zoo_path

pytestmark = pytest.mark.vllm

K_MAX = 8  # num_speculative_tokens; the default draft length k is 4


@pytest.fixture(scope="module")
def models(zoo_root):
    return str(zoo_path("target", zoo_root)), str(zoo_path("draft", zoo_root))


@pytest.fixture(scope="module")
def cells(zoo_root):
    source = source_from_zoo(zoo_root)
    sizes = replace(QUICK_SIZES, max_tokens=48, min_requests=4)
    return [cell_payload(cell_prompts(source, sizes, Cell("mixed", 4, t), base_seed=11))
            for t in (0.0, 1.0)]


def _run(tmp_path_factory, label, target, engine_kwargs, cells):
    job = EngineJob(label=label, model=target, engine_kwargs={**ENGINE_DEFAULTS, **engine_kwargs},
                    cells=tuple(cells), return_token_ids=True)
    return run_job(job, tmp_path_factory.mktemp(label)).cells


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, models, cells):
    return _run(tmp_path_factory, "none", models[0], {}, cells[:1])


@pytest.fixture(scope="module")
def with_draft(tmp_path_factory, models, cells):
    options = {"proposers": ["draft"], "draft_model": models[1]}
    return _run(tmp_path_factory, "plugin-draft", models[0], plugin_engine_kwargs(K_MAX, options),
                cells)


def test_greedy_output_is_identical_token_for_token(baseline, with_draft, cells):
    key = cells[0]["key"]
    want, got = baseline[key]["token_ids"], with_draft[key]["token_ids"]
    assert len(want) == len(got) == len(cells[0]["prompts"])
    for i, (a, b) in enumerate(zip(want, got)):
        first_diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"request {i}: first difference at output position {first_diff}"


def test_drafts_are_accepted_and_their_length_adapts(with_draft, cells):
    """Early stops make the mean draft shorter than K_MAX; confident runs go past k = 4."""
    greedy = with_draft[cells[0]["key"]]
    assert greedy["num_drafts"] > 0 and greedy["num_accepted_tokens"] > 0
    assert greedy["num_draft_tokens"] < K_MAX * greedy["num_drafts"]
    per_pos = greedy["accepted_per_pos"]
    assert len(per_pos) == K_MAX
    assert sum(per_pos[4:]) > 0, per_pos  # accepted drafts beyond the default length


def test_temperature_one_drafts_are_verified_against_draft_probabilities(with_draft, cells):
    sampled = with_draft[cells[1]["key"]]
    assert all(len(t) == cells[1]["max_tokens"] for t in sampled["token_ids"])
    assert sampled["num_accepted_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_a_startup_error(models, tmp_path):
    """Refused in the user's own process while vLLM builds its config: no engine starts."""
    from vllm import LLM

    from specplugin.bench.tinymodel import TINY_DRAFT, build_tiny_llama

    other = build_tiny_llama(tmp_path / "tiny", TINY_DRAFT)
    options = {"proposers": ["draft"], "draft_model": str(other)}
    with pytest.raises(Exception) as err:
        LLM(model=models[0], **ENGINE_DEFAULTS, **plugin_engine_kwargs(K_MAX, options))
    assert "vocabulary of 12 tokens but the target has 4096" in str(err.value)


def test_a_failing_draft_step_costs_its_drafts_not_the_requests():
    """The drafter's guard, without an engine: an exception inside drafting yields empty
    drafts for every row (vLLM then decodes plainly) and is counted."""
    from types import SimpleNamespace

    from specplugin.proposers.draft import AcceptanceCalibration, OutcomeTracker
    from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

    drafter = object.__new__(PluginDraftProposer)  # no vLLM config needed for the guard
    drafter.num_failures, drafter.device = 0, "cpu"
    drafter.plugin_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"]))
    drafter.outcomes = OutcomeTracker(AcceptanceCalibration())

    def broken(*args, **kwargs):
        raise RuntimeError("draft model exploded")

    drafter._propose = broken
    for _ in range(2):
        drafts = drafter.propose(num_speculative_tokens=8, target_token_ids=None)
        assert drafts.shape == (2, 1) and drafter.last_lengths == [0, 0]
    assert drafter.num_failures == 2

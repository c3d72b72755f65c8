"""The union of proposers and the K controller inside real vLLM (one drafting path).

Three engines for the module: no speculation; the token-level union
``["ngram", "suffix"]``; and the full union ``["draft", "ngram", "suffix"]``, where
draft-model rows carry their draft probabilities and token-level rows one-hot ones
in the same batch. The full union's step arbiter alternates speculative and plain
blocks (``fault_injection.alternate_blocks``), so that plain steps skip drafting
altogether and the draft model catches up on the tokens it skipped. Greedy output must be identical token for token; the sampled
distribution of both unions is tested statistically by ``check-lossless``
(tests/test_lossless.py runs it on every plugin method).
"""

import pytest

from specplugin.bench.runner import plugin_engine_kwargs, run_engine
from specplugin.zoo import zoo_path
from tests.prompts import PARSE_HEADER

pytestmark = pytest.mark.vllm

CODE = PARSE_HEADER
# an edit (copies a long span), fresh code, and the same opening twice: the second
# request can copy what the first one generated (the suffix proposer's store)
PROMPTS = [CODE + "\n\n# The same function again:\n" + CODE[:60],
           "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n",
           "class Stack:\n    def __init__(self):\n"]
K = 8


def _run(target, overrides):
    # one request at a time, so the repeated opening comes after its first run finished
    return run_engine(target, overrides, PROMPTS, max_tokens=64, batch_size=1, eager=True)


@pytest.fixture(scope="module")
def target(zoo_root):
    return zoo_path("target", zoo_root)


@pytest.fixture(scope="module")
def baseline(target):
    return _run(target, {})


@pytest.fixture(scope="module")
def token_union(target):
    return _run(target, plugin_engine_kwargs(K, {"proposers": ["ngram", "suffix"]}))


@pytest.fixture(scope="module")
def full_union(target, zoo_root):
    options = {"proposers": ["draft", "ngram", "suffix"],
               "draft_model": str(zoo_path("draft", zoo_root)),
               "fault_injection": {"alternate_blocks": True}}
    return _run(target, plugin_engine_kwargs(K, options))


@pytest.mark.parametrize("union", ["token_union", "full_union"])
def test_greedy_output_is_identical_token_for_token(request, baseline, union):
    run = request.getfixturevalue(union)
    assert len(run.token_ids) == len(baseline.token_ids) == len(PROMPTS)
    for i, (want, got) in enumerate(zip(baseline.token_ids, run.token_ids)):
        first = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
        assert want == got, f"prompt {i}: first difference at output position {first}"


@pytest.mark.parametrize("union", ["token_union", "full_union"])
def test_drafts_are_verified_and_accepted(request, union):
    run = request.getfixturevalue(union)
    assert run.num_drafts > 0 and run.num_accepted_tokens > 0
    assert run.mean_acceptance_length > 1.3, run
    # the controller sizes drafts per step: not every draft is the longest allowed
    assert run.num_draft_tokens < K * run.num_drafts


def test_plain_steps_skip_drafting_and_speculation_resumes(full_union):
    """Every other block of 4 steps is plain: its steps after the first skip drafting
    (vLLM's non-speculative path), and the next speculative block drafts again from the
    tokens the skipped steps emitted (output identical above)."""
    steps = full_union.plugin_steps
    assert steps is not None and steps["steps_skipped"] > 10, steps
    assert steps["steps"] - steps["steps_without_drafts"] > 10, steps  # speculative steps too
    assert full_union.num_drafts > 0 and full_union.mean_acceptance_length > 1.3

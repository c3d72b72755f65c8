"""Tensor parallelism on this CPU: ``tensor_parallel_size=2`` (vLLM's multiprocessing
executor, one core per rank through ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) with the plugin.

Two engines: the full union (draft model, n-gram, suffix: the draft's forward is sharded
across both ranks, so rank 0 plans and rank 1 follows; see ``specplugin/vllm_layer/ranks.py``)
and the token-level union (``specplugin.Speculator``, each rank on its own). In each, the
same prompts run with speculation off per request (``specplugin_max_k=0``, the engine's
plain path) and on, greedy, with proposers (and draft forwards) failing on one rank only:
rank 0 in the full union (the rank that plans), rank 1 in the token-level one. The outputs
must be identical token for token, drafts must have been verified, and no rank may hang.
Requests naming one proposer each (``specplugin_proposers``) exercise every proposer on its
own under tensor parallelism.
"""


import pytest

from specplugin.bench.runner import engine_kwargs, plugin_engine_kwargs
from specplugin.zoo import zoo_path
from tests.probe import run_probe
from tests.prompts import PARSE_HEADER

pytestmark = pytest.mark.vllm

CODE = PARSE_HEADER
PROMPTS = [CODE + "\n\n# The same function again:\n" + CODE[:60],
           "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n",
           "# " + CODE + "\n# once more\n" + CODE[:40]]

# The step arbiter decides from rank 0's clock for every rank; left to measure, on
# these short runs it may keep every block plain (seen: a run with no draft at all), so
# its blocks alternate: its decisions still cross ranks, and drafts are certain. And
# failures on one rank only (test-only): a proposer's, and a draft forward's before it
# runs; a rank left alone in the draft's sharded forward would wait (the probe's timeout).
ALTERNATE = {"alternate_blocks": True}
PROPOSER_FAULTS = {"proposers": {"ngram": 3, "suffix": 4}}

PROBE = r"""
import json, sys
from vllm import LLM, SamplingParams

job = json.loads(sys.argv[1])
llm = LLM(model=job["model"], **job["engine_kwargs"])

def params(extra):
    return SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, extra_args=extra)

def counters():
    return {m.name: m.value for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}

plain = llm.generate(job["prompts"], params({"specplugin_max_k": 0}), use_tqdm=False)
before = counters()
spec = llm.generate(job["prompts"], [params(e) for e in job["extras"]], use_tqdm=False)
after = counters()
print("RESULT " + json.dumps({
    "plain": [list(o.outputs[0].token_ids) for o in plain],
    "spec": [list(o.outputs[0].token_ids) for o in spec],
    "drafts": after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0),
    "accepted": after.get("vllm:spec_decode_num_accepted_tokens", 0)
                - before.get("vllm:spec_decode_num_accepted_tokens", 0)}))
"""


def _probe(target, options, extras):
    kwargs = engine_kwargs({**plugin_engine_kwargs(8, options), "tensor_parallel_size": 2},
                           eager=True)
    job = {"model": target, "engine_kwargs": kwargs, "prompts": PROMPTS, "extras": extras}
    return run_probe(PROBE, job, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=240)


@pytest.fixture(scope="module")
def full_union(zoo_root):
    options = {"proposers": ["draft", "ngram", "suffix"],
               "draft_model": str(zoo_path("draft", zoo_root)),
               "fault_injection": {**ALTERNATE, **PROPOSER_FAULTS, "draft_forward": 5,
                                   "rank": 0}}
    # one request per proposer alone, one with all of them
    extras = [{}, {"specplugin_proposers": "draft"}, {"specplugin_proposers": "ngram"},
              {"specplugin_proposers": "suffix"}]
    return _probe(str(zoo_path("target", zoo_root)), options, extras)


@pytest.fixture(scope="module")
def token_union(zoo_root):
    return _probe(str(zoo_path("target", zoo_root)),
                  {"proposers": ["ngram", "suffix"],
                   "fault_injection": {**ALTERNATE, **PROPOSER_FAULTS, "rank": 1}},
                  [{}] * len(PROMPTS))


@pytest.mark.parametrize("run", ["full_union", "token_union"])
def test_greedy_output_is_identical_under_tensor_parallelism(request, run):
    result = request.getfixturevalue(run)
    for i, (want, got) in enumerate(zip(result["plain"], result["spec"])):
        first = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
        assert want == got, f"prompt {i}: first difference at output position {first}"
    assert result["drafts"] > 0 and result["accepted"] > 0, result

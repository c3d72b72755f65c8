"""The batch-expanding scorer inside real vLLM (offline ``LLM``, greedy).

One engine: the n-gram + suffix union with ``max_candidates`` 2 and the test switch
``fault_injection.decoy_primary``: every chosen draft is verified as an *extra*
candidate while the scheduler gets a decoy (each token changed), so the scorer's
extra rows, its winners and the copies of their KV carry the output. Requests with
``specplugin_max_k`` 0 on the same engine are the reference (no drafts, no extra
rows). 32-token blocks and a KV pool too small for the batch, so that candidates cross
block boundaries, contexts end exactly on one, and requests are preempted. Sampling
(temperature 1) through the scorer is tested statistically by ``check-lossless`` in
``tests/test_lossless.py``.
"""


import pytest

from specplugin.bench.runner import engine_kwargs, plugin_engine_kwargs
from specplugin.vllm_layer.scorer import blocks_per_row, MAX_EXTRA_ROWS
from specplugin.zoo import zoo_path
from tests.probe import run_probe
from tests.prompts import PARSE_HEADER

pytestmark = pytest.mark.vllm

K = 8
BLOCK_SIZE = 32
NUM_BLOCKS = 60  # the workers' pool; the scheduler gets it minus the scratch blocks
SCRATCH = MAX_EXTRA_ROWS * blocks_per_row(K, BLOCK_SIZE)
CODE = PARSE_HEADER
# copy-friendly prompts of different lengths (contexts end at different block offsets)
PROMPTS = [f"# {name}.py\n" + CODE * (1 + i % 3) + "\n# The same function again:\n"
           + CODE[: 30 + 17 * i] for i, name in enumerate(
               ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"))]

PROBE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams

from specplugin.adaptive.arbiter import StepArbiter
from specplugin.vllm_layer.metrics_export import engine_stats

# short runs: every step speculates (the arbiter is tested on its own)
StepArbiter.speculate = lambda self, num_reqs, sampled=False: True
job = json.loads(sys.argv[1])
llm = LLM(model=job["model"], **job["engine_kwargs"])
# every other prompt cut to whole blocks: its first decode step starts a block (position
# len(ids) is a block's first), so contexts that end on a boundary do not hang on which
# lengths the union's choices happen to reach
tokenizer, size = llm.get_tokenizer(), job["block_size"]
prompts = []
for i, text in enumerate(job["prompts"]):
    ids = tokenizer.encode(text)
    prompts.append({"prompt_token_ids": ids[:len(ids) // size * size] if i % 2 else ids})

def run(extra, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, extra_args=extra, **kw)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

def stopped(extra):
    # requests that stop on a string or run out of tokens in a step that emits several
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 7 * i, stop=["value"], extra_args=extra)
              for i in range(len(prompts))]
    return [[o.outputs[0].text, o.outputs[0].finish_reason]
            for o in llm.generate(prompts, params, use_tqdm=False)]

result = {"plain": run({"specplugin_max_k": 0}), "scored": run({})}
result["stopped_plain"], result["stopped"] = stopped({"specplugin_max_k": 0}), stopped({})
before = engine_stats(llm)["scorer"]
result["penalised_plain"] = run({"specplugin_max_k": 0}, repetition_penalty=1.2)
result["penalised"] = run({}, repetition_penalty=1.2)
result["scorer_before_penalised"] = before
result["scorer"] = engine_stats(llm)["scorer"]
core = llm.llm_engine.engine_core.engine_core  # in-process: the engine core itself
result["scheduler_blocks"] = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
result["preemptions"] = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe(zoo_root):
    options = {"proposers": ["ngram", "suffix"], "max_candidates": 2,
               "fault_injection": {"decoy_primary": True}}
    kwargs = engine_kwargs({**plugin_engine_kwargs(K, options), "block_size": BLOCK_SIZE,
                            "num_gpu_blocks_override": NUM_BLOCKS, "max_model_len": 1024},
                           eager=True)
    job = {"model": str(zoo_path("target", zoo_root)), "engine_kwargs": kwargs,
           "prompts": PROMPTS, "block_size": BLOCK_SIZE}
    return run_probe(PROBE, job)


def test_greedy_output_is_identical_when_extra_candidates_win(probe):
    assert probe["scored"] == probe["plain"]
    scorer = probe["scorer_before_penalised"]
    assert scorer["wins"] > 0 and scorer["won_tokens"] > 0, scorer


def test_candidates_crossed_blocks_and_started_on_full_ones(probe):
    """Copy-on-write of a partly filled last block, and contexts that end exactly on a
    block boundary (nothing to copy), both happened and the output held. Every other
    prompt is cut to whole blocks, so that its first decode step starts one: before, the
    boundary starts hung on which lengths the union's timing-driven choices reached (one
    CI run in many had none; the probe counts 10 with the cut prompts against 3 without)."""
    scorer = probe["scorer_before_penalised"]
    assert scorer["copied_blocks"] > 0 and scorer["aligned_starts"] > 0, scorer


def test_requests_finishing_mid_step_stop_where_they_would(probe):
    assert probe["stopped"] == probe["stopped_plain"]
    reasons = {reason for _, reason in probe["stopped"]}
    assert reasons == {"stop", "length"}, probe["stopped"]


def test_preempted_requests_come_back_with_the_same_output(probe):
    assert probe["preemptions"] > 0, "the KV pool was large enough: nothing was preempted"
    assert probe["scored"] == probe["plain"]


def test_the_scheduler_never_sees_a_scratch_block(probe):
    scorer = probe["scorer"]
    assert scorer["num_scratch_blocks"] == SCRATCH, scorer
    assert probe["scheduler_blocks"] == NUM_BLOCKS - SCRATCH == scorer["first_scratch_block"]
    assert scorer["scheduled_scratch_blocks"] == 0, scorer
    # under preemption the scheduler handed out every block of its own pool
    assert scorer["max_scheduled_block"] == NUM_BLOCKS - SCRATCH - 1, scorer


def test_requests_whose_sampling_is_not_reproduced_are_not_expanded(probe):
    """A repetition penalty changes the target's choice: such requests verify one chain."""
    assert probe["penalised"] == probe["penalised_plain"]
    before, after = probe["scorer_before_penalised"], probe["scorer"]
    assert after["extra_rows"] == before["extra_rows"], (before, after)
    assert after["skipped"].get("sampling not reproduced", 0) > before["skipped"].get(
        "sampling not reproduced", 0), (before, after)

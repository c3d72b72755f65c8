"""The real model (SmolLM2-135M-Instruct) as a latency-bound user runs it: ``max_num_seqs=1``.

One in-process engine, the draft-free union (n-gram and suffix, K=8), two code-edit chats
through the chat template, stopping at EOS, in fp32 (where greedy output must equal no
speculation's token for token). Its start-up calibration must time one request verifying
1 + k tokens (knots 1x1 ... 1x8), not a single plain step, and with that curve the
controller must draft on copy-heavy text: priced from one knot as k plain steps, every
draft looked unpayable and the union never drafted.
"""

from __future__ import annotations

import pytest

from specplugin.bench.instruct import INSTRUCT_QUICK_SIZES, cell_messages, source_from_folder
from specplugin.bench.runner import EngineJob, plugin_engine_kwargs, prompt_cell, run_job
from specplugin.bench.workloads import Cell
from specplugin.zoo import smollm2

pytestmark = pytest.mark.vllm

K = 8
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    target = smollm2.fetch() / "target"
    source = source_from_folder(target)
    chats = cell_messages(source.material, INSTRUCT_QUICK_SIZES, Cell("code-edit", 1, 0.0))
    prompts = [source.render(c) for c in chats]

    def cell(key, options=None):
        return {**prompt_cell(prompts, MAX_TOKENS, batch_size=1, key=key, extra_args=options),
                "ignore_eos": False}

    # the speculative cell first: the suffix index must not have seen the answers already
    engine = EngineJob(
        label="smollm2-batch1", model=str(target),
        engine_kwargs={"dtype": "float32", "max_num_seqs": 1,
                       **plugin_engine_kwargs(K, {"proposers": ["ngram", "suffix"]})},
        cells=(cell("union"), cell("reference", {"specplugin_max_k": 0})),
        eager=True, return_token_ids=True)
    return run_job(engine, tmp_path_factory.mktemp("smollm2-batch1"))


def test_a_batch_1_engine_calibrates_one_request_verifying_up_to_k_tokens(job):
    calibration = job.cells["union"]["calibration"]
    assert {"1x1", "1x2", "1x4", "1x8"} <= set(calibration), calibration
    assert all(key.startswith("1x") for key in calibration), calibration


def test_the_union_drafts_on_copy_heavy_text_at_batch_1(job):
    union = job.cells["union"]
    assert union["num_drafts"] >= 10, union
    # tokens per verification step: a code edit copies long spans
    assert 1 + union["num_accepted_tokens"] / union["num_drafts"] > 2.5, union


def test_greedy_output_in_fp32_equals_no_speculation_token_for_token(job):
    union, reference = job.cells["union"]["token_ids"], job.cells["reference"]["token_ids"]
    assert [len(t) for t in union] == [len(t) for t in reference]
    assert union == reference
    assert all(len(t) > 20 for t in reference)

"""specplugin.stack_samples: py-spy's stacks charged to the step's rows, on hand-built
stacks in py-spy's raw format, and on a real engine's: a cell of the suite's shared
engine (tests/shared_engine.py) runs the draft model while py-spy samples its worker, as
``specplugin profile --timers sampled`` does."""

import pytest

from specplugin.stack_samples import (BACKGROUND, DRAFT_FORWARD, FORWARD, IDLE, PLUGIN, VLLM,
                                      SampledLedger, StackRoles, charge, parse_raw)
from tests.prompts import PARSE_HEADER
from tests.shared_engine import add_cell

# the draft model alone, greedy, one request at a time, the worker sampled
SAMPLED_CELL = add_cell("stack_samples/draft", [PARSE_HEADER], max_tokens=48, batch_size=1,
                        options={"specplugin_proposers": "draft"}, sampled=True)

ROLES = StackRoles(frozenset({"PluginDraftProposer._run_model", "PluginDraftProposer._logits"}))

LOOP = ("WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);"
        "patch_method.<locals>.wrapper (specplugin/vllm_layer/patches.py:113);"
        "WorkerProc._execute_worker_rpc (vllm/v1/executor/multiproc_executor.py:1055)")
DECORATOR = "context_decorator.<locals>.decorate_context (torch/utils/_contextlib.py:124)"
STEP = (f"{LOOP};{DECORATOR};Worker.execute_model (vllm/v1/worker/gpu_worker.py:700);"
        f"PluginRunnerMixin.execute_model (specplugin/vllm_layer/worker.py:317);{DECORATOR};"
        "GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:3300)")
SAMPLE = (f"{LOOP};Worker.sample_tokens (vllm/v1/worker/gpu_worker.py:720);"
          "PluginRunnerMixin.sample_tokens (specplugin/vllm_layer/worker.py:400)")
DRAFT = (f"{SAMPLE};GPUModelRunner.sample_tokens (vllm/v1/worker/gpu_model_runner.py:3500);"
         "PluginRunnerMixin.propose_draft_token_ids (specplugin/vllm_layer/worker.py:500);"
         "PluginDraftProposer._draft (specplugin/vllm_layer/draft_proposer.py:700)")
MODEL = "Qwen2ForCausalLM.forward (vllm/model_executor/models/qwen2.py:500)"


def _charge(stack: str):
    ((frames, _),) = parse_raw([stack + " 1\n"])
    return charge(frames, ROLES)


@pytest.mark.parametrize("stack, row, owner", [
    # the plugin's override hands the step to vLLM (through torch.inference_mode's
    # decorator): vLLM's preparation is vLLM's
    (f"{STEP};GPUModelRunner._prepare_inputs (vllm/v1/worker/gpu_model_runner.py:1500)",
     VLLM, None),
    # ... and the target's forward, and its LM head, are the forward
    (f"{STEP};GPUModelRunner._model_forward (vllm/v1/worker/gpu_model_runner.py:2800)",
     FORWARD, None),
    (f"{STEP};Qwen2ForCausalLM.compute_logits (vllm/model_executor/models/qwen2.py:600)",
     FORWARD, None),
    # ... as is the decorator's own code on the way into vLLM's execute_model
    ("{LOOP};Worker.execute_model (vllm/v1/worker/gpu_worker.py:700);"
     "PluginRunnerMixin.execute_model (specplugin/vllm_layer/worker.py:317);".replace(
         "{LOOP}", LOOP) + DECORATOR, VLLM, None),
    # an override's own line, and what it calls that is not its vLLM namesake: the plugin's
    ("{LOOP};Worker.execute_model (vllm/v1/worker/gpu_worker.py:700);"
     "PluginRunnerMixin.execute_model (specplugin/vllm_layer/worker.py:303)".replace(
         "{LOOP}", LOOP), PLUGIN, "PluginRunnerMixin.execute_model"),
    (f"{SAMPLE};plain_decode (specplugin/vllm_layer/worker.py:90)", PLUGIN, "plain_decode"),
    # the draft run's glue, vLLM's builder it calls included, is the plugin's
    (f"{DRAFT};CPUAttentionMetadataBuilder.build (vllm/v1/attention/backends/cpu_attn.py:200)",
     PLUGIN, "PluginDraftProposer._draft"),
    # its model call and LM head are the draft's forward, whatever runs below them
    (f"{DRAFT};PluginDraftProposer._run_model (specplugin/vllm_layer/draft_proposer.py:900);"
     "Module._call_impl (torch/nn/modules/module.py:1784)", DRAFT_FORWARD, None),
    (f"{DRAFT};PluginDraftProposer._logits (specplugin/vllm_layer/draft_proposer.py:950)",
     DRAFT_FORWARD, None),
    # a built-in drafter's model is its draft forward
    (f"{SAMPLE};GPUModelRunner.sample_tokens (vllm/v1/worker/gpu_model_runner.py:3500);"
     "DraftModelProposer.propose (vllm/v1/spec_decode/llm_base_proposer.py:300);" + MODEL,
     DRAFT_FORWARD, None),
    # vLLM's sampler under the plugin's sample_tokens, reached through vLLM's own (also
    # a plain step the plugin runs as vLLM's own: its override calls vLLM's directly)
    (f"{SAMPLE};GPUModelRunner.sample_tokens (vllm/v1/worker/gpu_model_runner.py:3500);"
     "Sampler.forward (vllm/v1/sample/sampler.py:80)", VLLM, None),
    # that step's bookkeeping after vLLM's sampling is the plugin's
    (f"{SAMPLE};PluginRunnerMixin._after_vllm_step (specplugin/vllm_layer/worker.py:514)",
     PLUGIN, "PluginRunnerMixin._after_vllm_step"),
    # outside the step: the plugin's work in the wait, and the wait itself
    (f"{LOOP};after_worker_rpc (specplugin/vllm_layer/worker_wait.py:25);"
     "Union.settle (specplugin/adaptive/union.py:300)", BACKGROUND, "Union.settle"),
    ("WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1030);"
     "MessageQueue.dequeue (vllm/distributed/device_communicators/shm_broadcast.py:600)",
     IDLE, None),
])
def test_each_sample_is_charged_to_one_row(stack, row, owner):
    assert _charge(stack) == (row, owner)


def test_the_ledger_shares_the_steps_samples_and_names_the_plugins_functions():
    lines = [f"{STEP};GPUModelRunner._model_forward (vllm/v1/worker/gpu_model_runner.py:2800) 70\n",
             f"{DRAFT} 20\n",
             f"{SAMPLE};GPUModelRunner.sample_tokens (vllm/v1/worker/gpu_model_runner.py:3500) 10\n",
             f"{LOOP};after_worker_rpc (specplugin/vllm_layer/worker_wait.py:25) 5\n",
             "\n"]
    summary = SampledLedger.from_raw(lines, ROLES).summary()
    assert summary["step_samples"] == 100 and summary["samples"] == 105
    assert summary["shares"] == {FORWARD: 0.7, DRAFT_FORWARD: 0.0, PLUGIN: 0.2, VLLM: 0.1}
    assert summary["own_share"] == 0.2
    assert summary["own_half_interval"] == pytest.approx(1.96 * (0.2 * 0.8 / 100) ** 0.5)
    assert summary["background_share"] == 0.05
    assert summary["plugin_functions"] == [("PluginDraftProposer._draft", 0.2)]


def test_no_samples_in_the_step_is_no_share():
    summary = SampledLedger.from_raw([], ROLES).summary()
    assert summary["step_samples"] == 0 and summary["own_share"] == 0.0


@pytest.mark.vllm
def test_a_real_workers_step_splits_into_forwards_the_plugin_and_vllm(shared_runs):
    """py-spy on the shared engine's worker (its own process, as users run it) while the
    draft model drafts: every row has samples, and the plugin's top functions are its
    own. Seen red with the draft's model call left out of the roles (its forward counted
    as the target's) and with no frame passing through (vLLM's whole step charged to the
    plugin's override of ``execute_model``)."""
    run = shared_runs[SAMPLED_CELL]
    assert run.num_drafts > 0  # the draft model ran (it is the only proposer)
    sampled = run.sampled
    assert sampled["step_samples"] >= 100, sampled
    for row in (FORWARD, DRAFT_FORWARD, PLUGIN, VLLM):
        assert sampled["shares"][row] > 0.0, (row, sampled["shares"])
    assert sum(sampled["shares"].values()) == pytest.approx(1.0)
    assert sampled["shares"][FORWARD] > sampled["shares"][PLUGIN], sampled["shares"]
    # the override's own lines get a sample now and then (as any function may); vLLM's
    # step charged to it would give it most of the plugin's row
    functions = dict(sampled["plugin_functions"])
    override = functions.get("PluginRunnerMixin.execute_model", 0.0)
    assert override <= max(0.25 * sampled["shares"][PLUGIN], 2 / sampled["step_samples"]), functions

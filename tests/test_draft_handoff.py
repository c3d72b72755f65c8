"""Drafts ride back on the step's output; the engine core does not ask the worker again."""

import inspect

from specplugin.vllm_layer import draft_handoff


class _Output:
    pass


class _Executor:
    def __init__(self):
        self.rpcs = 0

    def sample_tokens(self, grammar_output, non_block=False):
        return self.output

    def take_draft_token_ids(self):
        self.rpcs += 1
        return "asked the worker"


def _patched(executor, output):
    executor.output = output
    got = draft_handoff.sample_tokens_keeping_drafts(_Executor.sample_tokens, executor, None)
    assert got is output
    return draft_handoff.take_kept_drafts(_Executor.take_draft_token_ids, executor)


def test_attached_drafts_are_returned_without_a_call_and_only_once():
    executor, output = _Executor(), _Output()
    draft_handoff.attach(output, ["drafts"])
    assert _patched(executor, output) == ["drafts"] and executor.rpcs == 0
    # the next take without a new output asks the worker, as vLLM would
    assert draft_handoff.take_kept_drafts(_Executor.take_draft_token_ids, executor) == \
        "asked the worker"
    assert executor.rpcs == 1


def test_no_drafts_attached_is_a_none_not_a_call():
    executor, output = _Executor(), _Output()
    draft_handoff.attach(output, None)  # the plugin's plain step: nothing drafted
    assert _patched(executor, output) is None and executor.rpcs == 0


def test_outputs_without_the_attribute_keep_vllms_call():
    """vLLM's own speculative methods: their worker attaches nothing."""
    executor = _Executor()
    assert _patched(executor, _Output()) == "asked the worker" and executor.rpcs == 1


def test_vllm_still_fetches_drafts_where_the_patch_expects():
    """When this fails, vLLM moved the post-step draft fetch: revisit draft_handoff."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "self.model_executor.take_draft_token_ids()" in inspect.getsource(EngineCore.post_step)
    for name in ("sample_tokens", "take_draft_token_ids"):
        assert name in MultiprocExecutor.__dict__, name
    source = inspect.getsource(GPUModelRunner.sample_tokens)
    # the drafts exist before the synchronous output is returned
    assert source.index("propose_draft_token_ids(valid_sampled_token_ids)") < \
        source.index("if not self.use_async_scheduling:\n            return output")


def test_a_mixed_batch_hands_the_sampler_each_rows_tokens_and_probabilities():
    """The union's output at temperature > 0: a draft-model row keeps its draft
    probabilities, a token-level row gets one-hot ones on its own tokens (a wrong
    one-hot would make vLLM's rejection sampler accept what the target would not
    sample: no end-to-end test sees that, the union rarely sends token-level drafts to
    sampled rows), nothing beyond each row's length."""
    import numpy as np
    import torch

    from specplugin.vllm_layer.draft_inputs import mixed_draft_probs

    vocab = 11
    draft_probs = torch.rand((4, 3, vocab))
    drafts = [[3, 4], [6, 2, 1], [], [10]]  # row 0 the draft's, rows 1 and 3 token-level
    draft_rows = np.array([True, False, True, False])
    probs = mixed_draft_probs(draft_probs, drafts, draft_rows)
    assert probs.shape == (4, 3, vocab)
    assert torch.equal(probs[0, :2], draft_probs[0, :2]) and not probs[0, 2].any()
    for r, draft in ((1, [6, 2, 1]), (3, [10])):
        one_hot = torch.zeros((3, vocab))
        one_hot[torch.arange(len(draft)), torch.tensor(draft)] = 1.0
        assert torch.equal(probs[r], one_hot), r
    assert not probs[2].any()
    assert mixed_draft_probs(None, drafts, draft_rows) is None  # greedy: no probabilities

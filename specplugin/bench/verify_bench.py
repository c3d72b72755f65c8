"""vLLM's rejection sampler against the plugin's ``verify_greedy`` and ``verify_sampled``,
timed on all-greedy batches and on temperature-1 batches with draft probabilities.

Run: ``.venv/bin/python -m specplugin.bench.verify_bench``. The tests use its metadata builders.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def spec_decode_metadata(drafts: list[list[int]]):
    """vLLM's ``SpecDecodeMetadata`` with logits laid out as its runner does: one per draft
    token, then the bonus position (``make_dummy`` leaves every index 0)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    counts = np.array([len(d) for d in drafts])
    ends = np.cumsum(counts + 1)
    target = np.concatenate([np.arange(e - k - 1, e - 1) for e, k in zip(ends, counts)])
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=counts.tolist(),
        cu_num_draft_tokens=torch.from_numpy(np.cumsum(counts).astype(np.int32)),
        cu_num_sampled_tokens=torch.from_numpy(ends.astype(np.int32)),
        target_logits_indices=torch.from_numpy(target.astype(np.int32)),
        bonus_logits_indices=torch.from_numpy((ends - 1).astype(np.int32)),
        logits_indices=torch.arange(int(ends[-1]), dtype=torch.int32))


def greedy_sampling_metadata(num_reqs: int, **changes):
    """vLLM's ``SamplingMetadata`` of a plain all-greedy batch, with ``changes`` applied."""
    import dataclasses

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    plain = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs), presence_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs), output_token_ids=[[] for _ in range(num_reqs)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return dataclasses.replace(plain, **changes)


def _ms(call, repeats: int) -> float:
    for _ in range(20):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=6144)  # the zoo's pairs
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from specplugin.vllm_layer.verification import Heard, verify_greedy, verify_sampled

    current_platform.register_triton_kernel_overrides()  # as an engine does (CPU: C++)
    vllms = RejectionSampler(Sampler())
    rng = np.random.default_rng(0)
    for batch, k in ((1, 3), (1, 8), (8, 4), (8, 8), (16, 2)):
        drafts = rng.integers(0, args.vocab_size, size=(batch, k)).tolist()
        metadata, sampling = spec_decode_metadata(drafts), greedy_sampling_metadata(batch)
        logits = torch.randn(batch * (k + 1), args.vocab_size)  # [num_sampled, vocab_size]
        theirs = _ms(lambda: vllms(metadata, None, logits, sampling), args.repeats)
        ours = _ms(lambda: verify_greedy(logits, metadata, sampling, vllms), args.repeats)
        print(f"batch {batch:2d}, {k} draft tokens each, greedy: vLLM's rejection sampler "
              f"{theirs:.3f} ms, the plugin's greedy verification {ours:.3f} ms")
        sampling = greedy_sampling_metadata(batch, all_greedy=False, all_random=True,
                                            temperature=torch.ones(batch))
        probs = torch.rand(batch * k, args.vocab_size)
        probs /= probs.sum(-1, keepdim=True)  # [num_draft_tokens, vocab_size]
        theirs = _ms(lambda: vllms(metadata, probs, logits.clone(), sampling), args.repeats)
        ours = _ms(lambda: verify_sampled(logits, metadata, sampling, probs, Heard()),
                   args.repeats)
        print(f"batch {batch:2d}, {k} draft tokens each, temperature 1: vLLM's rejection "
              f"sampler {theirs:.3f} ms, the plugin's sampled verification {ours:.3f} ms")


if __name__ == "__main__":
    main()

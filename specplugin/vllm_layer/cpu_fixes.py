"""A correct CPU fallback for vLLM's ``expand_kernel`` (rejection sampler), installed by register().

vLLM 0.32's CPU stand-in for the Triton ``expand_kernel``
(``vllm/utils/cpu_triton_utils.py: _expand_kernel_impl``) hands the C++ kernel
``output.to(torch.int64)``: for any output that is not int64 (the per-token
temperatures are float32, top-k int32) that is a copy, the kernel writes into the
copy, and the real output keeps whatever ``new_empty`` left there. The rejection
sampler then divides the target logits by uninitialised "temperatures", so
speculative decoding at temperature > 0 on CPU samples from the wrong distribution,
for vLLM's built-in methods and for this plugin alike (``specplugin check-lossless``
caught it; ``tests/test_cpu_fixes.py`` fails once vLLM fixes it, so the patch can go).

This replacement does the same expansion in PyTorch for every dtype.
"""

from __future__ import annotations

import torch


def expand_kernel_impl(
    output: torch.Tensor,  # [num_tokens]
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size] cumulative tokens per row
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # the Triton launch's block size; unused on CPU
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (with ``replace_from`` -> ``replace_to``)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    expanded = torch.repeat_interleave(values, counts)  # [cu_num_tokens[-1]]
    output[: expanded.shape[0]] = expanded.to(output.dtype)

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

This replacement does the same expansion for every dtype: on the host with numpy where
numpy has the dtype (the rejection sampler calls it at every sampled speculative step, for
the temperatures and any top-k or top-p; measured at batch 1 and 8, 35 and 20 us a call
against 86 and 75 us for the same work in torch ops), else in torch ops.
"""

from __future__ import annotations

import numpy as np
import torch

# dtypes a tensor shares with numpy without a copy (not bfloat16)
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int32,
                           torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool})


def expand_kernel_impl(
    output: torch.Tensor,  # [num_tokens]
    input_val: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size] cumulative tokens per row
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # the Triton launch's block size; unused on CPU
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (with ``replace_from`` -> ``replace_to``)."""
    if (output.device.type == "cpu" and input_val.device.type == "cpu"
            and cu_num_tokens.device.type == "cpu" and output.dtype in _NUMPY_DTYPES
            and input_val.dtype in _NUMPY_DTYPES and cu_num_tokens.dtype in _NUMPY_DTYPES):
        cu = cu_num_tokens.numpy()
        values = input_val.numpy()
        replace = values == replace_from
        if replace.any():
            values = np.where(replace, values.dtype.type(replace_to), values)
        counts = np.empty_like(cu)  # [batch_size] tokens per row
        counts[:1] = cu[:1]
        np.subtract(cu[1:], cu[:-1], out=counts[1:])
        expanded = np.repeat(values, counts)  # [cu_num_tokens[-1]]
        output.numpy()[: expanded.size] = expanded  # (cast to the output's dtype)
        return
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    expanded = torch.repeat_interleave(values, counts)  # [cu_num_tokens[-1]]
    output[: expanded.shape[0]] = expanded.to(output.dtype)

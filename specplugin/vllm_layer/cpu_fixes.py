"""A correct CPU fallback for vLLM's ``expand_kernel`` (rejection sampler), installed by register().

vLLM 0.32's CPU stand-in (``cpu_triton_utils._expand_kernel_impl``) writes into
``output.to(torch.int64)``, a copy for non-int64 outputs (float32 temperatures), so CPU
sampling at temperature > 0 reads uninitialised values. ``tests/test_cpu_fixes.py`` fails
once vLLM fixes it. Uses numpy where it has the dtype (~2-4x faster than torch ops), else torch.
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

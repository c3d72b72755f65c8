"""vLLM 0.32 CPU traps the plugin works around: the `expand_kernel` fallback (wrong for floats; the plugin's replacement is right) and the kernel-override scan that numba tripped."""

import subprocess
import sys
import textwrap

import pytest
import torch

from specplugin.vllm_layer.cpu_fixes import expand_kernel_impl

CU = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # row lengths 2, 0, 3, 1


def _expand(impl, values: torch.Tensor, replace_from=0, replace_to=0) -> torch.Tensor:
    out = torch.full((6,), -7, dtype=values.dtype)
    impl(out, values, CU, replace_from, replace_to)
    return out


def test_replacement_expands_every_dtype():
    for values, want in [
        (torch.tensor([0.7, 9.0, 1.3, 0.0]), [0.7, 0.7, 1.3, 1.3, 1.3, 0.0]),
        (torch.tensor([5, 9, 0, 2], dtype=torch.int32), [5, 5, 0, 0, 0, 2]),
        (torch.tensor([5, 9, 0, 2], dtype=torch.int64), [5, 5, 0, 0, 0, 2]),
    ]:
        assert torch.allclose(_expand(expand_kernel_impl, values).double(),
                              torch.tensor(want, dtype=torch.float64))


def test_replacement_applies_replace_from_to():
    got = _expand(expand_kernel_impl, torch.tensor([0.0, 1.0, 0.5, 0.0]), 0.0, 1.0)
    assert got.tolist() == [1.0, 1.0, 0.5, 0.5, 0.5, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64])
def test_the_numpy_path_and_the_torch_path_expand_alike(dtype):
    """numpy's dtypes take the host path, bfloat16 the torch ops: the same expansion, with
    rows of no tokens, a replaced value, and the output's tail left alone."""
    cu = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)  # row lengths 0, 3, 0, 1, 2
    values = torch.tensor([4, -1, 2, -1, 8]).to(dtype)
    out = torch.full((8,), 5, dtype=dtype)
    expand_kernel_impl(out, values, cu, -1, 1)
    assert out.tolist() == [1, 1, 1, 1, 8, 8, 5, 5]


def test_vllm_fallback_is_still_wrong_for_floats():
    """When this fails vLLM fixed its kernel: drop the patch in plugin.register()."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    from specplugin.vllm_layer import patches

    current_platform.import_kernels()  # loads vLLM's C++ ops (torch.ops._C)

    original = patches._APPLIED.get((cpu_triton_utils, "_expand_kernel_impl"))
    impl = original.original if original else cpu_triton_utils._expand_kernel_impl
    got = _expand(impl, torch.tensor([0.7, 9.0, 1.3, 0.25]))
    assert got.tolist() != torch.tensor([0.7, 0.7, 1.3, 1.3, 1.3, 0.25]).tolist()


@pytest.mark.vllm
def test_a_worker_process_gets_the_fixed_kernel():
    """As in a vLLM worker: plugins load, then the platform registers its kernel fallbacks."""
    code = textwrap.dedent("""
        import torch
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.platforms import current_platform
        current_platform.register_triton_kernel_overrides()
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
        x = torch.tensor([0.7, 1.3], dtype=torch.float32)
        print("EXPANDED", expand_batch_to_tokens(x, torch.tensor([3, 5], dtype=torch.int32), 5).tolist())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("EXPANDED"))
    got = eval(line.split(" ", 1)[1])
    assert torch.allclose(torch.tensor(got), torch.tensor([0.7, 0.7, 0.7, 1.3, 1.3]))


def test_vllms_kernel_override_scan_survives_numba():
    """The plugin's compiled host loops import numba (``specplugin.host_kernels``); each
    vLLM CPU worker then scans every loaded module's attributes for Triton kernels to
    swap, calling ``vars(value).get`` on whatever has a ``__dict__``, where numba's
    ``llvmlite.binding.ffi.lib`` answered with a wrapped function: the worker died as it
    started (seen in this suite's in-process engines)."""
    import specplugin.host_kernels  # noqa: F401
    from vllm.triton_utils.dispatcher import _rebind_kernels

    _rebind_kernels([])  # the scan, no kernel to swap

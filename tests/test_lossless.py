"""``specplugin check-lossless``: its comparisons (fast) and one real ``--quick`` run (slow)."""

import subprocess
import sys

import pytest

from specplugin.bench.lossless import compare_samples, first_difference, greedy_mismatches
from specplugin.bench.tinymodel import repetitive_prompts


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # a shorter output differs where it stops


def test_greedy_mismatches_name_cell_request_and_position():
    reference = {"mixed/b8/t0": {"token_ids": [[1, 2, 3], [4, 5, 6]]}}
    candidate = {"mixed/b8/t0": {"token_ids": [[1, 2, 3], [4, 9, 6]]}}
    assert greedy_mismatches(reference, candidate) == [
        {"cell": "mixed/b8/t0", "request": 1, "position": 1, "expected": 5, "got": 9}]
    assert greedy_mismatches(reference, reference) == []


def test_sampled_comparison_accepts_one_distribution_and_rejects_another():
    import torch

    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    other = torch.tensor([0.4, 0.35, 0.15, 0.10])

    def draws(p, n=4000):
        return torch.multinomial(p, n * 2, replacement=True, generator=gen).view(n, 2).tolist()

    same = compare_samples([draws(probs)], [draws(probs)], num_positions=2, vocab_size=4)
    assert min(t.p_value for t in same) > 1e-3
    differ = compare_samples([draws(probs)], [draws(other)], num_positions=2, vocab_size=4)
    assert max(t.p_value for t in differ) < 1e-6
    assert [(t.prompt, t.position) for t in differ] == [(0, 0), (0, 1)]


def test_repetitive_prompts_repeat_a_pattern_and_avoid_eos():
    prompts = repetitive_prompts(vocab_size=12, num_prompts=3, length=12)
    assert prompts[0][:4] == prompts[0][2:6]  # period 2
    assert prompts[1][:3] == prompts[1][3:6]  # period 3
    assert all(0 < t < 12 for p in prompts for t in p)


@pytest.mark.vllm
def test_quick_check_lossless_passes_on_real_vllm(quick_zoo, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "specplugin.cli", "check-lossless", "--quick", "--zoo",
         str(quick_zoo), "--out-dir", str(tmp_path / "lossless")],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout
    assert "accepted" in proc.stdout  # drafts were proposed and verified, not just skipped

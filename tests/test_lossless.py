"""``specplugin check-lossless``: its comparisons (fast) and one real ``--quick`` run (slow)."""

import re
import subprocess
import sys

import pytest

from specplugin.bench.lossless import compare_samples, first_difference, greedy_mismatches
from specplugin.bench.tinymodel import repetitive_prompts

SCORER_METHOD = "plugin-union-scorer-decoy"
QUICK_METHODS = ["plugin-ngram+suffix", "plugin-draft"]


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


def test_a_missing_request_or_cell_is_a_mismatch():
    reference = {"mixed/b8/t0": {"token_ids": [[1, 2, 3], [4, 5, 6]]}}
    fewer = {"mixed/b8/t0": {"token_ids": [[1, 2, 3]]}}
    assert [m["got"] for m in greedy_mismatches(reference, fewer)] == ["1 requests"]
    assert [m["got"] for m in greedy_mismatches(reference, {})] == ["missing"]


def test_sampled_comparison_refuses_missing_prompts():
    with pytest.raises(ValueError, match="every prompt must be compared"):
        compare_samples([[[1, 2]], [[1, 2]]], [[[1, 2]]], num_positions=2, vocab_size=4)


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
def test_quick_check_lossless_passes_on_real_vllm(zoo_root, tmp_path):
    """The greedy check runs on the committed zoo: on the seconds-trained quick pair even
    vLLM's own draft_model gets no draft accepted, and identical outputs from drafts that
    were all rejected would prove nothing (the check fails on that).

    One method per drafting path (each method costs two engines): the token-level
    proposers alone (the Speculator), the draft model alone, and the full union (draft
    model, n-gram, suffix) with the batch-expanding scorer and every draft beside a
    decoy, so that its extra candidates carry the output (greedy and temperature 1; at temperature 1 the draft model's rows,
    which are never decoyed, carry their probabilities in the same batch). The union
    without the scorer is greedy-checked in tests/test_union_e2e.py; the other subsets
    differ from these in settings only."""
    methods = QUICK_METHODS
    proc = subprocess.run(
        [sys.executable, "-m", "specplugin.cli", "check-lossless", "--quick", "--eager", "--zoo",
         str(zoo_root), "--out-dir", str(tmp_path / "lossless"),
         "--methods", ",".join([*methods, SCORER_METHOD])],
        capture_output=True, text=True, timeout=1200)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    assert re.search(r"[─-]+ PASS [─-]+", out), out[-3000:]  # rich's rule line
    # every plugin method was checked both ways, with drafts proposed and accepted
    greedy = dict(re.findall(r"ok\s+(\S+): all outputs identical \(drafts \d+, accepted "
                             r"tokens (\d+)\)", out))
    sampled = dict(re.findall(r"(\S+): drafts \d+, draft tokens \d+, accepted (\d+)", out))
    same = re.findall(r"ok\s+(\S+): same distribution as without speculation", out)
    for name in methods:
        assert int(greedy.get(name, 0)) > 0, (name, out[-4000:])
        assert int(sampled.get(f"sampled-{name}", sampled.get(name, 0))) > 0, (name, out[-4000:])
        assert name in same or f"sampled-{name}" in same, (name, out[-4000:])
    # the scorer's extra candidates won steps, in both checks, and the output held
    won = re.findall(rf"{SCORER_METHOD}: .*extra candidates won (\d+)", out)
    assert len(won) == 2 and all(int(n) > 0 for n in won), out[-4000:]
    assert SCORER_METHOD in same and re.search(rf"ok\s+{SCORER_METHOD}: all outputs identical",
                                               out), out[-4000:]


def test_check_lossless_refuses_bad_alpha_and_draws_by_name():
    """Bad options are refused by name before any engine starts."""
    for args, fragment in ((["--alpha", "0"], "--alpha must be in (0, 0.5]"),
                           (["--alpha", "-1"], "--alpha must be in (0, 0.5]"),
                           (["--draws", "0"], "--draws must be an integer of at least 100")):
        proc = subprocess.run([sys.executable, "-m", "specplugin.cli", "check-lossless", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]


def test_the_greedy_check_runs_at_the_batch_asked(zoo_root):
    from specplugin.bench.lossless import _greedy_cells

    for batch_size in (1, 8):
        cells = _greedy_cells(zoo_root, quick=True, batch_size=batch_size)
        assert [cp.cell.batch_size for cp in cells] == [batch_size] * len(cells)
        assert all(len(cp.prompts) == 16 for cp in cells)

"""The benchmark scripts outside vLLM (docs/benchmarks.md, cold caches): scripts/core_bench.py,
the union's core, and scripts/ngram_bench.py, the n-gram proposer, still run on the interfaces
they drive: a few steps, warm and cold."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "core_bench.py"


def test_the_core_benchmark_runs_and_prints_its_figure():
    for extra in ([], ["--cold"]):
        out = subprocess.run([sys.executable, str(SCRIPT), "--batch", "2", "--steps", "5",
                              "--repeats", "1", *extra], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "ms a step" in out.stdout and ("cold" in out.stdout) == bool(extra)


def test_the_ngram_benchmark_runs_and_prints_its_figure():
    """scripts/ngram_bench.py (the n-gram proposer alone) runs on the proposer's interface."""
    script = SCRIPT.parent / "ngram_bench.py"
    out = subprocess.run([sys.executable, str(script), "--batch", "2", "--steps", "5", "--cold"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "us a call" in out.stdout and "cold caches" in out.stdout

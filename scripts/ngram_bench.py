"""The n-gram proposer alone, one call a step, with warm caches and with cold ones.

Why: the proposer runs right after the target's forward, whose kernels have swept the
caches (see ``scripts/core_bench.py``); ``--cold`` multiplies through 32 MB of random
matrices before each call, as that script does. The text is repetitive on purpose (spans
of one shared passage, with fresh tokens between them), so that a row's last tokens have
occurred many times before, as in code: the case where a search that visits every earlier
occurrence in Python is slowest. Each row's context grows by 1-5 tokens a step, from 300
to 3,900 tokens. To compare two versions, run it with each on ``PYTHONPATH`` (a
``git worktree`` of the old commit), one after the other.

    .venv/bin/python scripts/ngram_bench.py --batch 8 --cold
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specplugin.proposers.base import StepBatch
from specplugin.proposers.ngram import NgramProposer

MAX_LEN = 4096  # the token buffer's width (vLLM's max_model_len)
TEXT_LEN = 4000  # each row's text
START, END = 300, 3900  # each row's context at its first step, and where its text is used up


def _token_buffer(batch: int, rng: np.random.Generator) -> np.ndarray:  # [batch, MAX_LEN] int32
    shared = rng.integers(5, 3000, size=400)
    token_ids = np.zeros((batch, MAX_LEN), dtype=np.int32)
    for r in range(batch):
        parts = []
        for _ in range(40):
            start = rng.integers(0, 350)
            parts += [shared[start:start + rng.integers(5, 40)],
                      rng.integers(5, 3000, size=rng.integers(2, 12))]
        text = np.concatenate(parts)[:TEXT_LEN]
        token_ids[r, :len(text)] = text
    return token_ids


def run(batch: int, steps: int, cold: bool) -> np.ndarray:
    """Microseconds of each ``propose`` call after the first 100."""
    weights = [torch.randn(1024, 1024) for _ in range(8)]
    x = torch.randn(8, 1024)
    rng = np.random.default_rng(0)
    token_ids = _token_buffer(batch, rng)
    num_tokens = np.full(batch, START, dtype=np.int64)
    req_ids = tuple(f"r{r}" for r in range(batch))
    proposer = NgramProposer()
    times = []
    for _ in range(steps + 100):
        if num_tokens.max() > END:  # the texts are used up: new requests
            num_tokens[:] = START
            proposer.finish_requests(req_ids)
        step_batch = StepBatch(req_ids, token_ids, num_tokens.copy(), np.full(batch, 100),
                               np.full(batch, 8), np.zeros(batch, dtype=bool),
                               tuple(range(batch)))
        if cold:
            y = x
            for w in weights:
                y = y @ w
        start = time.perf_counter()
        proposer.propose(step_batch)
        times.append(time.perf_counter() - start)
        num_tokens += rng.integers(1, 6, size=batch)
    return np.array(times[100:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--cold", action="store_true",
                        help="sweep the caches before each call, as a forward does")
    args = parser.parse_args()
    us = run(args.batch, args.steps, args.cold)
    print(f"batch {args.batch}, {'cold' if args.cold else 'warm'} caches: median "
          f"{np.median(us):.1f} us a call, mean {us.mean():.1f} ({args.steps} calls)")


if __name__ == "__main__":
    main()

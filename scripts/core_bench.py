"""The union's per-step core outside vLLM, with warm caches and with cold ones.

Why: inside an engine the plugin's work runs right after the target's forward, which
has swept the processor's caches (weights and activations); the same Python code then
runs several times slower than in a loop that keeps it warm (measured on this project's
2-core AMD EPYC machine, batch 1, commit 28dd3ea: 0.178 ms a step warm, 0.631 ms cold;
docs/benchmarks.md, "Cold caches"). ``--cold`` reproduces that: before each of the core's two calls per
step (before learning, and where the draft model would run) it multiplies through
32 MB of random matrices, about what the validation target's forward touches. The core
is timed alone (the sweeps are not counted).

What runs per step, greedy, on a synthetic copy-friendly text: ``Union.begin`` (learn
from the last verification), ``ask`` (n-gram, suffix), ``plan_draft`` (the draft's
gate), the draft's candidate (a stand-in: the true next tokens half of the time, random
ones otherwise) and ``choose``. The gate runs in the steps it is due
(``Union.draft_gate_due``), as in the engine. Verification is simulated exactly (greedy).
The union's background is deferred, as in an engine, and its jobs run untimed after each
step (the worker's wait, :mod:`specplugin.vllm_layer.worker_wait`).

    .venv/bin/python scripts/core_bench.py --batch 1 --cold
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specplugin.adaptive.background import Background
from specplugin.adaptive.cost import StepCostModel
from specplugin.proposers.base import StepBatch
from specplugin.proposers.draft import DraftCandidates
from specplugin.proposers.ngram import NgramProposer
from specplugin.proposers.suffix import SuffixProposer
from specplugin.adaptive.union import Union, Verified

K = 8  # most draft tokens per row
PROMPT = 200  # tokens of each row's context before its first step


def _texts(batch: int) -> list[np.ndarray]:
    """Rows of spans copied from one shared text, with fresh tokens between them."""
    rng = np.random.default_rng(1)
    shared = rng.integers(5, 3000, size=300)
    texts = []
    for seed in range(batch):
        r = np.random.default_rng(seed)
        parts = []
        for _ in range(12):
            start, length = r.integers(0, 250), r.integers(10, 50)
            parts += [shared[start:start + length], r.integers(5, 3000, size=r.integers(2, 15))]
        texts.append(np.concatenate(parts))
    return texts


def run(batch: int, steps: int, cold: bool, repeats: int, choose_only: bool = False) -> list[float]:
    """ms per step of the core, one figure per repeat (after 50 untimed steps);
    ``choose_only``: of ``Union.choose`` alone (estimates, plan, alternates, remembering)."""
    weights = [torch.randn(1024, 1024) for _ in range(8)]
    x = torch.randn(8, 1024)

    def sweep() -> None:
        y = x
        for w in weights:
            y = y @ w

    truth = _texts(batch)
    token_ids = np.zeros((batch, 2048), dtype=np.int64)
    for r, t in enumerate(truth):
        token_ids[r, :len(t)] = t
    num_tokens = np.full(batch, PROMPT)
    cost = StepCostModel(max_tokens=2048)
    cost.calibrate(np.array([1, 4, 16, 64, 256]), np.array([0.005, 0.0055, 0.007, 0.012, 0.04]))
    draft = DraftCandidates()
    union = Union([NgramProposer(), SuffixProposer(), draft], cost=cost,
                  background=Background(deferred=True))
    req_ids = tuple(f"r{r}" for r in range(batch))
    rng = np.random.default_rng(2)
    verified, spent = None, [0.0]

    def steps_of(n: int) -> None:
        nonlocal verified
        for _ in range(n):
            union.background.run_pending()  # (the worker's wait before a step: untimed)
            if any(num_tokens[r] > len(truth[r]) - 20 for r in range(batch)):
                num_tokens[:] = PROMPT  # the texts are used up: new requests, same text
                union.finish_requests(list(req_ids))
            step_batch = StepBatch(req_ids, token_ids, num_tokens.copy(), np.full(batch, PROMPT),
                                   np.full(batch, K), np.zeros(batch, bool), tuple(range(batch)))
            if cold:
                sweep()
            start = time.perf_counter()
            if not union.begin(verified, batch, False):
                continue
            offers = union.ask(step_batch, range(2))
            caps = (np.asarray(union.plan_draft(step_batch, offers, 2, np.full(batch, K), 0.0015))
                    if union.draft_gate_due() else np.zeros(batch, dtype=np.int64))
            if not choose_only:
                spent[0] += time.perf_counter() - start
            guesses = np.zeros((batch, K), dtype=np.int64)
            for r in range(batch):
                n = num_tokens[r]
                guesses[r] = (truth[r][n:n + K] if rng.random() < 0.5
                              else rng.integers(5, 3000, K))
            draft.set(guesses, np.full((batch, K), 0.6), caps)
            if cold:
                sweep()
            start = time.perf_counter()
            drafts = union.choose(step_batch, offers + union.ask(step_batch, [2])).drafts
            spent[0] += time.perf_counter() - start
            emitted, scheduled = np.zeros(batch, dtype=int), np.zeros(batch, dtype=int)
            for r, d in enumerate(drafts):
                n, d = num_tokens[r], np.asarray(d, dtype=np.int64)
                wrong = np.flatnonzero(d != truth[r][n:n + len(d)])
                emitted[r] = (int(wrong[0]) if wrong.size else len(d)) + 1
                scheduled[r] = len(d)
            num_tokens[:] += emitted
            next_tokens = [int(truth[r][num_tokens[r] - 1]) for r in range(batch)]
            verified = Verified(req_ids, scheduled, emitted, 0.006 + 0.0002 * scheduled.sum(),
                                int(batch + scheduled.sum()),
                                draft_seconds=0.0015 * int(caps.max() > 0),
                                next_tokens=next_tokens)

    steps_of(50)
    figures = []
    for _ in range(repeats):
        spent[0] = 0.0
        steps_of(steps)
        figures.append(spent[0] / steps * 1e3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true",
                        help="sweep the caches before each call, as a forward does")
    parser.add_argument("--choose-only", action="store_true",
                        help="time Union.choose alone (the compiled plan and its glue)")
    args = parser.parse_args()
    figures = run(args.batch, args.steps, args.cold, args.repeats, args.choose_only)
    print(f"batch {args.batch}, {'choose, ' if args.choose_only else ''}"
          f"{'cold' if args.cold else 'warm'} caches: "
          f"{min(figures):.3f} ms a step (best of {args.repeats}), "
          f"median {float(np.median(figures)):.3f}")


if __name__ == "__main__":
    main()

"""The union's per-step core outside vLLM, with warm caches and with cold ones.

Why: inside an engine the plugin's work runs right after the target's forward, which
has swept the processor's caches (weights and activations); the same Python code then
runs several times slower than in a loop that keeps it warm (measured on this project's
2-core AMD EPYC machine, batch 1, commit 28dd3ea: 0.178 ms a step warm, 0.631 ms cold;
docs/benchmarks.md, "Cold caches"). ``--cold`` reproduces that: before each step, and
where the draft model would run, it multiplies through 32 MB of random matrices, about
what the validation target's forward touches. The core is timed alone (the sweeps are
not counted).

What runs per step, greedy, on a synthetic copy-friendly text: ``Union.step`` (learn
from the last verification, ask n-gram and suffix, the draft's gate when due, the draft's
candidate from a stand-in, the true next tokens half of the time, random ones
otherwise, and the plan). Verification is simulated exactly (greedy). The union's
background is deferred, as in an engine, and its jobs run untimed after each step (the
worker's wait, :mod:`specplugin.vllm_layer.worker_wait`).

    .venv/bin/python scripts/core_bench.py --batch 1 --cold
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specplugin.adaptive.background import Background
from specplugin.adaptive.cost import StepCostModel
from specplugin.proposers.base import Candidate, StepBatch
from specplugin.proposers.draft import DraftCandidates
from specplugin.proposers.ngram import NgramProposer
from specplugin.proposers.suffix import SuffixProposer
from specplugin.adaptive.draft_rule import WARMUP_FORWARDS
from specplugin.adaptive.learning import Verified
from specplugin.adaptive.plan import DraftOutput
from specplugin.adaptive.union import Union

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


class StandIn:
    """The draft model for :meth:`Union.step`: its guesses are the true next tokens half
    of the time, random ones otherwise (a run sweeps the caches first with ``--cold``)."""

    ran_last_step = True

    def __init__(self, truth: list[np.ndarray], sweep, clock: list[float]):
        self.truth, self.sweep, self.clock = truth, sweep, clock
        self.rng = np.random.default_rng(2)
        self.ran = False

    def catch_up_tokens(self, batch: StepBatch) -> list[int]:
        return [0] * batch.num_reqs

    def param_ratio(self) -> float:
        return 0.1

    def run(self, batch: StepBatch, caps: list[int], held: bool) -> DraftOutput:
        start = time.perf_counter()  # (the stand-in's own time is not the core's)
        if self.sweep is not None:
            self.sweep()
        self.ran = True
        candidates: list[Candidate | None] = []
        for r, cap in enumerate(caps):
            n = int(batch.num_tokens[r])
            guess = (self.truth[r][n:n + K] if self.rng.random() < 0.5
                     else self.rng.integers(5, 3000, K))[:cap]
            candidates.append(Candidate(np.asarray(guess, dtype=np.int64), np.full(len(guess), 0.6))
                              if cap else None)
        lengths = [len(c) if c is not None else 0 for c in candidates]
        self.clock[0] -= time.perf_counter() - start
        return DraftOutput(lengths, [[0.6] * n for n in lengths], K, candidates)


def run(batch: int, steps: int, cold: bool, repeats: int) -> list[float]:
    """ms per step of the core, one figure per repeat (after 50 untimed steps)."""
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
    union = Union([NgramProposer(), SuffixProposer(), DraftCandidates()], cost=cost,
                  background=Background(deferred=True))
    for _ in range(WARMUP_FORWARDS + 1):  # a draft forward: 1.5 ms
        union.draft_costs.observe_forward(0.0015)
    req_ids = tuple(f"r{r}" for r in range(batch))
    verified, spent = None, [0.0]
    draft = StandIn(truth, sweep if cold else None, spent)

    def steps_of(n: int) -> None:
        nonlocal verified
        for _ in range(n):
            union.background.run_pending()  # (the worker's wait before a step: untimed)
            if any(num_tokens[r] > len(truth[r]) - 20 for r in range(batch)):
                num_tokens[:] = PROMPT  # the texts are used up: new requests, same text
                union.finish_requests(list(req_ids))
            step_batch = StepBatch(req_ids, token_ids, num_tokens.copy(), np.full(batch, PROMPT),
                                   np.full(batch, K), np.zeros(batch, bool), tuple(range(batch)),
                                   remaining_tokens=[1000] * batch)
            if cold:
                sweep()
            draft.ran = False
            start = time.perf_counter()
            drafts = union.step(step_batch, verified, draft=draft).drafts
            spent[0] += time.perf_counter() - start
            emitted, scheduled = np.zeros(batch, dtype=int), np.zeros(batch, dtype=int)
            for r, d in enumerate(drafts or [[] for _ in range(batch)]):
                n, d = num_tokens[r], np.asarray(d, dtype=np.int64)
                wrong = np.flatnonzero(d != truth[r][n:n + len(d)])
                emitted[r] = (int(wrong[0]) if wrong.size else len(d)) + 1
                scheduled[r] = len(d)
            num_tokens[:] += emitted
            next_tokens = [int(truth[r][num_tokens[r] - 1]) for r in range(batch)]
            verified = Verified(req_ids, scheduled, emitted, 0.006 + 0.0002 * scheduled.sum(),
                                int(batch + scheduled.sum()),
                                draft_seconds=0.0015 * draft.ran, next_tokens=next_tokens)

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
    args = parser.parse_args()
    figures = run(args.batch, args.steps, args.cold, args.repeats)
    print(f"batch {args.batch}, {'cold' if args.cold else 'warm'} caches: "
          f"{min(figures):.3f} ms a step (best of {args.repeats}), "
          f"median {float(np.median(figures)):.3f}")


if __name__ == "__main__":
    main()

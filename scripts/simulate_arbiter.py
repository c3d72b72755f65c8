"""Drive the step arbiter with simulated engine steps: how much of a run speculates, and
at what rate against plain decoding, when speculation gains or loses and when the machine
runs slow for a while (e.g. another process). No engine, no model: a check of the
arbiter's decisions under the noise a sampled batch's acceptance brings.

    .venv/bin/python scripts/simulate_arbiter.py

A speculative step emits 1 + its accepted drafts (each of K=4 accepted with probability
0.6 while the ones before were: 2.3 tokens on average, as at temperature 1 on the
validation pair) and takes ``2.3 * plain_step / ratio``; a plain step emits 1 token; every
step's time varies by 10%; "slow" makes steps 2.5x slower for 40 of the 480 steps near
the start. Prints, per case, the run's tokens per second over the plain rate (mean and
worst tenth of 300 seeds) and the share of steps that speculated.
"""

from __future__ import annotations

import numpy as np

from specplugin.adaptive.arbiter import StepArbiter

PLAIN_STEP_S = 0.0051


def run(ratio: float, seed: int, steps: int = 480, slow_steps: int = 0, slow: float = 2.5,
        slow_start: int = 40, p: float = 0.6, k: int = 4) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    mal = 1 + sum(p ** j for j in range(1, k + 1))
    spec_step_s = mal * PLAIN_STEP_S / ratio
    arbiter = StepArbiter()
    arbiter.plain_rate_model = lambda num_reqs: 0.95 / PLAIN_STEP_S
    tokens = seconds = 0.0
    speculative = 0
    for step in range(steps):
        factor = slow if slow_start <= step < slow_start + slow_steps else 1.0
        if arbiter.speculate(1, True):
            speculative += 1
            accepted = 0
            while accepted < k and rng.random() < p:
                accepted += 1
            n, t = 1 + accepted, spec_step_s * np.exp(rng.normal(0, 0.1)) * factor
        else:
            n, t = 1, PLAIN_STEP_S * np.exp(rng.normal(0, 0.1)) * factor
        arbiter.observe(n, t)
        tokens, seconds = tokens + n, seconds + t
    return tokens / seconds * PLAIN_STEP_S, speculative / steps


def main() -> None:
    for slow_steps in (0, 40):
        for ratio in (1.5, 1.3, 1.15, 0.85, 0.7):
            res = np.array([run(ratio, s, slow_steps=slow_steps) for s in range(300)])
            print(f"slow steps {slow_steps:2d}, speculation {ratio:.2f}x plain: "
                  f"rate {res[:, 0].mean():.3f}x plain (worst tenth {np.percentile(res[:, 0], 10):.3f}x), "
                  f"speculating {res[:, 1].mean():.2f} of steps (worst tenth {np.percentile(res[:, 1], 10):.2f})")


if __name__ == "__main__":
    main()

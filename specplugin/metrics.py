"""Counters the plugin keeps about itself (vLLM-free).

- :class:`ProposerStats`: per proposer, what it drafted and got accepted (per position
  too) and what the controller chose; says which proposer earns its keep. Published as
  ``vllm:specplugin_*`` by :mod:`specplugin.vllm_layer.metrics_export`.
- :class:`FailureCounter`: a failing proposer costs speed, never a request; counted and
  logged (first with traceback, then a summary every ``log_every_s``) so a plugin that
  fails every step does not become a silent slow no-op.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


# Step counters (keys of a drafter's ``stats()``) -> help text of
# ``vllm:specplugin_<name>_total``; the one table the exporter and the benchmarks read.
STEP_COUNTERS: dict[str, str] = {
    "steps": "Engine steps the plugin drafted for (or chose not to).",
    "steps_without_drafts": "Steps in which no request verified a draft.",
    "steps_skipped": "Of those, steps whose drafting was skipped altogether (a plain step "
                     "decoded on vLLM's non-speculative path).",
    "steps_foretold_plain": "Of the skipped steps, those the step arbiter had foretold plain "
                            "(its plain block running on), run as vLLM's own plain steps "
                            "with none of the plugin's code in them.",
    "steps_peeked": "Plain steps that the peek (n-gram, else suffix) turned speculative "
                    "(copied text in sight while the step arbiter kept decoding plain).",
    "offers_judged_unsent": "Offers that a step did not send (other proposers' candidates "
                            "for a request), judged against the tokens it emitted: what the "
                            "union learns of its proposers besides the verdicts.",
    "steps_without_draft_model": "Steps in which the draft model's machinery did not run at "
                                 "all (vLLM's preparation of its inputs included): its drafts "
                                 "were not needed.",
    "steps_verified_greedy": "Speculative steps of all-greedy batches verified by the plugin "
                             "instead of vLLM's rejection sampler (the same tokens, without "
                             "its fixed costs).",
    "steps_verified_sampled": "Speculative steps of batches with sampled requests (at a "
                              "temperature, nothing else changing their distribution) "
                              "verified by the plugin instead of vLLM's rejection sampler "
                              "(the same distribution, without its fixed costs).",
}


@dataclass
class ProposerStats:
    """Counters for metrics: per proposer, per draft position, and the controller's choices.
    A *draft* is one request's candidate verified in one step (vLLM's terms)."""

    chosen: Counter = field(default_factory=Counter)  # proposer -> requests drafted by it
    draft_tokens: Counter = field(default_factory=Counter)  # proposer -> tokens verified
    accepted_tokens: Counter = field(default_factory=Counter)  # proposer -> tokens accepted
    verified_candidates: Counter = field(default_factory=Counter)  # proposer -> drafts judged
    won_candidates: Counter = field(default_factory=Counter)  # proposer -> extra candidates won
    # (proposer, n) -> drafts of n tokens verified / with n accepted (per-position counts
    # derive from these: cheaper than counting per token)
    verified_lengths: Counter = field(default_factory=Counter)
    accepted_lengths: Counter = field(default_factory=Counter)
    k_histogram: Counter = field(default_factory=Counter)  # k -> requests (0: no drafts)
    steps: int = 0
    steps_without_drafts: int = 0
    steps_skipped: int = 0  # of those, steps whose drafting was skipped altogether
    steps_peeked: int = 0  # plain steps the peek turned speculative (Union.plain_step)
    offers_judged_unsent: int = 0  # offers not sent, judged (Learner.learn_unchosen)
    # steps where none of the draft model's machinery ran (its drafts were not needed)
    steps_without_draft_model: int = 0
    extra_candidates: int = 0  # candidates sent to the batch-expanding scorer beside the chosen

    def verified(self, proposer: str, num_draft_tokens: int, num_accepted: int) -> None:
        """One draft of ``proposer`` verified: ``num_accepted`` of ``num_draft_tokens`` kept."""
        self.verified_candidates[proposer] += 1
        self.draft_tokens[proposer] += num_draft_tokens
        self.accepted_tokens[proposer] += num_accepted
        self.verified_lengths[proposer, num_draft_tokens] += 1
        self.accepted_lengths[proposer, min(num_accepted, num_draft_tokens)] += 1

    def won(self, proposer: str, num_accepted: int) -> None:
        """An extra candidate of ``proposer`` beat the request's draft: its accepted tokens
        count as this proposer's; draft tokens stay the draft's proposer's, as in vLLM."""
        self.won_candidates[proposer] += 1
        self.accepted_tokens[proposer] += num_accepted
        self.accepted_lengths[proposer, num_accepted] += 1

    @property
    def draft_tokens_per_pos(self) -> Counter:
        """(proposer, position) -> draft tokens verified at that draft position."""
        return _per_position(self.verified_lengths)

    @property
    def accepted_per_pos(self) -> Counter:
        """(proposer, position) -> draft tokens accepted at that draft position."""
        return _per_position(self.accepted_lengths)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able snapshot (keys are strings; per-position counts are lists)."""
        names = sorted(set(self.chosen) | set(self.verified_candidates) | set(self.won_candidates))
        draft_per_pos, accepted_per_pos = self.draft_tokens_per_pos, self.accepted_per_pos
        proposers = {}
        for name in names:
            depth = 1 + max((p for n, p in draft_per_pos if n == name), default=-1)
            proposers[name] = {
                "chosen": self.chosen[name], "drafts": self.verified_candidates[name],
                "won": self.won_candidates[name],
                "draft_tokens": self.draft_tokens[name],
                "accepted_tokens": self.accepted_tokens[name],
                "draft_tokens_per_pos": [draft_per_pos[name, p] for p in range(depth)],
                "accepted_tokens_per_pos": [accepted_per_pos[name, p] for p in range(depth)]}
        return {"steps": self.steps, "steps_without_drafts": self.steps_without_drafts,
                "steps_skipped": self.steps_skipped, "steps_peeked": self.steps_peeked,
                "offers_judged_unsent": self.offers_judged_unsent,
                "steps_without_draft_model": self.steps_without_draft_model,
                "extra_candidates": self.extra_candidates,
                "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
                "proposers": proposers}


def _per_position(lengths: Counter) -> Counter:
    """(proposer, length) -> count, to (proposer, position) -> lengths reaching past it."""
    out: Counter = Counter()
    for (proposer, length), count in lengths.items():
        for position in range(length):
            out[proposer, position] += count
    return out


class FailureCounter:
    """Failures of one proposer (or a plugin shortcut, ``fallback`` naming what takes
    over): counted, logged once in full, then periodically."""

    def __init__(self, name: str, logger: logging.Logger, log_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, fallback: str | None = None):
        self.name = name
        self.logger = logger
        self.log_every_s = log_every_s
        self.clock = clock
        self.fallback = fallback
        self.count = 0
        self._logged_count = 0
        self._last_log: float | None = None

    def record(self) -> None:
        """Call from inside an ``except`` block: counts the failure and maybe logs it."""
        self.count += 1
        now = self.clock()
        if self.count == 1:
            if self.fallback is None:
                self.logger.exception(
                    "specplugin: proposer %r failed; this step decodes without its drafts "
                    "(output is unchanged). Further failures are counted and summarised "
                    "every %.0f s.", self.name, self.log_every_s)
            else:
                self.logger.exception(
                    "specplugin: %s failed; %s takes over (output is unchanged). Further "
                    "failures are counted and summarised every %.0f s.", self.name,
                    self.fallback, self.log_every_s)
        elif now - self._last_log >= self.log_every_s:
            self.logger.warning(
                "specplugin: %s %r failed %d more time(s) (%d in all); %s.",
                "proposer" if self.fallback is None else "the plugin's", self.name,
                self.count - self._logged_count, self.count,
                "those steps decoded without its drafts" if self.fallback is None
                else f"{self.fallback} took over each time")
        else:
            return
        self._last_log, self._logged_count = now, self.count

    def snapshot(self) -> dict[str, int]:
        return {self.name: self.count}

"""Counters the plugin keeps about itself (vLLM-free).

:class:`ProposerStats`: what each proposer drafted and got accepted (per draft
position too), and what the controller chose (K per request and step, steps with no
speculation). vLLM's own ``vllm:spec_decode_*`` counters see drafts only; these say
which proposer earns its keep. The vLLM layer publishes :meth:`ProposerStats.as_dict`
(with the failures and the step arbiter's counts) to ``/metrics`` and
``LLM.get_metrics()`` as ``vllm:specplugin_*`` (:mod:`specplugin.vllm_layer.metrics_export`).

:class:`FailureCounter`: a proposer that raises must cost speed, never a request: the vLLM layer catches the
exception and that step decodes without drafts. Caught silently, though, a proposer
that fails every step would turn the plugin into a slow no-op nobody notices, so
every failure is counted here and reported: the first one with its traceback, then
a one-line summary at most every ``log_every_s`` seconds while failures go on.

The counts are exposed through :meth:`FailureCounter.snapshot` (and the owners'
``stats()``), the place the metrics exporters read.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


# The plugin's whole-engine step counters (keys of a drafter's ``stats()``), each with the
# help text of its Prometheus counter ``vllm:specplugin_<name>_total``: one table for the
# exporter (:mod:`specplugin.vllm_layer.metrics_export`) and the benchmarks, so that a new
# counter is published and measured everywhere once it is added here.
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

    A *draft* is one request's candidate verified in one step; its tokens are *draft
    tokens*, the accepted ones *accepted tokens* (vLLM's terms)."""

    chosen: Counter = field(default_factory=Counter)  # proposer -> requests drafted by it
    draft_tokens: Counter = field(default_factory=Counter)  # proposer -> tokens verified
    accepted_tokens: Counter = field(default_factory=Counter)  # proposer -> tokens accepted
    verified_candidates: Counter = field(default_factory=Counter)  # proposer -> drafts judged
    won_candidates: Counter = field(default_factory=Counter)  # proposer -> extra candidates won
    # (proposer, n) -> drafts of n tokens verified / with n tokens accepted (the
    # per-position counts follow from these, see draft_tokens_per_pos: two counts a draft
    # instead of two a token, on every speculative step)
    verified_lengths: Counter = field(default_factory=Counter)
    accepted_lengths: Counter = field(default_factory=Counter)
    k_histogram: Counter = field(default_factory=Counter)  # k -> requests (0: no drafts)
    steps: int = 0
    steps_without_drafts: int = 0
    steps_skipped: int = 0  # of those, steps whose drafting was skipped altogether
    steps_peeked: int = 0  # plain steps the peek turned speculative (Union.plain_step)
    offers_judged_unsent: int = 0  # offers not sent, judged (Union._learn_unchosen)
    # steps decided before vLLM prepared the draft model's inputs, in which it then ran for
    # no row: none of the draft model's machinery ran (a draft model configured)
    steps_without_draft_model: int = 0
    extra_candidates: int = 0  # candidates sent to the batch-expanding scorer beside the chosen

    def verified(self, proposer: str, num_draft_tokens: int, num_accepted: int) -> None:
        """One draft of ``proposer`` was verified: its first ``num_accepted`` of
        ``num_draft_tokens`` tokens were accepted."""
        self.verified_candidates[proposer] += 1
        self.draft_tokens[proposer] += num_draft_tokens
        self.accepted_tokens[proposer] += num_accepted
        self.verified_lengths[proposer, num_draft_tokens] += 1
        self.accepted_lengths[proposer, min(num_accepted, num_draft_tokens)] += 1

    def won(self, proposer: str, num_accepted: int) -> None:
        """An extra candidate of ``proposer`` beat the request's draft (the batch-expanding
        scorer): its ``num_accepted`` tokens were emitted. They count as this proposer's
        accepted tokens (at their positions); the draft tokens verified stay the draft's
        proposer's, as in vLLM's own counters."""
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
    """(proposer, position) -> how many of the counted lengths reach past that position,
    from (proposer, length) -> count."""
    out: Counter = Counter()
    for (proposer, length), count in lengths.items():
        for position in range(length):
            out[proposer, position] += count
    return out


class FailureCounter:
    """Failures of one proposer (or of one of the plugin's shortcuts, ``fallback``
    naming what takes over): counted, logged once in full, then periodically, never
    once per step."""

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

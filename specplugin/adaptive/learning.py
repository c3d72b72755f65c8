"""What the union learns from a verified step: each sent draft's verdict, the offers it did
not send judged against the emitted tokens, the scorer's extra candidates, the peek's
unsent guesses; all into the acceptance estimator and the requests' histories.

Verdicts are collected (:meth:`Learner.teach`) and go into the estimator in one update
every ``learn_every`` steps (:meth:`Learner.flush`; an update and its sums were a third of
the union's per-step work), except while cold (fewer than :data:`COLD_TOKENS` judged
tokens), where every verdict moves the plan most. vLLM-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specplugin.adaptive.estimator import AcceptanceEstimator, as_list, judged_outcomes
from specplugin.config import MODEL_PROPOSERS
from specplugin.metrics import ProposerStats
from specplugin.proposers.base import StepBatch
from specplugin.requests import Requests

LEARN_EVERY = 4
COLD_TOKENS = 64
_NO_SIGNAL = np.empty(0)  # an offer learned by its cells (see unsent_offers)


def judge_guess(tokens: np.ndarray, emitted: np.ndarray) -> tuple[int, int]:
    """(tokens judged, tokens accepted) of an unsent guess against the tokens emitted since
    it was made: accepted while equal, the first that differs judged and rejected, tokens
    past the emitted ones not judged. What verification would have said: exactly at
    temperature 0, in expectation above (a fixed guess x is accepted with p(x))."""
    seen = min(len(tokens), len(emitted))
    differs = np.flatnonzero(tokens[:seen] != emitted[:seen])
    accepted = int(differs[0]) if differs.size else seen
    return min(accepted + 1, seen), accepted


@dataclass(frozen=True)
class Scored:
    """How a request's candidates fared when the batch-expanding scorer verified extra
    candidates beside its draft (None where the acceptance rule does not tell)."""

    own_accepted: int | None  # tokens of the draft itself that the target accepted
    extra_accepted: tuple[int | None, ...]  # per extra candidate, in the order sent
    extra_lengths: tuple[int, ...]  # tokens of each extra candidate actually verified
    winner: int | None  # index of the extra candidate whose tokens were emitted (None: the draft's)


@dataclass(slots=True)
class Verified:
    """The engine step that just ran, for the requests of the current batch rows."""

    req_ids: tuple[str, ...]  # [num_reqs]
    # [num_reqs] draft tokens the target verified per row (a list, or an array)
    num_scheduled_drafts: Sequence[int] | np.ndarray
    num_emitted: Sequence[int] | np.ndarray  # [num_reqs] tokens each row emitted (accepted + 1)
    seconds: float | None  # wall time of the step (None: unknown, e.g. the first one)
    num_query_tokens: int  # tokens the target ran in it (all rows, drafts included)
    scored: dict[str, Scored] | None = None  # req_id -> outcome, for requests with extras
    # seconds of ``seconds`` the draft model's forwards took (priced apart by the gate)
    draft_seconds: float = 0.0
    # [num_reqs] each verified draft token's acceptance probability, where the verifier
    # knew it (None: it did not); sampled rows learn these instead of the verdicts
    expected: Sequence[Sequence[float]] | None = None
    # the step read prompt tokens: its time is a prefill's, which no cost model
    # nor the step arbiter learns from
    read_prompts: bool = False
    # [num_reqs] each row's last emitted token (its recovered or bonus token; -1: not
    # known), with which the offers the plan did not send are judged
    next_tokens: Sequence[int] | None = None


@dataclass
class Sent:
    """A candidate as the plan sent (or weighed) it, to learn from its verdict."""

    proposer: int  # index of the proposer whose candidate it is
    sampled: bool
    history: int  # the request's history bucket when it was sent
    signal: np.ndarray  # [k] signals of its k tokens
    # a proposer's alternative (not its own best guess): verified only as an extra
    # candidate, and never learned from
    alternative: bool = False
    # [k] the estimator cells of its tokens, where the plan had them (None: from the
    # signals when learned)
    cells: list[int] | None = None


@dataclass
class Shadow:
    """A candidate the peek found on a plain step and did not send: judged against the
    tokens the target emits next (:meth:`Learner.judge_shadows`)."""

    sent: Sent
    tokens: np.ndarray  # [k] the candidate's tokens
    start: int  # the request's context length when it was found


class Learner:
    """The estimator, the requests' histories and the verdicts not yet learned."""

    def __init__(self, estimator: AcceptanceEstimator, names: Sequence[str],
                 stats: ProposerStats, requests: Requests, learn_every: int = LEARN_EVERY):
        self.estimator = estimator
        self.names = list(names)  # proposer index -> name
        self.stats = stats
        self.requests = requests
        self.learn_every = learn_every
        self._start()

    def reset(self) -> None:
        """Back to what a fresh engine knows (the estimator's counts included)."""
        self.estimator.set_counts(0.0, 0.0)
        for state in self.requests:
            state.recent_acceptance = state.shadow = None
        self._start()

    def _start(self) -> None:
        # verdicts not yet in the estimator: (sent, what each judged token teaches)
        self._unlearned: list[tuple[Sent, list]] = []
        self.undecayed_steps = 0  # steps of decay the estimator has not yet applied
        self.learned_tokens = 0  # judged tokens flushed so far (to COLD_TOKENS)

    @property
    def cold(self) -> bool:
        return self.learned_tokens < COLD_TOKENS

    def learn(self, verified: Verified, pending: dict, pending_extras: dict,
              unchosen: dict) -> None:
        """The verdicts of ``verified`` (whose drafts ``pending`` and ``pending_extras``
        recorded, and the offers not sent ``unchosen``), then the estimator's update when
        one is due."""
        self.learn_rows(verified, pending, pending_extras)
        self.learn_unchosen(verified, unchosen)
        if self.undecayed_steps >= self.learn_every or self.cold:
            self.flush()

    def learn_rows(self, verified: Verified, pending: dict, pending_extras: dict) -> None:
        """What each row of ``verified`` accepted of the drafts ``pending`` (and the
        scorer's ``pending_extras``) recorded: the request's history, the counters, and
        the judged tokens for the next flush."""
        scheduled_drafts = as_list(verified.num_scheduled_drafts)  # [num_reqs]
        num_emitted = as_list(verified.num_emitted)  # [num_reqs]
        scored = verified.scored or {}
        judged_parts: list[tuple[Sent, list]] = []
        for row, (req_id, scheduled, emitted) in enumerate(
                zip(verified.req_ids, scheduled_drafts, num_emitted)):
            if scheduled <= 0:
                continue
            emitted = max(emitted - 1, 0)  # accepted tokens emitted
            outcome = scored.get(req_id)
            sent = pending.get(req_id)
            if sent is not None:
                k = min(len(sent.signal), scheduled)
                won = outcome is not None and outcome.winner is not None
                own = min(emitted, k) if outcome is None else outcome.own_accepted
                self._average_in(req_id, min(k, emitted + 1), emitted)
                self.stats.verified(self.names[sent.proposer], k, 0 if won else min(emitted, k))
                if own is not None:
                    # (with the scorer's extras, the verdicts: its rows are not the batch's)
                    judged_parts.append((sent, judged_outcomes(
                        verified.expected if outcome is None else None, row, sent.sampled,
                        min(k, own + 1), min(own, k))))
            if outcome is not None:
                self._learn_extras(pending_extras.get(req_id, []), outcome, emitted,
                                   judged_parts)
        self.teach(judged_parts)

    def _learn_extras(self, extras: list[Sent], outcome: Scored, emitted: int,
                      judged_parts: list) -> None:
        """The scorer's extra candidates: each one's accepted tokens (where the rule tells)
        to the estimator, the winner's emitted tokens to its proposer's counters. A
        proposer's alternatives (its second guesses) are not learned from: they would teach
        that the proposer is worse than it is."""
        for j, extra in enumerate(extras[: len(outcome.extra_accepted)]):
            accepted = outcome.extra_accepted[j]
            if accepted is not None and not extra.alternative:
                length = min(len(extra.signal), outcome.extra_lengths[j])
                judged_parts.append((extra, judged_outcomes(
                    None, j, False, min(length, accepted + 1), min(accepted, length))))
        if outcome.winner is not None and outcome.winner < len(extras):
            self.stats.won(self.names[extras[outcome.winner].proposer], emitted)

    def learn_unchosen(self, verified: Verified, unchosen: dict) -> None:
        """The offers a step did not send (:func:`unsent_offers`), judged against the tokens
        it emitted (the sent draft's accepted tokens, then the row's last token). Without
        this, a proposer the plan did not pick early never learns, and the first one
        believed keeps winning. Not for rows with the scorer's extras (their emitted tokens
        may be an extra's)."""
        next_tokens = verified.next_tokens
        if not unchosen or next_tokens is None:
            return
        scheduled_drafts = as_list(verified.num_scheduled_drafts)  # [num_reqs]
        num_emitted = as_list(verified.num_emitted)  # [num_reqs]
        scored = verified.scored or {}
        judged_parts: list[tuple[Sent, list]] = []
        for row, req_id in enumerate(verified.req_ids):
            entry = unchosen.get(req_id)
            if entry is None or req_id in scored or next_tokens[row] < 0:
                continue
            own, others = entry
            accepted = max(0, min(num_emitted[row] - 1, scheduled_drafts[row], len(own)))
            emitted = np.array(own[:accepted] + [next_tokens[row]])  # [accepted + 1]
            for sent, tokens in others:  # (tokens: as many as its cells)
                judged, matched = judge_guess(tokens, emitted)
                if judged > 0:
                    judged_parts.append((sent, judged_outcomes(None, row, False, judged,
                                                               matched)))
        self.stats.offers_judged_unsent += len(judged_parts)
        self.teach(judged_parts)

    def judge_shadows(self, batch: StepBatch) -> None:
        """Judge the peek's unsent candidates against the tokens the target emitted since
        (:func:`judge_guess`): plain steps so teach the estimator what copying would bring.
        Judged once the emitted tokens differ from the candidate or cover it; learned at
        once (the peek's estimate that follows rests on them)."""
        parts = []
        requests = self.requests
        for r, req_id in enumerate(batch.req_ids):
            state = requests.get(req_id)
            shadow = None if state is None else state.shadow
            if shadow is None:
                continue
            emitted = batch.token_ids[r, shadow.start:int(batch.num_tokens[r])]
            judged, accepted = judge_guess(shadow.tokens, emitted)
            if judged == accepted < len(shadow.tokens):
                continue  # so far so good (or nothing emitted yet): wait for the rest
            parts.append((shadow.sent, judged_outcomes(None, r, False, judged, accepted)))
            self._average_in(req_id, judged, accepted)
            state.shadow = None
        if parts:
            self.teach(parts)
            self.flush()

    def _average_in(self, req_id: str, judged: int, accepted: int) -> None:
        """Into the request's recent acceptance (a request that has ended keeps nothing)."""
        state = self.requests.get(req_id)
        if state is not None:
            state.average_in(judged, accepted)

    def teach(self, judged_parts: list[tuple[Sent, list]]) -> None:
        """(sent, what each judged token teaches: :func:`judged_outcomes`) per candidate:
        for the estimator's next update (:meth:`flush`)."""
        self._unlearned += judged_parts

    def flush(self) -> None:
        """Everything judged since the last flush into the estimator, in one update, after
        the decay of the steps since. Also before the learned state is written
        (:mod:`specplugin.adaptive.memory`)."""
        if self.undecayed_steps:
            self.estimator.step(self.undecayed_steps)
            self.undecayed_steps = 0
        judged_parts, self._unlearned = self._unlearned, []
        if judged_parts:
            estimator, cells, accepted = self.estimator, [], []
            for sent, outcomes in judged_parts:
                cells += (sent.cells[:len(outcomes)] if sent.cells is not None else
                          estimator.cells(sent.proposer, sent.sampled, sent.history,
                                          sent.signal[:len(outcomes)]))
                accepted += outcomes
            estimator.update_cells(cells, accepted)
            self.learned_tokens += len(cells)

    def unsent_offers(self, batch: StepBatch, offers, histories: list[int], offer: list[int],
                      cells_buffer: np.ndarray, starts: list[int],
                      drafts: list[list[int]]) -> dict:
        """Each row's offers that the plan (``offer`` [num_reqs] the chosen one) did not send,
        as req_id -> (the row's draft, [(offer as :class:`Sent`, its tokens)]) for
        :meth:`learn_unchosen`. Not the draft model's offers for a sampled request: a match
        against the emitted token does not measure them."""
        if len(offers) <= sum(1 for o in offer if o >= 0):
            return {}  # every offer was sent (or none was made)
        unchosen: dict = {}
        cells = None
        for o, (r, index, candidate) in enumerate(offers):
            if o == offer[r]:
                continue
            sampled = bool(batch.sampled[r])
            if sampled and self.names[index] in MODEL_PROPOSERS:
                continue
            if cells is None:
                cells = cells_buffer.tolist()  # (the buffer is the next plan's)
            start, end = starts[o], starts[o + 1]
            sent = Sent(index, sampled, histories[r], _NO_SIGNAL, cells=cells[start:end])
            req_id = batch.req_ids[r]
            if req_id not in unchosen:
                unchosen[req_id] = (drafts[r], [])
            unchosen[req_id][1].append((sent, np.array(candidate.token_ids[:end - start])))
        return unchosen

"""The decider: which candidate and how many of its tokens each request verifies, each step.

vLLM-free modules above the proposers:

- ``union``: one step (learn, ask, estimate, plan, remember) over every proposer;
- ``estimator``: a candidate's signals -> per-token acceptance probability, learned online;
- ``cost``: seconds of an engine step as a function of the tokens it runs;
- ``controller``: the batch-wide choice maximising expected emitted tokens per second;
- ``arbiter``: whether speculating pays at all, measured;
- ``draft_rule``: how far the draft model drafts, per request;
- ``memory``: what was learned, kept across engine restarts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specplugin.adaptive.union import Union
    from specplugin.config import SpecPluginConfig


def build(config: SpecPluginConfig, max_num_batched_tokens: int) -> Union:
    """The union of the configured proposers, the one place one is built: every
    token-level proposer, then the draft model's place if configured (draft alone is a
    union of one), with the cost model, the step arbiter and deferred learning (in the
    worker's wait for its next step)."""
    from specplugin.adaptive.arbiter import arbiter_for
    from specplugin.adaptive.background import Background
    from specplugin.adaptive.cost import StepCostModel
    from specplugin.adaptive.union import Union
    from specplugin.proposers import MODEL_PROPOSERS, build_proposer
    from specplugin.proposers.draft import DraftCandidates
    from specplugin.requests import Requests

    requests = Requests()  # every request's record, shared by the proposers and the union
    proposers = [build_proposer(n, config, requests) for n in config.proposers
                 if n not in MODEL_PROPOSERS]
    if any(n in MODEL_PROPOSERS for n in config.proposers):
        proposers.append(DraftCandidates())
    faults = config.fault_injection
    return Union(proposers, cost=StepCostModel(max_tokens=max(2, max_num_batched_tokens)),
                 arbiter=arbiter_for(config), max_candidates=config.max_candidates,
                 decoy_primary=faults.decoy_primary, draft_always=faults.draft_always,
                 background=Background(deferred=True), requests=requests)

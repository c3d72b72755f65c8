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

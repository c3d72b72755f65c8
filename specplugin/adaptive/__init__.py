"""The decider: which candidate and how many of its tokens each request verifies, each step.

Above the proposers (which only offer candidates and signals), none importing vLLM,
each with its formula in its docstring:

- :mod:`~specplugin.adaptive.union`: one step read top to bottom (learn, ask, estimate,
  plan, remember) over every configured proposer;
- :mod:`~specplugin.adaptive.estimator`: a candidate's signals -> the probability
  that each of its tokens is accepted, calibrated online from verification results;
- :mod:`~specplugin.adaptive.cost`: seconds of an engine step as a function of the
  tokens it runs, timed at engine start and refined while serving;
- :mod:`~specplugin.adaptive.controller`: the batch-wide choice that maximises
  expected emitted tokens per second (K = 0 where nothing pays);
- :mod:`~specplugin.adaptive.arbiter`: whether speculating pays at all, measured;
- :mod:`~specplugin.adaptive.draft_rule`: how far the draft model drafts, per request;
- :mod:`~specplugin.adaptive.memory`: what was learned, kept across engine restarts.
"""

"""Adaptive K: which candidate and how many of its tokens each request verifies, each step.

Three small parts, each with its formula in its docstring, none importing vLLM:

- :mod:`~specplugin.adaptive.estimator`: a candidate's signals -> the probability
  that each of its tokens is accepted, calibrated online from verification results;
- :mod:`~specplugin.adaptive.cost`: seconds of an engine step as a function of the
  tokens it runs, timed at engine start and refined while serving;
- :mod:`~specplugin.adaptive.controller`: the batch-wide choice that maximises
  expected emitted tokens per second (K = 0 where nothing pays).
"""

"""The thin layer that touches vLLM. Nothing outside this package imports vllm.

- ``config_hook``: checks the plugin's settings while vLLM builds its config and, for the
  draft proposer, selects the plugin's worker;
- ``speculator``: ``specplugin.Speculator``, built by vLLM's ``custom_class`` hook
  (token-level proposers such as n-gram);
- ``worker`` and ``draft_proposer``: the plugin's worker layer, for proposers that run a
  model on vLLM's paged KV cache;
- ``patches`` (the one registry of patches) and ``cpu_fixes``.
"""

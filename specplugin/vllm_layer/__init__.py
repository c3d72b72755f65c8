"""The thin layer that touches vLLM. Nothing outside this package imports vllm.

- ``config_hook``: validates settings; selects the plugin's worker for the draft proposer;
- ``speculator``: ``specplugin.Speculator`` for token-level proposers (vLLM's ``custom_class``);
- ``worker`` and ``draft_proposer``: worker layer for proposers that run a model on vLLM's KV cache;
- ``patches`` (the one registry of patches) and ``cpu_fixes``.
"""

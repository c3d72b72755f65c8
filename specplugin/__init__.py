"""specplugin: speculative decoding for vLLM, switched on with vLLM's own flags.

Layers: ``config``, ``proposers``, ``scorers`` and ``zoo`` never import vLLM;
``vllm_layer`` is the thin adapter; ``plugin.register`` is the entry point.

Terms (used the same way everywhere):
- draft tokens: proposed by a proposer; accepted tokens: drafts the target kept;
  recovered token: drawn from the residual at the first rejection; bonus token:
  drawn from the target after all drafts were accepted; acceptance length:
  accepted + 1 tokens emitted per verification step.

Dimension names in shape comments: num_reqs (rows in the batch), max_num_reqs,
max_model_len, num_tokens (context length), k (draft length), vocab_size.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``specplugin.Speculator`` (speculative_config["model"]), lazily: import stays vLLM-free
    if name == "Speculator":
        from specplugin.vllm_layer.speculator import Speculator

        return Speculator
    raise AttributeError(f"module 'specplugin' has no attribute {name!r}")

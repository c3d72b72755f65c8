"""Offline batch inference with stock vllm.LLM and specplugin's recommended union
(draft model + n-gram + suffix, K chosen per request and step).

    .venv/bin/python examples/offline_draft.py [TARGET_DIR DRAFT_DIR]

Defaults to the zoo pair (`specplugin zoo path target|draft`). The draft must share the
target's tokenizer. The plugin is switched on by vLLM's own arguments only; with the
`draft` proposer the draft's KV cache lives in vLLM's paged block pool beside the target's.
"""

import os
import sys

if __name__ == "__main__":  # vLLM starts its engine with spawn
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from specplugin.zoo import zoo_path

    target, draft = sys.argv[1:3] if len(sys.argv) > 2 else (zoo_path("target"), zoo_path("draft"))
    llm = LLM(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        disable_log_stats=False,
        speculative_config={
            "method": "custom_class",
            "model": "specplugin.Speculator",
            "num_speculative_tokens": 8,
        },
        additional_config={"specplugin": {"proposers": ["draft", "ngram", "suffix"],
                                          "draft_model": str(draft)}},
    )
    prompts = ["import os\n\n\ndef walk(root):\n", "class Stack:\n    def __init__(self):\n"]
    for temperature in (0.0, 1.0):
        outputs = llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=48))
        for out in outputs:
            print(f"T={temperature}: {out.outputs[0].text!r}")
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    if drafts:
        print(f"mean acceptance length: {1 + accepted / drafts:.2f} ({drafts} drafts)")

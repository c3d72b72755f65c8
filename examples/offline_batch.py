"""Offline batch inference with stock vllm.LLM and the specplugin n-gram proposer.

    .venv/bin/python examples/offline_batch.py [MODEL_DIR]

MODEL_DIR defaults to the zoo's trained target (`specplugin zoo path target`).
The plugin is switched on by vLLM's own arguments only: speculative_config selects
vLLM's `custom_class` hook with `specplugin.Speculator`, additional_config carries
the plugin's settings.
"""

import os
import sys

if __name__ == "__main__":  # vLLM starts its engine with spawn
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from specplugin.zoo import zoo_path

    model = sys.argv[1] if len(sys.argv) > 1 else str(zoo_path("target"))
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        disable_log_stats=False,
        speculative_config={
            "method": "custom_class",
            "model": "specplugin.Speculator",
            "num_speculative_tokens": 8,
        },
        additional_config={"specplugin": {"proposers": ["ngram", "suffix"]}},
    )
    code = "def area(width, height):\n    return width * height\n\n\n"
    prompts = [code + "# again:\n" + code[:20], "import os\n\n\ndef walk(root):\n"]
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48)):
        print(repr(out.outputs[0].text))
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    if drafts:
        print(f"mean acceptance length: {1 + accepted / drafts:.2f} ({drafts} drafts)")

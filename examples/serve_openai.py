"""Query a `vllm serve` that runs specplugin, through the OpenAI client.

Start the server (any model folder works; this uses the zoo's target):

    .venv/bin/vllm serve "$(.venv/bin/specplugin zoo path target)" --dtype float32 \
        --enforce-eager --gpu-memory-utilization 0.1 --port 8000 \
        --speculative-config '{"method": "custom_class", "model": "specplugin.Speculator", "num_speculative_tokens": 8}' \
        --additional-config '{"specplugin": {"proposers": ["ngram", "suffix"]}}'

then run:

    .venv/bin/python examples/serve_openai.py [http://127.0.0.1:8000/v1]

Acceptance counters are in the server's Prometheus output: `curl -s
127.0.0.1:8000/metrics | grep spec_decode`.
"""

import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key="unused")
model = client.models.list().data[0].id
code = "def area(width, height):\n    return width * height\n\n\n"
reply = client.completions.create(
    model=model, prompt=code + "# again:\n" + code[:20], max_tokens=48, temperature=0.0
)
print(repr(reply.choices[0].text))

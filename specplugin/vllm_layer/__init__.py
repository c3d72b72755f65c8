"""The thin layer that touches vLLM. Nothing outside this package imports vllm."""

import os

# vLLM on CPU sizes its KV cache from this (GiB); the default claims far more than tests need.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest


@pytest.fixture(scope="session")
def zoo_root():
    """The zoo folder the tests load (``SPECPLUGIN_TEST_ZOO`` overrides the committed weights)."""
    from pathlib import Path

    from specplugin.zoo import WEIGHTS_DIR

    return Path(os.environ.get("SPECPLUGIN_TEST_ZOO", WEIGHTS_DIR))

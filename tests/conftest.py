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


@pytest.fixture(scope="session")
def quick_zoo(tmp_path_factory):
    """A tiny zoo pair built in seconds (``specplugin zoo build --quick``), shared by the session."""
    from specplugin import zoo

    root = tmp_path_factory.mktemp("quick-zoo")
    zoo.build(root, quick=True)
    return root

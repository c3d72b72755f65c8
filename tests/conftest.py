import os

from specplugin.bench.runner import child_env

# Tests that build vllm.LLM in this process (or a subprocess of their own) get the engine
# children's environment too: the runner's KV cache size (the default claims far more than
# tests need), device and tokenizer settings, in one place.
os.environ.update(child_env())

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

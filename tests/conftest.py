import os

from specplugin.bench.runner import child_env

# Tests that build vllm.LLM in this process (or a subprocess of their own) get the engine
# children's environment too: the runner's KV cache size (the default claims far more than
# tests need), device and tokenizer settings, in one place.
os.environ.update(child_env())
# The suite's engines run vLLM's engine core in the process that builds the LLM
# (VLLM_ENABLE_V1_MULTIPROCESSING=0, a mode vLLM documents): such an engine starts in
# ~4 s instead of ~30 s on 2 cores, and the plugin's worker and drafters are the same.
# The layout users run by default (engine core and worker in processes of their own,
# drafts handed back across them) is kept where it matters: the shared union engine
# (tests/shared_engine.py), `specplugin profile` (tests/test_profile.py) and
# `vllm serve` (tests/test_serve.py) set tests.shared_engine.MULTIPROCESS.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest


@pytest.fixture(scope="session")
def zoo_root():
    """The zoo folder the tests load (``SPECPLUGIN_TEST_ZOO`` overrides the committed weights)."""
    from pathlib import Path

    from specplugin.zoo import WEIGHTS_DIR

    return Path(os.environ.get("SPECPLUGIN_TEST_ZOO", WEIGHTS_DIR))


@pytest.fixture(scope="session")
def quick_zoo(tmp_path_factory):
    """A tiny zoo pair built in seconds (``specplugin zoo build --quick``), shared by the test run."""
    from specplugin import zoo

    root = tmp_path_factory.mktemp("quick-zoo")
    zoo.build(root, quick=True)
    return root


@pytest.fixture(scope="session")
def shared_workdir(tmp_path_factory):
    """The shared engine's folder (its logs, and its ``state_dir``: tests/shared_engine.py)."""
    return tmp_path_factory.mktemp("shared-union")


@pytest.fixture(scope="session")
def shared_runs(zoo_root, shared_workdir):
    """Every cell the end-to-end modules registered in ``tests/shared_engine.py``, run
    in one engine with the plugin's full union: cell key -> ``EngineRun``."""
    from tests.shared_engine import run_shared

    return run_shared(zoo_root, shared_workdir)

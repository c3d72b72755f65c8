"""What the union learned, kept in a file across engine restarts (``state_dir``).

The file is named by a hash of target, draft model, proposers, K and machine (acceptance
belongs to the model pair, rates to the machine). Kept: the estimator's decayed per-cell
counts and each step-arbiter bucket's measured rates, correction and batch size (block
counts capped at :data:`REMEASURE_BLOCKS` on load, so new measurements soon dominate).
Not kept: the cost model (timed at every start), per-request state. Written atomically
when the union goes idle and at most every :data:`SAVE_INTERVAL_S` while serving, by
tensor-parallel rank 0 only; a file that does not match is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger("specplugin")

VERSION = 1
SAVE_INTERVAL_S = 30.0
REMEASURE_BLOCKS = 2


def machine_id() -> str:
    """The processor's model name and core count (rates hold only on that machine)."""
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} x{os.cpu_count()}"


def state_path(state_dir: str | Path, target: str, draft: str | None,
               proposers: tuple[str, ...], num_speculative_tokens: int,
               machine: str | None = None) -> Path:
    """The file for this target, draft, proposers, K and machine in ``state_dir``."""
    key = json.dumps([str(target), None if draft is None else str(draft), list(proposers),
                      int(num_speculative_tokens), machine or machine_id()])
    return Path(state_dir).expanduser() / f"union-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


class UnionMemory:
    """Reads and writes a union's learned state at ``path`` (``writer``: rank 0 only)."""

    def __init__(self, path: Path, writer: bool = True):
        self.path, self.writer = Path(path), writer
        self._last_save = time.monotonic()

    def restore(self, union) -> bool:
        """Load the file into ``union`` (True if it was there and matched)."""
        try:
            payload = json.loads(self.path.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as err:
            logger.warning("specplugin: state file %s not read (%s); starting cold",
                           self.path, err)
            return False
        try:
            self._apply(union, payload)
        except (KeyError, TypeError, ValueError) as err:
            logger.warning("specplugin: state file %s does not match this engine (%s); "
                           "starting cold", self.path, err)
            return False
        logger.info("specplugin: union state restored from %s", self.path)
        return True

    def _apply(self, union, payload: dict) -> None:
        if payload.get("version") != VERSION:
            raise ValueError(f"version {payload.get('version')!r}, wanted {VERSION}")
        estimator = union.estimator
        if list(payload["proposers"]) != list(estimator.proposers):
            raise ValueError(f"proposers {payload['proposers']}, wanted {list(estimator.proposers)}")
        judged = np.asarray(payload["judged"], dtype=float)
        accepted = np.asarray(payload["accepted"], dtype=float)
        if judged.shape != estimator.judged.shape or accepted.shape != judged.shape:
            raise ValueError(f"estimator shape {judged.shape}, wanted {estimator.judged.shape}")
        if (judged < 0).any() or (accepted < 0).any() or (accepted > judged + 1e-9).any():
            raise ValueError("estimator counts out of range")
        arbiter = union.arbiter
        buckets = []
        for entry in payload.get("arbiter", []) if arbiter is not None else []:
            rate = {bool(int(c)): float(r) for c, r in entry["rate"].items()}
            blocks = {bool(int(c)): min(int(n), REMEASURE_BLOCKS)
                      for c, n in entry["blocks"].items()}
            correction = entry.get("correction")
            buckets.append(((int(entry["bucket"]), bool(entry["sampled"])), rate, blocks,
                            None if correction is None else float(correction),
                            int(entry.get("num_reqs", 0))))  # (absent in older files)
        estimator.set_counts(judged, accepted)
        for key, rate, blocks, correction, num_reqs in buckets:
            arbiter.restore_bucket(key, rate, blocks, correction, num_reqs)

    def snapshot(self, union) -> dict:
        union.settle()
        union.flush_learning()  # verdicts the estimator has not learned yet count too
        estimator = union.estimator
        buckets = [] if union.arbiter is None else [
            {"bucket": key[0], "sampled": key[1],
             "rate": {str(int(c)): r for c, r in state.rate.items()},
             "blocks": {str(int(c)): n for c, n in state.blocks.items()},
             "correction": state.correction, "num_reqs": state.num_reqs}
            for key, state in union.arbiter.buckets().items() if state.rate]
        return {"version": VERSION, "proposers": list(estimator.proposers),
                "judged": estimator.judged.tolist(), "accepted": estimator.accepted.tolist(),
                "arbiter": buckets}

    def save(self, union) -> None:
        """Write the file now (atomically). An error is logged, never raised."""
        if not self.writer:
            return
        self._last_save = time.monotonic()
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(self.snapshot(union)))
            os.replace(temporary, self.path)
        except OSError as err:
            logger.warning("specplugin: state file %s not written (%s)", self.path, err)

    def maybe_save(self, union, idle: bool) -> None:
        """After requests finished: write if the union is ``idle`` (no request left) or
        the last write is :data:`SAVE_INTERVAL_S` old."""
        if idle or time.monotonic() - self._last_save >= SAVE_INTERVAL_S:
            self.save(union)


def open_memory(union, state_dir: str | None, target: str, draft: str | None,
                num_speculative_tokens: int, writer: bool = True) -> UnionMemory | None:
    """The memory for ``union`` (None without ``state_dir``), its file read into it."""
    if state_dir is None:
        return None
    names = tuple(p.name for p in union.proposers)
    memory = UnionMemory(state_path(state_dir, target, draft, names, num_speculative_tokens),
                         writer=writer)
    memory.restore(union)
    return memory

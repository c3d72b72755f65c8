"""Where a worker's step goes, by sampling: py-spy's stacks charged to rows (vLLM-free).

``specplugin profile --timers sampled`` installs no timer: py-spy samples the rank-0
worker in its collapsed format (``frame;...;frame COUNT``, root first, each frame
``function (file:line)``), so no instrument sits inside the rows it measures. (Samplers
that do not stop the worker under-count fast Python rows: see
:class:`specplugin.bench.profile.SampledWindow`.)

A sample is in the step when a ``vllm/v1/worker/`` frame named ``execute_model`` or
``sample_tokens`` is on its stack (others are counted apart). In the step, the first
rule that holds charges it:

- ``draft forward``: a frame in :attr:`StackRoles.draft_forwards`, or a model frame
  under ``vllm/v1/spec_decode/``;
- ``forward``: the target's compute (``_model_forward`` or a model frame);
- ``plugin``: a plugin frame that is not passing through (an override calling its
  namesake via ``super()``, or a patch wrapper calling vLLM's original); vLLM code the
  plugin calls is the plugin's;
- ``vllm``: the rest.

The plugin's share is of the worker's step, shorter than the engine step the timed
ledger divides by, so it reads larger for the same work.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DRAFT_FORWARD, FORWARD, PLUGIN, VLLM = "draft forward", "forward", "plugin", "vllm"
ROWS = (FORWARD, DRAFT_FORWARD, PLUGIN, VLLM)
BACKGROUND = "plugin (outside the step)"  # the plugin's code in the worker's wait
IDLE = "outside the step"  # everything else in the worker's wait

PLUGIN_FILES = "specplugin/"
PATCH_WRAPPERS = "specplugin/vllm_layer/patches.py"
WORKER_FILES = "vllm/v1/worker/"
MODEL_FILES = "vllm/model_executor/models/"
SPEC_DECODE_FILES = "vllm/v1/spec_decode/"
STEP_FUNCTIONS = frozenset({"execute_model", "sample_tokens"})
# decorators' frames between a caller and the function it calls
DECORATORS = ("torch/utils/_contextlib.py",)


@dataclass(frozen=True)
class Frame:
    """One frame of a sampled stack: ``qualname`` as py-spy prints it
    (``Class.method``, ``function``, ``outer.<locals>.inner``) and its file."""

    qualname: str
    file: str

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def is_plugin(self) -> bool:
        return PLUGIN_FILES in self.file


def parse_frame(text: str) -> Frame:
    """``"Class.method (path/file.py:12)"`` -> ``Frame("Class.method", "path/file.py")``."""
    qualname, _, where = text.partition(" (")
    return Frame(qualname, where.rsplit(":", 1)[0])


def parse_raw(lines: Iterable[str]) -> list[tuple[list[Frame], int]]:
    """py-spy's raw output: ``(frames root first, samples)`` per line."""
    stacks = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        stacks.append(([parse_frame(f) for f in stack.split(";")], int(count)))
    return stacks


@dataclass(frozen=True)
class StackRoles:
    """Qualified names of the plugin's frames that are model compute (draft forward, LM
    head), built from the functions themselves so a rename cannot silently empty a row."""

    draft_forwards: frozenset[str]


def passes_through(frames: Sequence[Frame], i: int) -> bool:
    """Whether plugin frame ``i`` only hands its call on to vLLM (see the module).
    Decorator frames in between are skipped; a sample inside one counts as its callee's."""
    if i + 1 >= len(frames):
        return False  # its own line is running
    callee = next((f for f in frames[i + 1:] if not any(d in f.file for d in DECORATORS)),
                  None)
    if callee is None:
        return True  # inside the decorator of what it calls
    if callee.is_plugin:
        return False
    return callee.name == frames[i].name or PATCH_WRAPPERS in frames[i].file


def charge(frames: Sequence[Frame], roles: StackRoles) -> tuple[str, str | None]:
    """The row of one sample, and for the plugin's rows the innermost plugin function
    that is not passing through (where its time goes)."""
    in_step = any(f.name in STEP_FUNCTIONS and WORKER_FILES in f.file for f in frames)
    owner = next((f.qualname for i, f in reversed(list(enumerate(frames)))
                  if f.is_plugin and not passes_through(frames, i)), None)
    if not in_step:
        return (BACKGROUND, owner) if owner else (IDLE, None)
    model = any(MODEL_FILES in f.file for f in frames)
    if any(f.qualname in roles.draft_forwards for f in frames) or (
            model and any(SPEC_DECODE_FILES in f.file for f in frames)):
        return DRAFT_FORWARD, None
    if model or any(f.name == "_model_forward" and WORKER_FILES in f.file for f in frames):
        return FORWARD, None
    return (PLUGIN, owner) if owner else (VLLM, None)


@dataclass
class SampledLedger:
    """Samples per row, and the plugin's by function (innermost non-passing frame)."""

    rows: Counter = field(default_factory=Counter)
    plugin_functions: Counter = field(default_factory=Counter)

    @classmethod
    def from_raw(cls, lines: Iterable[str], roles: StackRoles) -> SampledLedger:
        ledger = cls()
        for frames, count in parse_raw(lines):
            row, function = charge(frames, roles)
            ledger.rows[row] += count
            if row == PLUGIN:
                ledger.plugin_functions[function] += count
        return ledger

    @property
    def step_samples(self) -> int:
        return sum(self.rows[row] for row in ROWS)

    def summary(self, top: int = 12) -> dict:
        """Each row's share of the step's samples; the plugin's share with its 95% half
        width (binomial sampling noise only); its top functions."""
        n = self.step_samples
        shares = {row: self.rows[row] / n if n else 0.0 for row in ROWS}
        own = shares[PLUGIN]
        return {
            "step_samples": n,
            "samples": sum(self.rows.values()),
            "shares": shares,
            "own_share": own,
            "own_half_interval": 1.96 * math.sqrt(own * (1 - own) / n) if n else math.inf,
            "background_share": (self.rows[BACKGROUND] / n) if n else 0.0,
            "plugin_functions": [(name, count / n) for name, count
                                 in self.plugin_functions.most_common(top)] if n else [],
        }

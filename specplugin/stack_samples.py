"""Where a worker's step goes, by sampling: py-spy's stacks charged to rows (vLLM-free).

``specplugin profile --timers sampled`` installs no timer at all: py-spy samples the
engine's worker (rank 0) while the timed cell runs, in its collapsed ("raw") format,
one line per distinct stack: ``frame;frame;...;frame COUNT`` with the root first and
each frame ``function (file:line)``. This module charges every sample to one row.

Timers cost time inside the very rows they measure (their wrappers, and the counters on
host syncs, run in the plugin's entry points); a sampler that stops the worker for each
read costs it pauses, in which no sample is taken, so no row is charged for them. The
sampled share of the plugin's own work is the figure with no instrument inside its rows,
against the timed ledger's finer split. (Reads that do not stop the worker fail where the
stack changes under them, most in fast-moving Python code, and such rows come out low:
see :class:`specplugin.bench.profile.SampledWindow`.)

A sample is in the step when a frame of vLLM's worker (``vllm/v1/worker/``) named
``execute_model`` or ``sample_tokens`` is on its stack; samples outside (the worker's
wait for its next step, the union's held learning in that wait) are counted apart.
In the step, the first rule that holds charges the sample:

- ``draft forward``: the draft model's compute, the plugin's (a frame in
  :attr:`StackRoles.draft_forwards`) or a built-in's (a model frame under vLLM's
  ``vllm/v1/spec_decode/``);
- ``forward``: the target's compute (vLLM's runner's ``_model_forward``, or a model
  frame, ``vllm/model_executor/models/``: the forward and its ``compute_logits``);
- ``plugin``: a frame of the plugin (``specplugin/``) that is not passing through: a
  plugin frame passes through when the frame it calls is not the plugin's and has its
  name (an override calling ``super()``), or when it is one of the patch registry's
  wrappers calling vLLM's original. What vLLM's code does when the plugin calls it is the
  plugin's (as the timed ledger charges it);
- ``vllm``: the rest of the step (vLLM's runner, sampler, bookkeeping).

The plugin's own work is ``plugin`` over the step's samples: a share of the worker's
step (``execute_model`` and ``sample_tokens``), which is shorter than the engine's step
the timed ledger divides by, so this share is the larger of the two for the same work.
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
    """The plugin's frames that are model compute: its draft model's forward and LM
    head (qualified names, ``PluginDraftProposer._run_model``; the vLLM layer builds
    these from the functions themselves, so a rename cannot silently empty a row)."""

    draft_forwards: frozenset[str]


def passes_through(frames: Sequence[Frame], i: int) -> bool:
    """Whether plugin frame ``i`` only hands its call on to vLLM (see the module). The
    frames of a decorator between them (``torch.inference_mode``'s, around vLLM's
    ``execute_model`` and ``sample_tokens``) do not count, and a sample inside such a
    decorator's own code, on the way in or out of the function it wraps, is that
    function's: vLLM's, where the plugin's overrides call their namesakes through it."""
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
        """Each row's share of the step's samples; the plugin's own share with the half
        width of its 95% interval (binomial, normal approximation: the samples' own
        noise, not the engine's from run to run); its top functions."""
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

"""Every change the plugin makes to vLLM's classes lives here, in one registry.

Lasting patches (each has a test that fails loudly if vLLM moves the hooked call):

- around the platform's ``check_and_update_config`` (front end): validate
  ``additional_config`` before any engine process starts (``tests/test_plugin.py``);
- after ``InputProcessor._validate_params``: check ``specplugin_*`` request options
  (:mod:`.request_check`; ``tests/test_request_options.py``);
- on CPU, vLLM's wrong ``expand_kernel`` fallback (:mod:`.cpu_fixes`; ``tests/test_cpu_fixes.py``);
- around ``EngineCore._initialize_kv_caches``, only with ``max_candidates`` > 1: the
  scheduler gets the pool minus the scorer's scratch blocks (:mod:`.scorer`;
  ``tests/test_scorer_e2e.py``);
- around the rejection sampler's ``sample_recovered_tokens``: acceptance probabilities
  for the learners (:mod:`.verification`; ``tests/test_request_control_e2e.py``);
- around ``MultiprocExecutor.sample_tokens`` / ``take_draft_token_ids``: drafts ride on
  the step's output (:mod:`.draft_handoff`; ``tests/test_draft_handoff.py``);
- after ``WorkerProc._execute_worker_rpc``: held-back learning and ``/metrics``
  publishing in the worker's wait (:mod:`.worker_wait`; ``tests/test_union_e2e.py``);
- ``specplugin profile`` engines only: timers listed in :mod:`.profiling`;
- scoped (:func:`swapped`): while the plugin's CPU worker initialises, ``CPUModelRunner``
  names the plugin's runner (the CPU worker has no factory hook; replacing the runner
  afterwards left ~10% per-step overhead). ``tests/test_plugin.py``.

The registry refuses to patch an attribute twice, so a repeated ``register()`` (vLLM
loads plugins in every process, sometimes more than once) never stacks wrappers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_MARKER = "__specplugin_patch__"


class DoublePatchError(RuntimeError):
    pass


@dataclass(frozen=True)
class AppliedPatch:
    owner: Any  # a class or a module
    name: str
    original: Any  # the attribute as it was in owner.__dict__ (or inherited)


_APPLIED: dict[tuple[type, str], AppliedPatch] = {}


def is_patched(owner: type, name: str) -> bool:
    return getattr(getattr(owner, name, None), _MARKER, False)


def patch_classmethod(owner: type, name: str, before: Callable[[Any], None]) -> AppliedPatch:
    """Replace classmethod ``owner.name(cls, arg)`` by one that calls ``before(arg)`` first."""
    if is_patched(owner, name) or (owner, name) in _APPLIED:
        raise DoublePatchError(f"{owner.__qualname__}.{name} is already patched by specplugin")
    bound = getattr(owner, name)  # a bound classmethod: its __func__ takes (cls, arg)
    func = bound.__func__

    @functools.wraps(func)
    def wrapper(cls, arg):
        before(arg)
        return func(cls, arg)

    setattr(wrapper, _MARKER, True)
    applied = AppliedPatch(owner, name, owner.__dict__.get(name, bound))
    setattr(owner, name, classmethod(wrapper))
    _APPLIED[(owner, name)] = applied
    return applied


def patch_method(owner: type, name: str, after: Callable[..., None]) -> AppliedPatch:
    """Replace method ``owner.name`` by one that calls ``after(self, *args, **kwargs)``
    once the original returned (returning its result)."""
    if is_patched(owner, name) or (owner, name) in _APPLIED:
        raise DoublePatchError(f"{owner.__qualname__}.{name} is already patched by specplugin")
    func = getattr(owner, name)

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        result = func(self, *args, **kwargs)
        after(self, *args, **kwargs)
        return result

    setattr(wrapper, _MARKER, True)
    applied = AppliedPatch(owner, name, owner.__dict__.get(name, func))
    setattr(owner, name, wrapper)
    _APPLIED[(owner, name)] = applied
    return applied


def wrapping(func: Callable[..., Any], around: Callable[..., Any]) -> Callable[..., Any]:
    """The method ``patch_around`` installs: ``around(func, self, *args, **kwargs)``."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        return around(func, self, *args, **kwargs)

    return wrapper


def patch_around(owner: type, name: str, around: Callable[..., Any]) -> AppliedPatch:
    """Replace method ``owner.name`` by ``around(original, self, *args, **kwargs)``."""
    if is_patched(owner, name) or (owner, name) in _APPLIED:
        raise DoublePatchError(f"{owner.__qualname__}.{name} is already patched by specplugin")
    func = getattr(owner, name)
    wrapper = wrapping(func, around)
    setattr(wrapper, _MARKER, True)
    applied = AppliedPatch(owner, name, owner.__dict__.get(name, func))
    setattr(owner, name, wrapper)
    _APPLIED[(owner, name)] = applied
    return applied


def replace_attribute(owner: Any, name: str, replacement: Any) -> AppliedPatch:
    """Set ``owner.name = replacement`` (a module or class attribute), recorded and marked."""
    if is_patched(owner, name) or (owner, name) in _APPLIED:
        raise DoublePatchError(f"{getattr(owner, '__name__', owner)}.{name} is already patched "
                               "by specplugin")
    applied = AppliedPatch(owner, name, getattr(owner, name))
    setattr(replacement, _MARKER, True)
    setattr(owner, name, replacement)
    _APPLIED[(owner, name)] = applied
    return applied


@contextlib.contextmanager
def swapped(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name = replacement`` inside the ``with`` block, then restored (no nesting)."""
    if is_patched(owner, name) or (owner, name) in _APPLIED:
        raise DoublePatchError(f"{getattr(owner, '__name__', owner)}.{name} is already patched "
                               "by specplugin")
    applied = AppliedPatch(owner, name, getattr(owner, name))
    _APPLIED[(owner, name)] = applied
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, applied.original)
        del _APPLIED[(owner, name)]


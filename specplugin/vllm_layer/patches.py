"""Every change the plugin makes to vLLM's classes lives here, in one registry.

Seven lasting patches today, the profiler's (its engines only), and a scoped replacement:

- a wrapper around the current platform's ``check_and_update_config``, which
  ``VllmConfig.__post_init__`` calls in the front-end process. vLLM offers no hook
  that sees the finished config before any engine process starts, and that is
  where a bad ``additional_config`` must stop the user (``tests/test_plugin.py``
  fails loudly if vLLM moves the call);
- after vLLM's own per-request checks in ``InputProcessor._validate_params`` (front
  end, before a request is scheduled), the check of the request's ``specplugin_*``
  options (:mod:`specplugin.vllm_layer.request_check`): vLLM has no hook for extra
  per-request validation that does not also put a logits processor on every step
  (``tests/test_request_options.py`` fails loudly if vLLM stops calling it);
- on CPU, vLLM's fallback for the rejection sampler's ``expand_kernel``, which is
  wrong for float inputs (see ``cpu_fixes.py``; ``tests/test_cpu_fixes.py`` fails
  loudly once vLLM fixes it, so the patch can go);
- around ``EngineCore._initialize_kv_caches`` (engine-core process), only when the
  batch-expanding scorer is on (``max_candidates`` > 1): while it runs, vLLM's
  ``generate_scheduler_kv_cache_config`` is swapped for one that gives the scheduler
  its pool minus the scorer's scratch blocks (:mod:`specplugin.vllm_layer.scorer`);
  the workers keep every block, so the last ones are the scorer's alone. vLLM has no
  setting that reserves blocks per worker (``tests/test_scorer_e2e.py`` checks the
  scheduler's pool shrank);
- around the rejection sampler's ``sample_recovered_tokens`` (worker), which receives the
  step's target distribution on the random path: while the plugin's runner samples, each
  draft token's acceptance probability is computed there for the learners
  (:mod:`specplugin.vllm_layer.verification`; ``tests/test_request_control_e2e.py`` fails
  loudly if vLLM stops calling it);
- around ``MultiprocExecutor.sample_tokens`` and ``take_draft_token_ids`` (engine-core
  process): the step's drafts, which the plugin's runner attaches to the step's output,
  are handed to the scheduler without a second round trip to the worker
  (:mod:`specplugin.vllm_layer.draft_handoff`); outputs without them (vLLM's own methods)
  keep vLLM's call. ``tests/test_draft_handoff.py`` fails loudly if vLLM moves the
  post-step fetch;
- after ``WorkerProc._execute_worker_rpc`` (worker): the learning a step held back runs
  once the call's reply is on its way, in the worker's wait for the next call, and the
  counters for ``/metrics`` are published there between steps
  (:mod:`specplugin.vllm_layer.worker_wait`; ``tests/test_union_e2e.py`` fails if either
  stops running there);
- in ``specplugin profile``'s engines only (``SPECPLUGIN_PROFILE=1``): around
  ``EngineCore.collective_rpc``, and from the profiler's ``start`` on, timers around the
  per-step methods listed in :mod:`specplugin.vllm_layer.profiling`;
- while the plugin's CPU worker initialises, the name ``CPUModelRunner`` that vLLM's
  ``CPUWorker.init_device`` builds its runner from points at the plugin's runner
  (:func:`swapped`): the CUDA worker has a factory method for this, the CPU worker
  does not, and building vLLM's runner first and replacing it afterwards leaves the
  discarded runner's state behind and made every step ~10% slower (measured).
  ``tests/test_plugin.py`` fails loudly if ``init_device`` stops reading that name.

The registry refuses to patch the same attribute twice, so a second
``register()`` (vLLM loads plugins in every process, sometimes more than once)
can never stack wrappers.
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
    """Replace method ``owner.name(self, *args, **kwargs)`` by one that calls
    ``after(self, *args, **kwargs)`` once the original returned (and returns its result)."""
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
    """Replace method ``owner.name(self, *args, **kwargs)`` by
    ``around(original, self, *args, **kwargs)``, which decides when to call the original."""
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
    """``owner.name = replacement`` for the duration of the ``with`` block, then restored.
    Refuses to nest on the same attribute."""
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


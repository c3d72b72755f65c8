"""Per-request control of speculation, bounded by the server's settings (vLLM-free).

Set through ``SamplingParams.extra_args`` (offline) or ``vllm_xargs`` (OpenAI API):

- ``specplugin_max_k`` (int, 0 to the server's K): longest draft per step; 0 switches
  speculation off for this request only;
- ``specplugin_proposers`` (``"ngram,suffix"`` or a list): the subset of the server's
  proposers that may draft for it.

A request can only lower the server's settings. Out-of-bounds values, wrong types and
unknown ``specplugin_*`` keys (typos) raise :class:`RequestOptionError` in the front end
(HTTP 400). Other ``extra_args`` keys are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specplugin.requests import Requests

PREFIX = "specplugin_"
MAX_K_KEY = "specplugin_max_k"
PROPOSERS_KEY = "specplugin_proposers"
KEYS = (MAX_K_KEY, PROPOSERS_KEY)


class RequestOptionError(ValueError):
    """A request's ``specplugin_*`` value is refused; the message names the key and the fix."""

    def __init__(self, key: str, value: Any, message: str):
        super().__init__(message)
        self.key = key
        self.value = value


@dataclass(frozen=True)
class RequestOptions:
    """What one request allows: ``max_k`` None is the server's K; ``proposers`` None is
    every proposer the server loaded."""

    max_k: int | None = None
    proposers: frozenset[str] | None = None

    def allows(self, proposer: str) -> bool:
        return self.proposers is None or proposer in self.proposers

    def cap(self, k: int) -> int:
        return k if self.max_k is None else min(k, self.max_k)


DEFAULT = RequestOptions()


def parse_request_options(extra_args: Mapping[str, Any] | None, server_k: int,
                          server_proposers: Sequence[str]) -> RequestOptions:
    """The request's options from its ``extra_args``; raises :class:`RequestOptionError`."""
    if not extra_args:
        return DEFAULT
    ours = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(PREFIX)}
    if not ours:
        return DEFAULT
    for key in ours:
        if key not in KEYS:
            raise RequestOptionError(
                key, ours[key], f"unknown per-request option {key!r}; specplugin reads "
                f"{' and '.join(KEYS)}. Fix the key's spelling or remove it.")
    max_k = _max_k(ours[MAX_K_KEY], server_k) if MAX_K_KEY in ours else None
    proposers = _proposers(ours[PROPOSERS_KEY], server_proposers) if PROPOSERS_KEY in ours else None
    return RequestOptions(max_k, proposers)


def _max_k(value: Any, server_k: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestOptionError(
            MAX_K_KEY, value, f"{MAX_K_KEY} must be an integer from 0 to {server_k} (0 switches "
            f"speculation off for this request); got {value!r} ({type(value).__name__}).")
    if not 0 <= value <= server_k:
        raise RequestOptionError(
            MAX_K_KEY, value, f"{MAX_K_KEY}={value} is outside 0..{server_k}: this server verifies "
            f"at most num_speculative_tokens={server_k} draft tokens per step, and a request "
            "may only lower it (0 switches speculation off for it).")
    return value


def _proposers(value: Any, server_proposers: Sequence[str]) -> frozenset[str]:
    if isinstance(value, str):
        names = [name.strip() for name in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        names = [name.strip() for name in value]
    else:
        raise RequestOptionError(
            PROPOSERS_KEY, value, f"{PROPOSERS_KEY} must be a comma-separated string of proposer "
            f"names such as {','.join(server_proposers)!r}; got {value!r} ({type(value).__name__}).")
    names = [name for name in names if name]
    if not names:
        raise RequestOptionError(
            PROPOSERS_KEY, value, f"{PROPOSERS_KEY} names no proposer; to switch speculation off "
            f"for this request set {MAX_K_KEY}=0 instead.")
    unknown = [name for name in names if name not in server_proposers]
    if unknown:
        raise RequestOptionError(
            PROPOSERS_KEY, value, f"{PROPOSERS_KEY} names {', '.join(map(repr, unknown))}, which "
            f"this server did not load; it runs {', '.join(server_proposers)} (a request can only "
            "choose among the server's proposers).")
    return frozenset(names)


class RequestOptionsCache:
    """Options per live request, parsed once at its first step and kept in its record
    (:class:`~specplugin.requests.RequestState`). A bad value that got past the front end
    makes the request not speculate: never an error mid-run."""

    def __init__(self, server_k: int, server_proposers: Sequence[str],
                 requests: Requests | None = None):
        self.server_k = server_k
        self.server_proposers = tuple(server_proposers)
        self.requests = requests if requests is not None else Requests()

    def get(self, req_id: str, extra_args: Mapping[str, Any] | None) -> RequestOptions:
        state = self.requests[req_id]
        options = state.options
        if options is None:
            try:
                options = parse_request_options(extra_args, self.server_k, self.server_proposers)
            except RequestOptionError:
                options = RequestOptions(max_k=0)
            state.options = options
        return options

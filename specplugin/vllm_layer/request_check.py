"""Front-end check of each request's ``specplugin_*`` options, before it is scheduled.

Patched in after vLLM's ``InputProcessor._validate_params`` (front-end process). A refused
request raises :class:`RequestRefused`: a ``VLLMValidationError`` (HTTP 400 on the server)
and a ``ValueError`` (for ``LLM.generate``). Parsing and bounds: :mod:`specplugin.request_options`.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from specplugin.request_options import PREFIX, RequestOptionError, parse_request_options
from specplugin.vllm_layer.config_hook import plugin_config, selects_plugin


class RequestRefused(VLLMValidationError, ValueError):
    """A request's ``specplugin_*`` option is refused (HTTP 400 on the server)."""


def check_request(vllm_config, params) -> None:
    """Raise :class:`RequestRefused` if ``params.extra_args`` holds a ``specplugin_*``
    option this server cannot honour. Requests without such keys cost one dict scan."""
    extra_args = getattr(params, "extra_args", None)
    if not extra_args:
        return
    ours = [k for k in extra_args if isinstance(k, str) and k.startswith(PREFIX)]
    if not ours:
        return
    if not selects_plugin(vllm_config):
        raise RequestRefused(
            f"{ours[0]} is a specplugin option, but this server does not run specplugin's "
            "speculative decoding (its speculative_config does not select "
            "specplugin.Speculator); remove the specplugin_* keys from the request.",
            parameter=ours[0], value=extra_args[ours[0]])
    k, proposers = _server_bounds(vllm_config)
    try:
        parse_request_options(extra_args, k, proposers)
    except RequestOptionError as e:
        raise RequestRefused(str(e), parameter=e.key, value=e.value) from None


def check_request_of(input_processor, params, *args, **kwargs) -> None:
    """The patch's hook: runs after ``InputProcessor._validate_params(params, ...)``."""
    check_request(input_processor.vllm_config, params)


# id(vllm_config) -> (vllm_config, bounds); the config is kept so its id is not reused
_BOUNDS: dict[int, tuple[object, tuple[int, tuple[str, ...]]]] = {}


def _server_bounds(vllm_config) -> tuple[int, tuple[str, ...]]:
    """(num_speculative_tokens, proposers) of this server."""
    cached = _BOUNDS.get(id(vllm_config))
    if cached is None or cached[0] is not vllm_config:
        config = plugin_config(vllm_config)
        cached = (vllm_config, (config.num_speculative_tokens, tuple(config.proposers)))
        _BOUNDS[id(vllm_config)] = cached
    return cached[1]

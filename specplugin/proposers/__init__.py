"""Proposers: one file each, all behind :class:`~specplugin.proposers.base.Proposer`.

``build_proposer(name, config)`` is the only place that maps a configured name to
a class; adding a proposer means adding a file and one entry to ``_FACTORIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from specplugin.config import MODEL_PROPOSERS, PROPOSERS, TOKEN_PROPOSERS
from specplugin.proposers.base import Candidate, Proposer, StepBatch
from specplugin.requests import Requests

if TYPE_CHECKING:
    from specplugin.config import SpecPluginConfig


def _ngram(config: "SpecPluginConfig", requests: Requests) -> Proposer:
    from specplugin.proposers.ngram import NgramProposer

    return NgramProposer(min_n=config.ngram.min_n, max_n=config.ngram.max_n,
                         num_alternatives=config.max_candidates - 1)


def _suffix(config: "SpecPluginConfig", requests: Requests) -> Proposer:
    from specplugin.proposers.suffix import SuffixProposer

    return SuffixProposer(num_alternatives=config.max_candidates - 1, requests=requests)


_FACTORIES: dict[str, Callable[["SpecPluginConfig", Requests], Proposer]] = {
    "ngram": _ngram, "suffix": _suffix}
# the names a configuration may give (specplugin.config) and the ones built here agree
assert tuple(_FACTORIES) == TOKEN_PROPOSERS, (tuple(_FACTORIES), TOKEN_PROPOSERS)


def build_proposer(name: str, config: "SpecPluginConfig",
                   requests: Requests | None = None) -> Proposer:
    """The token-level proposer ``name`` (``requests``: the running requests' records it
    shares with the union); model proposers are refused with where they live."""
    if name in MODEL_PROPOSERS:
        raise ValueError(
            f"proposer {name!r} runs a model on vLLM's paged KV cache and is built by the "
            "plugin's worker layer (specplugin.vllm_layer.worker), not by build_proposer; "
            f'select it with additional_config["specplugin"]["proposers"] = ["{name}"].')
    if name not in _FACTORIES:
        raise ValueError(f"unknown proposer {name!r}; available: "
                         f"{', '.join(sorted(PROPOSERS))}.")
    from specplugin.proposers.faults import with_faults  # test-only, off unless configured

    return with_faults(_FACTORIES[name](config, requests if requests is not None else Requests()),
                       config.fault_injection.proposers)


__all__ = ["MODEL_PROPOSERS", "PROPOSERS", "Candidate", "Proposer", "StepBatch",
           "build_proposer"]

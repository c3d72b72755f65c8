"""The compared configurations, as one table: ``METHODS[name]`` says how to start vLLM.

Each method turns its settings into vLLM's ``speculative_config`` and ``additional_config``;
all other engine arguments are the runner's. Families: ``baseline`` (no speculation),
``builtin`` (vLLM's own methods) and ``plugin`` (``specplugin.Speculator`` via ``custom_class``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specplugin.bench.runner import plugin_engine_kwargs

BASELINE, BUILTIN, PLUGIN = "baseline", "builtin", "plugin"

# The built-ins' settings, from (rerun after retraining the zoo; paste its printed dict)
#   specplugin bench --search-builtins --methods vllm-ngram,vllm-suffix,vllm-draft --rounds 1
# plugin-ngram uses vllm-ngram's K so that the two compare proposers, not draft lengths.
BUILTIN_SETTINGS: dict[str, dict[str, Any]] = {
    "vllm-ngram": {"num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "vllm-suffix": {"num_speculative_tokens": 8},
    "vllm-draft": {"num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
}
PLUGIN_SETTINGS: dict[str, dict[str, Any]] = {
    "plugin-ngram": {
        "num_speculative_tokens": BUILTIN_SETTINGS["vllm-ngram"]["num_speculative_tokens"],
        "proposers": ["ngram"],
    },
    # the draft's own rule starts at k=4 and may go on to 8 while the draft stays confident
    "plugin-draft": {"num_speculative_tokens": 8, "proposers": ["draft"]},
    # the draft path at vllm-draft's searched K, to compare at equal draft lengths
    "plugin-draft-vllm-k": {
        "num_speculative_tokens": BUILTIN_SETTINGS["vllm-draft"]["num_speculative_tokens"],
        "proposers": ["draft"],
    },
    # the controller sizes every draft (0 to K) itself: K is only the ceiling
    "plugin-suffix": {"num_speculative_tokens": 8, "proposers": ["suffix"]},
    # the README's recommended configuration: every proposer, one controller
    "plugin-union": {"num_speculative_tokens": 8, "proposers": ["draft", "ngram", "suffix"]},
    # the union without its step arbiter: what the arbiter adds or costs
    "plugin-union-no-arbiter": {"num_speculative_tokens": 8,
                                "proposers": ["draft", "ngram", "suffix"], "step_arbiter": False},
    # the other unions, for check-lossless (every subset of proposers must be lossless)
    "plugin-ngram+suffix": {"num_speculative_tokens": 8, "proposers": ["ngram", "suffix"]},
    "plugin-draft+ngram": {"num_speculative_tokens": 8, "proposers": ["draft", "ngram"]},
    "plugin-draft+suffix": {"num_speculative_tokens": 8, "proposers": ["draft", "suffix"]},
    # the batch-expanding scorer: up to 2 candidates per request verified per step
    "plugin-union-scorer": {"num_speculative_tokens": 8, "proposers": ["draft", "ngram", "suffix"],
                            "max_candidates": 2},
    # check-lossless only: each draft verified as an extra candidate beside a decoy, so
    # the scorer's winners carry the output
    "plugin-scorer-decoy": {"num_speculative_tokens": 8, "proposers": ["ngram", "suffix"],
                            "max_candidates": 2, "fault_injection": {"decoy_primary": True}},
    "plugin-union-scorer-decoy": {"num_speculative_tokens": 8,
                                  "proposers": ["draft", "ngram", "suffix"], "max_candidates": 2,
                                  "fault_injection": {"decoy_primary": True}},
}
# the plugin's methods that are listed (MethodSpec.listed); the others run on request
LISTED_PLUGIN = ("plugin-ngram", "plugin-draft", "plugin-suffix", "plugin-union")


@dataclass(frozen=True)
class Models:
    """The target and (optional) draft model folders every method of one run shares."""

    target: str
    draft: str | None = None


# settings -> {"speculative_config": ..., "additional_config": ...}
SpecBuilder = Callable[[Models, Mapping[str, Any]], "dict[str, Any]"]


@dataclass(frozen=True)
class MethodSpec:
    """One compared configuration: ``build(models, settings)`` gives vLLM's configs;
    ``search_space`` (``--search-builtins``): axes of partial settings, one choice each."""

    name: str
    family: str
    build: SpecBuilder
    settings: Mapping[str, Any] = field(default_factory=dict)
    search_space: tuple[tuple[dict[str, Any], ...], ...] = ()
    needs_draft: bool = False
    listed: bool = True  # in the default lists of `bench` and `check-lossless --quick`

    def engine_kwargs(self, models: Models, settings: Mapping[str, Any] | None = None) -> dict:
        """This method's keyword arguments for ``vllm.LLM``, on top of the runner's defaults."""
        settings = self.settings if settings is None else settings
        if self.needs_draft and not models.draft:
            draft = Path(models.target).parent / "draft"
            raise ValueError(f"method {self.name!r} needs a draft model, and this pair has "
                             f"none: no {draft}/config.json beside its target. Leave the "
                             "method out of --methods, or give the pair a draft (`specplugin "
                             "zoo build` trains the project's own pairs).")
        # vLLM rejects additional_config=None; an empty dict means "no plugin settings"
        return {"speculative_config": None, "additional_config": {},
                **self.build(models, settings)}

    def search_grid(self) -> list[dict[str, Any]]:
        """Every combination of one choice per ``search_space`` axis, in a fixed order."""
        return [dict(self.settings, **{k: v for part in choice for k, v in part.items()})
                for choice in itertools.product(*self.search_space)]


def _no_speculation(models: Models, settings: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _vllm_method(method: str) -> SpecBuilder:
    def build(models: Models, settings: Mapping[str, Any]) -> dict[str, Any]:
        return {"speculative_config": {"method": method, **settings}}

    return build


def _vllm_draft_model(models: Models, settings: Mapping[str, Any]) -> dict[str, Any]:
    return {"speculative_config": {"method": "draft_model", "model": models.draft, **settings}}


def _plugin(models: Models, settings: Mapping[str, Any]) -> dict[str, Any]:
    """K is vLLM's ``num_speculative_tokens``; every other setting is the plugin's own."""
    options = {k: v for k, v in settings.items() if k != "num_speculative_tokens"}
    if "draft" in options.get("proposers", ()):
        options["draft_model"] = models.draft
    return plugin_engine_kwargs(settings["num_speculative_tokens"], options)


_K_AXIS = tuple({"num_speculative_tokens": k} for k in (2, 4, 8))
_LOOKUP_AXIS = tuple({"prompt_lookup_min": lo, "prompt_lookup_max": hi}
                     for lo, hi in ((2, 4), (3, 5), (5, 5)))  # (5, 5) is vLLM's default
_DRAFT_SAMPLE_AXIS = tuple({"draft_sample_method": m} for m in ("greedy", "probabilistic"))

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("none", BASELINE, _no_speculation),
        MethodSpec("vllm-ngram", BUILTIN, _vllm_method("ngram"), BUILTIN_SETTINGS["vllm-ngram"],
                   search_space=(_K_AXIS, _LOOKUP_AXIS)),
        MethodSpec("vllm-suffix", BUILTIN, _vllm_method("suffix"), BUILTIN_SETTINGS["vllm-suffix"],
                   search_space=(_K_AXIS,)),
        MethodSpec("vllm-draft", BUILTIN, _vllm_draft_model, BUILTIN_SETTINGS["vllm-draft"],
                   search_space=(_K_AXIS, _DRAFT_SAMPLE_AXIS),
                   needs_draft=True),
        *(MethodSpec(name, PLUGIN, _plugin, settings, needs_draft="draft" in settings["proposers"],
                     listed=name in LISTED_PLUGIN) for name, settings in PLUGIN_SETTINGS.items()),
    )
}


def resolve(names: list[str] | tuple[str, ...]) -> list[MethodSpec]:
    """Specs for ``names`` in the given order; a clear error names the unknown ones."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}.")
    return [METHODS[n] for n in names]


def names_in(family: str) -> list[str]:
    """The listed methods of ``family``."""
    return [name for name, spec in METHODS.items() if spec.family == family and spec.listed]


def listed_names() -> list[str]:
    """The methods a run compares unless told otherwise."""
    return [name for name, spec in METHODS.items() if spec.listed]


def runnable(names: Sequence[str], models: Models) -> tuple[list[str], list[str]]:
    """``names`` split into (runnable, needing the draft model the pair lacks)."""
    dropped = [n for n in names if METHODS[n].needs_draft and not models.draft]
    return [n for n in names if n not in dropped], dropped

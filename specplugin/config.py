"""The plugin's own settings, parsed from ``additional_config["specplugin"]``.

Users switch the plugin on with vLLM's own arguments only::

    speculative_config={"method": "custom_class", "model": "specplugin.Speculator",
                        "num_speculative_tokens": 8}
    additional_config={"specplugin": {"proposers": ["ngram"]}}

Every bad value raises :class:`SpecPluginConfigError` naming the key, the value and
the fix. The vLLM layer calls :func:`parse` in the front-end process while vLLM
builds its ``VllmConfig``, so the message reaches the user before any engine
process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

CONFIG_KEY = "specplugin"
SPECULATOR_CLASS = "specplugin.Speculator"
MAX_NUM_SPECULATIVE_TOKENS = 32


class SpecPluginConfigError(ValueError):
    """A setting of the plugin is wrong; the message says which and how to fix it."""


def _where(key: str) -> str:
    return f'additional_config["{CONFIG_KEY}"]["{key}"]'


@dataclass(frozen=True)
class NgramSettings:
    """Prompt-lookup matching: try suffixes of length ``max_n`` down to ``min_n``."""

    min_n: int = 2
    max_n: int = 8

    def __post_init__(self):
        for key in ("min_n", "max_n"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise SpecPluginConfigError(
                    f"{_where('ngram')}[\"{key}\"] must be an integer from 1 to 64; got {value!r}."
                )
        if self.min_n > self.max_n:
            raise SpecPluginConfigError(
                f"{_where('ngram')}: min_n ({self.min_n}) must be <= max_n ({self.max_n}). "
                "Lower min_n or raise max_n."
            )


@dataclass(frozen=True)
class SpecPluginConfig:
    """Validated plugin settings; ``num_speculative_tokens`` is vLLM's K."""

    num_speculative_tokens: int
    proposers: tuple[str, ...] = ("ngram",)
    draft_model: str | None = None
    ngram: NgramSettings = field(default_factory=NgramSettings)

    def __post_init__(self):
        from specplugin.proposers import available_proposers

        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise SpecPluginConfigError(
                f"speculative_config['num_speculative_tokens'] must be an integer from 1 to "
                f"{MAX_NUM_SPECULATIVE_TOKENS} with {SPECULATOR_CLASS}; got {k!r}."
            )
        if not self.proposers:
            raise SpecPluginConfigError(
                f"{_where('proposers')} is empty; list at least one proposer, "
                f"e.g. {list(available_proposers())[:1]}."
            )
        for name in self.proposers:
            if name not in available_proposers():
                raise SpecPluginConfigError(
                    f"{_where('proposers')} names unknown proposer {name!r}; "
                    f"available: {', '.join(sorted(available_proposers()))}."
                )
        if len(set(self.proposers)) != len(self.proposers):
            raise SpecPluginConfigError(
                f"{_where('proposers')} lists a proposer twice: {list(self.proposers)}."
            )
        if len(self.proposers) > 1:
            raise SpecPluginConfigError(
                f"{_where('proposers')} lists {len(self.proposers)} proposers "
                f"{list(self.proposers)}; combining proposers is not available yet: list one."
            )
        if self.draft_model is not None:
            self._check_draft_model(self.draft_model)

    def _check_draft_model(self, path: str) -> None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise SpecPluginConfigError(
                f"{_where('draft_model')} = {path!r} is not a directory. Give the path of a "
                "local model folder in Hugging Face format (config.json and weights)."
            )
        if not (folder / "config.json").is_file():
            raise SpecPluginConfigError(
                f"{_where('draft_model')} = {path!r} has no config.json; it must be a model "
                "folder in Hugging Face format."
            )
        if "draft" not in self.proposers:
            raise SpecPluginConfigError(
                f"{_where('draft_model')} is set but {_where('proposers')} = "
                f"{list(self.proposers)} does not use it; add 'draft' to proposers or drop "
                "draft_model."
            )


_TYPES: dict[str, tuple[type, ...]] = {
    "proposers": (list, tuple),
    "draft_model": (str,),
    "ngram": (dict,),
}


def parse(options: Any, num_speculative_tokens: int) -> SpecPluginConfig:
    """Build a :class:`SpecPluginConfig` from the raw ``additional_config["specplugin"]``."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise SpecPluginConfigError(
            f'additional_config["{CONFIG_KEY}"] must be a JSON object (dict); got '
            f"{type(options).__name__} {options!r}. Example: "
            f'{{"{CONFIG_KEY}": {{"proposers": ["ngram"]}}}}.'
        )
    known = {f.name for f in fields(SpecPluginConfig)} - {"num_speculative_tokens"}
    for key, value in options.items():
        if key not in known:
            raise SpecPluginConfigError(
                f'additional_config["{CONFIG_KEY}"] has unknown key {key!r}; '
                f"known keys: {', '.join(sorted(known))}."
            )
        if not isinstance(value, _TYPES[key]):
            wanted = " or ".join(t.__name__ for t in _TYPES[key])
            raise SpecPluginConfigError(
                f"{_where(key)} must be a {wanted}; got {type(value).__name__} {value!r}."
            )
    kwargs = dict(options)
    if "proposers" in kwargs:
        names = kwargs["proposers"]
        if not all(isinstance(n, str) for n in names):
            raise SpecPluginConfigError(
                f"{_where('proposers')} must be a list of proposer names (strings); got {names!r}."
            )
        kwargs["proposers"] = tuple(names)
    if "ngram" in kwargs:
        allowed = {f.name for f in fields(NgramSettings)}
        unknown = set(kwargs["ngram"]) - allowed
        if unknown:
            raise SpecPluginConfigError(
                f"{_where('ngram')} has unknown key(s) {sorted(unknown)}; "
                f"known keys: {', '.join(sorted(allowed))}."
            )
        kwargs["ngram"] = NgramSettings(**kwargs["ngram"])
    return SpecPluginConfig(num_speculative_tokens=num_speculative_tokens, **kwargs)

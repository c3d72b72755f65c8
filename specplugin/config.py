"""The plugin's own settings, parsed from ``additional_config["specplugin"]``.

Users switch the plugin on with vLLM's own arguments only::

    speculative_config={"method": "custom_class", "model": "specplugin.Speculator",
                        "num_speculative_tokens": 8}
    additional_config={"specplugin": {"proposers": ["ngram"]}}
    # or a draft model that shares the target's vocabulary:
    additional_config={"specplugin": {"proposers": ["draft"], "draft_model": "/path/to/draft"}}

Every bad value raises :class:`SpecPluginConfigError` naming the key, the value and the
fix; :func:`parse` runs in the front-end process, before any engine process starts.
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

CONFIG_KEY = "specplugin"
SPECULATOR_CLASS = "specplugin.Speculator"
MAX_NUM_SPECULATIVE_TOKENS = 32
# most candidates verified per request per step (the batch-expanding scorer)
MAX_CANDIDATES = 4
# Proposer names, listed here so checking a config imports no proposer. Token-level ones:
# proposers.build_proposer; model ones: vllm_layer.worker (on vLLM's paged KV cache).
TOKEN_PROPOSERS = ("ngram", "suffix")
MODEL_PROPOSERS = ("draft",)
PROPOSERS = (*TOKEN_PROPOSERS, *MODEL_PROPOSERS)


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
class DraftSettings:
    """Draft stopping rule (``specplugin.adaptive.draft_rule``): draft while the calibrated
    chance that all drafts so far are accepted stays >= ``min_acceptance`` (default: the
    measured draft-forward cost per emitted token; 0: always draft K); ``k`` tokens until
    calibrated."""

    k: int = 4
    min_acceptance: float | None = None

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise SpecPluginConfigError(
                f"{_where('draft')}[\"k\"] must be an integer from 1 to "
                f"{MAX_NUM_SPECULATIVE_TOKENS}; got {self.k!r}."
            )
        c = self.min_acceptance
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not 0.0 <= c <= 1.0):
            raise SpecPluginConfigError(
                f"{_where('draft')}[\"min_acceptance\"] must be a number from 0 to 1 "
                f"(0 never stops early), or null to measure it; got {c!r}."
            )


@dataclass(frozen=True)
class FaultSettings:
    """Test-only fault injection (:mod:`specplugin.proposers.faults`): ``proposers`` maps a
    proposer to N, ``draft_forward`` is N (every N-th call / forward raises); ``rank``: they
    fire on that tensor-parallel rank only (None: on every rank)."""

    proposers: dict = field(default_factory=dict)
    draft_forward: int | None = None
    rank: int | None = None
    # send the scheduler a decoy draft and verify the real one as an extra candidate, so
    # non-primary winners carry the output (needs max_candidates >= 2)
    decoy_primary: bool = False
    # the step arbiter alternates speculative and plain blocks regardless of measurements
    alternate_blocks: bool = False
    # run the draft model in every speculative step where a row could use it
    draft_always: bool = False

    def __post_init__(self):
        where = _where("fault_injection")
        for key in ("decoy_primary", "alternate_blocks", "draft_always"):
            if not isinstance(getattr(self, key), bool):
                raise SpecPluginConfigError(
                    f"{where}[\"{key}\"] must be true or false; got {getattr(self, key)!r}.")
        if not isinstance(self.proposers, dict):
            raise SpecPluginConfigError(
                f"{where}[\"proposers\"] must be an object mapping proposer names to N; got "
                f"{self.proposers!r}.")
        for name, every in self.proposers.items():
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise SpecPluginConfigError(
                    f"{where}[\"proposers\"][{name!r}] must be an integer >= 1 (the proposer "
                    f"raises at every N-th call); got {every!r}.")
        n = self.draft_forward
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SpecPluginConfigError(
                f"{where}[\"draft_forward\"] must be an integer >= 1 (every N-th draft "
                f"forward raises) or null; got {n!r}.")
        r = self.rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise SpecPluginConfigError(
                f"{where}[\"rank\"] must be a tensor-parallel rank (an integer >= 0) or "
                f"null (every rank); got {r!r}.")

    def on_rank(self, rank: int) -> FaultSettings:
        """The settings on tensor-parallel ``rank``: without the failures if they are pinned
        to another rank (the other switches hold on every rank alike)."""
        if self.rank is None or self.rank == rank:
            return self
        return dataclasses.replace(self, proposers={}, draft_forward=None)


@dataclass(frozen=True)
class SpecPluginConfig:
    """Validated plugin settings; ``num_speculative_tokens`` is vLLM's K."""

    num_speculative_tokens: int
    proposers: tuple[str, ...] = ("ngram",)
    draft_model: str | None = None
    ngram: NgramSettings = field(default_factory=NgramSettings)
    draft: DraftSettings = field(default_factory=DraftSettings)
    # False: every step speculates (never switch to plain decoding), e.g. for check-lossless
    step_arbiter: bool = True
    # test-only (specplugin.proposers.faults)
    fault_injection: FaultSettings = field(default_factory=FaultSettings)
    # most candidates verified per request per step (1: the batch-expanding scorer off)
    max_candidates: int = 1
    # where the union keeps what it learned across restarts (specplugin.adaptive.memory)
    state_dir: str | None = None

    def __post_init__(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise SpecPluginConfigError(
                f"speculative_config['num_speculative_tokens'] must be an integer from 1 to "
                f"{MAX_NUM_SPECULATIVE_TOKENS} with {SPECULATOR_CLASS}; got {k!r}."
            )
        if not self.proposers:
            raise SpecPluginConfigError(
                f"{_where('proposers')} is empty; list at least one proposer, "
                f"e.g. {list(PROPOSERS)[:1]}."
            )
        for name in self.proposers:
            if name not in PROPOSERS:
                raise SpecPluginConfigError(
                    f"{_where('proposers')} names unknown proposer {name!r}; "
                    f"available: {', '.join(sorted(PROPOSERS))}."
                )
        if len(set(self.proposers)) != len(self.proposers):
            raise SpecPluginConfigError(
                f"{_where('proposers')} lists a proposer twice: {list(self.proposers)}."
            )
        for name in self.fault_injection.proposers:
            if name == "draft":
                raise SpecPluginConfigError(
                    f"{_where('fault_injection')}[\"proposers\"] names 'draft'; the draft "
                    "model's failures are injected with fault_injection[\"draft_forward\"].")
            if name not in self.proposers:
                raise SpecPluginConfigError(
                    f"{_where('fault_injection')}[\"proposers\"] names {name!r}, which "
                    f"{_where('proposers')} = {list(self.proposers)} does not run.")
        if self.fault_injection.draft_forward is not None and "draft" not in self.proposers:
            raise SpecPluginConfigError(
                f"{_where('fault_injection')}[\"draft_forward\"] needs the 'draft' proposer.")
        self._check_max_candidates()
        if self.state_dir is not None:
            self._check_state_dir(self.state_dir)
        if self.draft_model is not None:
            self._check_draft_model(self.draft_model)
        elif "draft" in self.proposers:
            raise SpecPluginConfigError(
                f"{_where('proposers')} lists 'draft' but {_where('draft_model')} is not set; "
                "give the path of a draft model folder that shares the target's vocabulary."
            )

    def _check_max_candidates(self) -> None:
        n = self.max_candidates
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CANDIDATES:
            raise SpecPluginConfigError(
                f"{_where('max_candidates')} must be an integer from 1 (one draft per request, "
                f"the default) to {MAX_CANDIDATES}; got {n!r}.")
        if self.fault_injection.decoy_primary and n < 2:
            raise SpecPluginConfigError(
                f"{_where('fault_injection')}[\"decoy_primary\"] needs "
                f"{_where('max_candidates')} >= 2 (the real draft is verified as an extra "
                "candidate).")

    def _check_state_dir(self, path: str) -> None:
        """Checked now: the worker writes it long after start, where an error would be lost."""
        folder = Path(path).expanduser()
        if folder.exists() and not folder.is_dir():
            raise SpecPluginConfigError(
                f"{_where('state_dir')} = {path!r} exists and is not a directory; give a "
                "directory (it is created if missing) or drop the key.")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecPluginConfigError(
                f"{_where('state_dir')} = {path!r} could not be created ({err.strerror}); "
                "give a directory this user can create and write.") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise SpecPluginConfigError(
                f"{_where('state_dir')} = {path!r} is not writable by this user; give a "
                "directory it can write, or drop the key.")

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
        _check_model_config(folder, path)
        if "draft" not in self.proposers:
            raise SpecPluginConfigError(
                f"{_where('draft_model')} is set but {_where('proposers')} = "
                f"{list(self.proposers)} does not use it; add 'draft' to proposers or drop "
                "draft_model."
            )


def _check_model_config(folder: Path, path: str) -> None:
    """``config.json`` must be readable by transformers; else vLLM fails deep inside it."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(folder))
    except Exception as err:  # JSON errors, a missing or unknown model_type, ...
        raise SpecPluginConfigError(
            f"{_where('draft_model')} = {path!r}: its config.json is not a model config "
            f"transformers can read ({type(err).__name__}: {str(err).splitlines()[0]}). "
            "Give a model folder in Hugging Face format (config.json with a model_type, "
            "weights, tokenizer)."
        ) from None


_TYPES: dict[str, tuple[type, ...]] = {
    "proposers": (list, tuple),
    "draft_model": (str,),
    "ngram": (dict,),
    "draft": (dict,),
    "step_arbiter": (bool,),
    "fault_injection": (dict,),
    "max_candidates": (int,),
    "state_dir": (str,),
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
    for key, settings_cls in (("ngram", NgramSettings), ("draft", DraftSettings),
                              ("fault_injection", FaultSettings)):
        if key not in kwargs:
            continue
        allowed = {f.name for f in fields(settings_cls)}
        unknown = set(kwargs[key]) - allowed
        if unknown:
            raise SpecPluginConfigError(
                f"{_where(key)} has unknown key(s) {sorted(unknown)}; "
                f"known keys: {', '.join(sorted(allowed))}."
            )
        kwargs[key] = settings_cls(**kwargs[key])
    return SpecPluginConfig(num_speculative_tokens=num_speculative_tokens, **kwargs)


def check_shared_vocabulary(target_tokenizer: str, draft_model: str,
                            target_vocab_size: int, draft_vocab_size: int) -> None:
    """Draft and target must number tokens the same way: compares vocabulary sizes, then
    (when both are local folders with a tokenizer) the token-to-id maps."""
    where = _where("draft_model")
    if target_vocab_size != draft_vocab_size:
        raise SpecPluginConfigError(
            f"{where} = {draft_model!r} has a vocabulary of {draft_vocab_size} tokens but the "
            f"target has {target_vocab_size}; the draft model must share the target's "
            "tokenizer. Use a draft trained with the target's tokenizer."
        )
    folders = [Path(target_tokenizer).expanduser(), Path(draft_model).expanduser()]
    if not all(_has_tokenizer(f) for f in folders):
        return  # e.g. models served with skip_tokenizer_init: sizes are all there is
    from transformers import AutoTokenizer

    target_vocab, draft_vocab = (AutoTokenizer.from_pretrained(str(f)).get_vocab() for f in folders)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
        raise SpecPluginConfigError(
            f"{where} = {draft_model!r} has a tokenizer that numbers tokens differently from "
            f"the target's (e.g. {differing}); the draft model must share the target's "
            "tokenizer. Use a draft trained with the target's tokenizer."
        )


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))

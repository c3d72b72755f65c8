"""Per-request control: parsing and bounds (vLLM-free), the union honouring it, and the
front-end hook it depends on (fails loudly if vLLM moves it)."""

import inspect

import numpy as np
import pytest

from specplugin.proposers.base import Candidate, StepBatch
from specplugin.adaptive.union import Union
from specplugin.request_options import (
    DEFAULT,
    MAX_K_KEY,
    PROPOSERS_KEY,
    RequestOptionError,
    RequestOptions,
    RequestOptionsCache,
    parse_request_options,
)

SERVER = ("draft", "ngram", "suffix")


def parse(extra):
    return parse_request_options(extra, 8, SERVER)


def test_requests_without_our_keys_get_the_servers_settings():
    assert parse(None) == parse({}) == parse({"other_plugin_key": 3}) == DEFAULT
    assert DEFAULT.cap(8) == 8 and DEFAULT.allows("ngram")


def test_max_k_lowers_k_and_zero_switches_speculation_off():
    assert parse({MAX_K_KEY: 3}).cap(8) == 3
    assert parse({MAX_K_KEY: 0}).cap(8) == 0
    assert parse({MAX_K_KEY: 8}).cap(8) == 8


@pytest.mark.parametrize("value", [9, -1, 100])
def test_max_k_above_the_server_or_negative_is_refused_naming_the_bound(value):
    with pytest.raises(RequestOptionError) as e:
        parse({MAX_K_KEY: value})
    assert e.value.key == MAX_K_KEY and "num_speculative_tokens=8" in str(e.value)
    assert f"{MAX_K_KEY}={value}" in str(e.value)


@pytest.mark.parametrize("value", ["4", 2.0, True, None, [4]])
def test_max_k_of_the_wrong_type_is_refused(value):
    with pytest.raises(RequestOptionError, match=f"{MAX_K_KEY} must be an integer from 0 to 8"):
        parse({MAX_K_KEY: value})


@pytest.mark.parametrize("value", ["suffix,ngram", " suffix , ngram ", ["ngram", "suffix"]])
def test_proposers_as_a_comma_separated_string_or_a_list(value):
    options = parse({PROPOSERS_KEY: value})
    assert options.proposers == frozenset({"ngram", "suffix"})
    assert options.allows("ngram") and not options.allows("draft")


def test_a_proposer_the_server_did_not_load_is_refused_naming_what_it_runs():
    with pytest.raises(RequestOptionError) as e:
        parse_request_options({PROPOSERS_KEY: "ngram,draft"}, 8, ("ngram", "suffix"))
    assert e.value.key == PROPOSERS_KEY
    assert "'draft'" in str(e.value) and "it runs ngram, suffix" in str(e.value)


@pytest.mark.parametrize("value", ["", " , ", 3, ["ngram", 2]])
def test_empty_or_mistyped_proposers_are_refused(value):
    with pytest.raises(RequestOptionError) as e:
        parse({PROPOSERS_KEY: value})
    assert e.value.key == PROPOSERS_KEY


def test_an_unknown_key_with_our_prefix_is_refused_not_ignored():
    with pytest.raises(RequestOptionError) as e:
        parse({"specplugin_maxk": 2})
    assert e.value.key == "specplugin_maxk"
    assert MAX_K_KEY in str(e.value) and PROPOSERS_KEY in str(e.value)


def test_the_workers_cache_parses_once_and_never_raises():
    cache = RequestOptionsCache(8, SERVER)
    assert cache.get("a", {MAX_K_KEY: 2}).max_k == 2
    assert cache.get("a", {MAX_K_KEY: 5}).max_k == 2  # parsed at the request's first step
    assert cache.get("bad", {MAX_K_KEY: 99}) == RequestOptions(max_k=0)  # no speculation
    cache.requests.finish(["a", "bad", "never-seen"])
    assert cache.get("a", {MAX_K_KEY: 5}).max_k == 5


class _Fixed:
    """A proposer offering the same long candidate to every row it is asked about."""

    def __init__(self, name):
        self.name = name
        self.asked_rows: list[tuple[int, ...]] = []

    def propose(self, batch):
        self.asked_rows.append(batch.rows)
        return [Candidate(np.arange(4, dtype=np.int64), np.full(4, 0.99))
                if r in batch.rows else None for r in range(batch.num_reqs)]

    def finish_requests(self, req_ids):
        pass


def _batch(allowed):
    n = len(allowed)
    return StepBatch(tuple(f"r{i}" for i in range(n)), np.zeros((n, 16), dtype=np.int64),
                     np.full(n, 10), np.full(n, 5), np.full(n, 4), np.zeros(n, dtype=bool),
                     tuple(range(n)), tuple(allowed))


def test_the_union_asks_each_proposer_only_about_rows_that_allow_it():
    ngram, suffix = _Fixed("ngram"), _Fixed("suffix")
    union = Union([ngram, suffix], explore=False)
    batch = _batch([None, frozenset({"suffix"}), frozenset({"ngram"})])
    offers = union.ask(batch, range(2))
    assert ngram.asked_rows == [(0, 2)] and suffix.asked_rows == [(0, 1)]
    assert sorted((r, union.proposers[i].name) for r, i, _ in offers) == [
        (0, "ngram"), (0, "suffix"), (1, "suffix"), (2, "ngram")]
    # without restrictions every proposer sees every row
    assert _batch([None] * 3).for_proposer("ngram").rows == (0, 1, 2)


def test_vllm_still_validates_requests_where_the_plugin_checks_them():
    """The plugin's check runs after ``InputProcessor._validate_params(params, tasks)``;
    if vLLM renames or reshapes it, per-request options would go unchecked."""
    from vllm.v1.engine.input_processor import InputProcessor

    params = list(inspect.signature(InputProcessor._validate_params).parameters)
    assert params[:2] == ["self", "params"], params
    assert "self._validate_params(" in inspect.getsource(InputProcessor.process_inputs)


def test_register_installs_the_request_check():
    from vllm.v1.engine.input_processor import InputProcessor

    from specplugin.plugin import register
    from specplugin.vllm_layer import patches

    register()
    register()  # idempotent: vLLM may load plugins more than once
    assert patches.is_patched(InputProcessor, "_validate_params")


def test_the_check_refuses_with_vllms_validation_error_naming_the_key():
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from specplugin.vllm_layer.request_check import RequestRefused, check_request

    params = SimpleNamespace(extra_args={MAX_K_KEY: 1})
    off = SimpleNamespace(speculative_config=None, additional_config={})
    with pytest.raises(RequestRefused) as e:
        check_request(off, params)
    assert isinstance(e.value, VLLMValidationError) and isinstance(e.value, ValueError)
    assert e.value.parameter == MAX_K_KEY and "does not run specplugin" in str(e.value)
    check_request(off, SimpleNamespace(extra_args={"unrelated": 1}))  # not ours: untouched

"""Every bad plugin setting is refused with a message naming the key, the value and the fix."""

import pytest

from specplugin.config import SpecPluginConfigError, parse


def test_defaults():
    cfg = parse({"proposers": ["ngram"]}, 8)
    assert cfg.proposers == ("ngram",) and cfg.num_speculative_tokens == 8
    assert parse(None, 4).proposers == ("ngram",)


@pytest.mark.parametrize(
    "options, k, fragments",
    [
        ({"proposers": ["ngrm"]}, 8, ["proposers", "'ngrm'", "available: draft, ngram"]),
        ({"proposers": []}, 8, ["proposers", "empty"]),
        ({"proposers": ["ngram", "ngram"]}, 8, ["twice"]),
        ({"proposer": ["ngram"]}, 8, ["unknown key 'proposer'", "known keys"]),
        ({"proposers": "ngram"}, 8, ["proposers", "must be a list", "str 'ngram'"]),
        ({"proposers": [1]}, 8, ["proposers", "names (strings)"]),
        ({"proposers": ["ngram"]}, 0, ["num_speculative_tokens", "from 1 to 32", "got 0"]),
        ({"proposers": ["ngram"]}, 33, ["num_speculative_tokens", "got 33"]),
        ({"draft_model": "/no/such/model"}, 8, ["draft_model", "/no/such/model", "not a directory"]),
        ({"draft_model": 3}, 8, ["draft_model", "must be a str"]),
        ({"ngram": {"min_n": 5, "max_n": 2}}, 8, ["min_n (5) must be <= max_n (2)"]),
        ({"ngram": {"min_n": 0}}, 8, ["min_n", "from 1 to 64", "got 0"]),
        ({"ngram": {"size": 3}}, 8, ["ngram", "unknown key", "size"]),
        ("ngram", 8, ['additional_config["specplugin"] must be a JSON object']),
        ({"proposers": ["ngram", "suffix"], "max_candidates": 0}, 8,
         ["max_candidates", "from 1", "to 4", "got 0"]),
        ({"proposers": ["ngram", "suffix"], "max_candidates": 5}, 8, ["max_candidates", "got 5"]),
        ({"proposers": ["ngram", "suffix"], "max_candidates": "2"}, 8,
         ["max_candidates", "must be a int"]),
        ({"proposers": ["ngram", "suffix"], "fault_injection": {"decoy_primary": True}}, 8,
         ["decoy_primary", "max_candidates", ">= 2"]),
    ],
)
def test_bad_settings_are_refused_clearly(options, k, fragments):
    with pytest.raises(SpecPluginConfigError) as err:
        parse(options, k)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_max_candidates_defaults_to_one_chain():
    assert parse({"proposers": ["ngram", "suffix"]}, 8).max_candidates == 1
    assert parse({"proposers": ["ngram", "suffix"], "max_candidates": 2}, 8).max_candidates == 2
    # one proposer's own alternatives are candidates too
    assert parse({"proposers": ["suffix"], "max_candidates": 3}, 8).max_candidates == 3


def test_draft_model_must_be_a_model_folder(tmp_path):
    with pytest.raises(SpecPluginConfigError, match="has no config.json"):
        parse({"draft_model": str(tmp_path)}, 4)
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')  # JSON, but no model
    with pytest.raises(SpecPluginConfigError) as err:
        parse({"proposers": ["draft"], "draft_model": str(tmp_path)}, 4)
    assert 'additional_config["specplugin"]["draft_model"]' in str(err.value)
    assert "not a model config" in str(err.value) and "model_type" in str(err.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecPluginConfigError, match="not a model config"):
        parse({"proposers": ["draft"], "draft_model": str(tmp_path)}, 4)


def test_a_draft_model_the_proposers_do_not_use_is_refused():
    from specplugin.zoo import zoo_path

    with pytest.raises(SpecPluginConfigError, match="does not use it"):
        parse({"draft_model": str(zoo_path("draft"))}, 4)


def test_build_proposer_names_where_model_proposers_are_built():
    from specplugin.proposers import PROPOSERS, build_proposer

    config = parse(None, 4)
    assert "draft" in PROPOSERS
    with pytest.raises(ValueError, match="built by the plugin's worker layer"):
        build_proposer("draft", config)
    with pytest.raises(ValueError, match="unknown proposer 'nope'"):
        build_proposer("nope", config)
    assert build_proposer("ngram", config).name == "ngram"

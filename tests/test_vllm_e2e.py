"""The plugin inside real vLLM: greedy output identical, drafts accepted, bad settings stopped.

Engines are few and shared: the reference (drafts off per request) and the n-gram
proposer alone (per request) run in the suite's shared full-union engine
(tests/shared_engine.py); one engine runs vLLM's own draft_model method on the zoo pair
(which also proves both zoo models load in vLLM).
"""

import pytest

from specplugin.bench.runner import engine_kwargs, plugin_engine_kwargs, run_engine
from specplugin.zoo import zoo_path
from tests.prompts import PARSE_HEADER
from tests.shared_engine import REFERENCE, add_cell

pytestmark = pytest.mark.vllm

CODE = PARSE_HEADER + '''

def parse_headers(lines):
    headers = {}
    for line in lines:
        key, value = parse_header(line)
        headers[key] = value
    return headers
'''

PROMPTS = [
    CODE + "\n\n# The same functions again:\n" + CODE[:120],  # copies a long span
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    CODE[:200],
]
GREEDY = {"max_tokens": 96, "eager": True}  # greedy is run_engine's default temperature


@pytest.fixture(scope="module")
def target(zoo_root):
    return zoo_path("target", zoo_root)


# in the suite's shared engine: the prompts without drafts, then with n-gram drafts only
REFERENCE_CELL = add_cell("vllm_e2e/reference", PROMPTS, max_tokens=GREEDY["max_tokens"],
                          options=REFERENCE)
NGRAM_CELL = add_cell("vllm_e2e/ngram", PROMPTS, max_tokens=GREEDY["max_tokens"],
                      options={"specplugin_proposers": "ngram"})


@pytest.fixture(scope="module")
def baseline(shared_runs):
    return shared_runs[REFERENCE_CELL]


@pytest.fixture(scope="module")
def with_plugin(shared_runs):
    return shared_runs[NGRAM_CELL]


def first_difference(want: list[list[int]], got: list[list[int]]) -> str:
    """Where two runs' outputs first differ: the request count, or a request and position."""
    if len(want) != len(got):
        return f"{len(got)} requests instead of {len(want)}"
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"request {i}: first difference at output position {pos}"
    return "none"


def test_greedy_output_is_identical_token_for_token(baseline, with_plugin):
    assert len(baseline.token_ids) == len(PROMPTS)
    assert all(len(t) == GREEDY["max_tokens"] for t in baseline.token_ids)
    assert with_plugin.token_ids == baseline.token_ids, first_difference(
        baseline.token_ids, with_plugin.token_ids)


def test_vllm_counters_show_drafts_accepted_on_repeating_text(baseline, with_plugin):
    assert baseline.num_drafts == 0  # specplugin_max_k 0: no request drafted
    assert with_plugin.num_drafts > 0
    assert with_plugin.num_accepted_tokens > 0
    assert with_plugin.mean_acceptance_length > 1.5, with_plugin
    assert sum(with_plugin.accepted_per_pos) == with_plugin.num_accepted_tokens


def test_vllm_draft_model_method_loads_the_zoo_pair(zoo_root, target, baseline, tmp_path):
    """Both zoo models load in vLLM; its own draft_model method is lossless on them too."""
    spec = {"method": "draft_model", "model": str(zoo_path("draft", zoo_root)),
            "num_speculative_tokens": 4}
    run = run_engine(target, {"speculative_config": spec}, PROMPTS, workdir=tmp_path, **GREEDY)
    assert run.token_ids == baseline.token_ids, first_difference(baseline.token_ids, run.token_ids)
    assert run.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "options, k, fragment",
    [
        ({"proposers": ["ngrm"]}, 8, "names unknown proposer 'ngrm'"),
        ({"proposers": "ngram"}, 8, 'additional_config["specplugin"]["proposers"] must be a list'),
        ({"proposers": ["ngram"], "lookahead": 3}, 8, "unknown key 'lookahead'"),
        ({"draft_model": "/no/such/dir"}, 8, "'/no/such/dir' is not a directory"),
        ({"proposers": ["ngram"]}, 40, "num_speculative_tokens'] must be an integer from 1 to 32"),
    ],
)
def test_bad_settings_stop_vllm_at_start_with_the_fix_in_the_message(target, options, k, fragment):
    """Raised in the user's own process while vLLM builds its config: no engine starts."""
    from vllm import LLM

    with pytest.raises(Exception) as err:
        LLM(model=str(target), **engine_kwargs(plugin_engine_kwargs(k, options), eager=True))
    assert fragment in str(err.value)

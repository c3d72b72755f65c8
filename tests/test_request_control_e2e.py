"""Per-request control inside real vLLM (offline ``LLM``): ``specplugin_max_k`` and
``specplugin_proposers`` through ``SamplingParams.extra_args``.

One engine, the full union (draft model, n-gram, suffix) with every 9th draft-model
forward failing on purpose (``fault_injection.draft_forward``), vLLM in-process in its own
Python process so that a probe can record which requests each proposer is asked
about (and for which the draft model runs), and vLLM's per-request spec-decode
metrics (``per_request_spec_decode_metrics="detailed"``) give each request's draft
length per step. The HTTP side (400 on a bad value) is in tests/test_serve.py.
"""


import pytest

from specplugin.bench.runner import engine_kwargs, plugin_engine_kwargs
from specplugin.zoo import zoo_path
from tests.probe import run_probe
from tests.prompts import PARSE_HEADER

pytestmark = pytest.mark.vllm

K = 8
DRAFT_FORWARD_FAULT = 9
CODE = PARSE_HEADER
# distinct first tokens (the probe tells requests apart by them), copy-friendly bodies
PROMPTS = [f"# {name}.py\n" + CODE + "\n\n# The same function again:\n" + CODE[:60]
           for name in ("alpha", "beta", "gamma", "delta")]
# per prompt: what the request asks for
OPTIONS = [{}, {"specplugin_max_k": 0}, {"specplugin_max_k": 2},
           {"specplugin_proposers": "suffix"}]
REFUSED = {"k_above_server": {"specplugin_max_k": K + 1},
           "k_as_string": {"specplugin_max_k": "2"},
           "proposer_not_loaded": {"specplugin_proposers": "ngram,eagle"},
           "typo_in_key": {"specplugin_maxk": 2}}

PROBE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from specplugin.adaptive.arbiter import StepArbiter
from specplugin.proposers.ngram import NgramProposer
from specplugin.proposers.suffix import SuffixProposer
from specplugin.adaptive.learning import Learner
from specplugin.adaptive.union import Union
from specplugin.vllm_layer.draft_proposer import PluginDraftProposer

# short runs: every step speculates and the draft model runs for every row that may use
# it (the arbiter and the union's plan for the draft are tested on their own)
StepArbiter.speculate = lambda self, num_reqs, sampled=False: True
Union.plan_draft = lambda self, batch, offers, draft_index, caps, *priced, **kw: caps
asked = {"ngram": [], "suffix": [], "draft": []}  # first tokens of each row asked about

def recording(name, original):
    def propose(self, batch):
        asked[name].extend(batch.token_ids[r, :6].tolist() for r in batch.rows)
        return original(self, batch)
    return propose

NgramProposer.propose = recording("ngram", NgramProposer.propose)
SuffixProposer.propose = recording("suffix", SuffixProposer.propose)
first_pass = PluginDraftProposer._first_pass_inputs

def first_pass_inputs(self, batch, rows, *args):
    asked["draft"].extend(batch.token_ids[r, :6].tolist() for r in rows)
    return first_pass(self, batch, rows, *args)

PluginDraftProposer._first_pass_inputs = first_pass_inputs
job = json.loads(sys.argv[1])
llm = LLM(model=job["model"], **job["engine_kwargs"])
tokenizer = llm.get_tokenizer()
prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(p)) for p in job["prompts"]]

def params(extra):
    return SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, extra_args=extra)

refused = {}
for name, extra in job["refused"].items():
    try:  # one good request beside the bad one: the call fails as a whole, before scheduling
        llm.generate(prompts[:2], [params({}), params(extra)], use_tqdm=False)
        refused[name] = None
    except Exception as e:
        refused[name] = {"type": type(e).__name__, "value_error": isinstance(e, ValueError),
                         "message": str(e)}
# sampled requests: what the union learns from their verification (the rejection
# sampler's acceptance probabilities, specplugin/vllm_layer/verification.py)
heard = {"greedy": [], "sampled": []}
# and whether each step it learns from read new prompts (StepContext.read_prompts)
read_prompts = {"greedy": [], "sampled": []}
# each learned step, told apart by its requests, not by when it is learned: past the cold
# start the union learns a step in the worker's wait, and a run's last step is learned
# once the next run's first step is planned
learned = []
learn = Learner.learn_rows

def recording_learn(self, verified, *args, **kwargs):
    rows = [[None if verified.expected is None else list(verified.expected[r]), int(k)]
            for r, k in enumerate(verified.num_scheduled_drafts) if k > 0]
    learned.append((tuple(verified.req_ids), rows, verified.read_prompts))
    return learn(self, verified, *args, **kwargs)

Learner.learn_rows = recording_learn
run_ids = {}
for job_mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
    outs = llm.generate(prompts[:2], SamplingParams(temperature=temperature, max_tokens=32,
                                                    seed=0, ignore_eos=True), use_tqdm=False)
    run_ids[job_mode] = [o.request_id for o in outs]
Learner.learn_rows = learn

def run_of(req_id):  # (vLLM may suffix the engine's id to the caller's)
    return next(mode for mode, ids in run_ids.items()
                if any(req_id == i or req_id.startswith(f"{i}-") for i in ids))

for req_ids, rows, flag in learned:
    (mode,) = {run_of(r) for r in req_ids}  # a step of one run only
    heard[mode].extend(rows)
    read_prompts[mode].append(flag)
plain = llm.generate(prompts, params({"specplugin_max_k": 0}), use_tqdm=False)
for record in asked.values():
    record.clear()
mixed = llm.generate(prompts, [params(o) for o in job["options"]], use_tqdm=False)

# one more (plain) request: the union learns a step's verification at the next step,
# and, a publishing period later, its steps publish the counters of the runs above (on a
# fast machine the mixed run can end within one period of the last publication)
from specplugin.vllm_layer.metrics_export import PUBLISH_EVERY_S, engine_stats
time.sleep(PUBLISH_EVERY_S + 0.2)
llm.generate(prompts[:1], SamplingParams(max_tokens=2, extra_args={"specplugin_max_k": 0}),
             use_tqdm=False)
exact = engine_stats(llm)
vllm_counters, ours = {}, []
for m in llm.get_metrics():
    if m.name.startswith("vllm:spec_decode_num_") and not m.name.endswith("per_pos"):
        vllm_counters[m.name] = m.value
    elif m.name.startswith("vllm:specplugin_"):
        ours.append([m.name, m.labels, m.value])

def metrics(output):
    m = output.outputs[0].spec_decode_metrics
    return None if m is None else m.to_dict()

print("RESULT " + json.dumps({
    "refused": refused, "first_tokens": [p["prompt_token_ids"][:6] for p in prompts],
    "plain": [list(o.outputs[0].token_ids) for o in plain],
    "mixed": [list(o.outputs[0].token_ids) for o in mixed],
    "metrics": [metrics(o) for o in mixed], "asked": asked, "exact": exact,
    "vllm_counters": vllm_counters, "published": ours, "heard": heard,
    "read_prompts": read_prompts}))
"""


@pytest.fixture(scope="module")
def probe(zoo_root):
    # every 9th forward of the draft model fails on purpose (test-only fault injection):
    # that step loses its drafts, never a request, and the failure is counted
    options = {"proposers": ["draft", "ngram", "suffix"],
               "draft_model": str(zoo_path("draft", zoo_root)),
               "fault_injection": {"draft_forward": DRAFT_FORWARD_FAULT}}
    kwargs = engine_kwargs({**plugin_engine_kwargs(K, options),
                            "per_request_spec_decode_metrics": "detailed"}, eager=True)
    job = {"model": str(zoo_path("target", zoo_root)), "engine_kwargs": kwargs,
           "prompts": PROMPTS, "options": OPTIONS, "refused": REFUSED}
    result = run_probe(PROBE, job)
    firsts = [tuple(t) for t in result["first_tokens"]]
    assert len(set(firsts)) == len(PROMPTS), "the probe cannot tell the prompts apart"
    # per proposer: the indices of the prompts it was asked about
    result["asked_prompts"] = {name: {firsts.index(tuple(t)) for t in rows}
                               for name, rows in result["asked"].items()}
    return result


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_value_is_refused_before_scheduling_naming_the_key(probe, case):
    refused = probe["refused"][case]
    assert refused is not None, f"{case}: {REFUSED[case]} was accepted"
    assert refused["type"] == "RequestRefused" and refused["value_error"], refused
    assert next(iter(REFUSED[case])) in refused["message"], refused


def test_output_is_identical_whatever_each_request_chose(probe):
    assert probe["mixed"] == probe["plain"]


def test_draft_forwards_that_fail_mid_run_cost_drafts_never_requests(probe):
    """The draft model failed every DRAFT_FORWARD_FAULT-th forward while the requests
    ran: every request finished with the output it has without speculation, and the
    failures are counted."""
    assert probe["exact"]["proposer_failures"].get("draft", 0) > 0, probe["exact"]
    assert len(probe["mixed"]) == len(PROMPTS) and all(len(t) == 48 for t in probe["mixed"])


def test_sampled_verification_reports_each_draft_tokens_acceptance_probability(probe):
    """At temperature 1 the union learns, per verified draft token, the probability the
    rejection sampler accepted it with (one per token the scheduler verified, in [0, 1],
    not all verdicts); greedy steps report none (vLLM's greedy path has no target
    distribution) and learn verdicts."""
    heard = probe["heard"]
    assert heard["sampled"] and heard["greedy"], heard
    assert all(expected is None for expected, _ in heard["greedy"])
    values = []
    for expected, scheduled in heard["sampled"]:
        assert expected is not None and len(expected) == scheduled
        values += expected
    assert all(0.0 <= v <= 1.0 + 1e-5 for v in values)
    assert any(0.01 < v < 0.99 for v in values), values  # probabilities, not verdicts


def test_only_the_step_that_read_the_prompts_is_kept_from_the_learners(probe):
    """The runner tells every observer of a step's time whether that step read new
    requests' prompts (a prefill's time, which no cost model nor the step arbiter learns
    from): in each run of two requests, the first step the union learns from (the one
    that read both prompts) and no decode step after it."""
    for mode, flags in probe["read_prompts"].items():
        assert len(flags) > 5, mode
        assert flags[0] is True and not any(flags[1:]), (mode, flags)


def test_max_k_zero_switches_speculation_off_for_that_request_only(probe):
    off, free = probe["metrics"][1], probe["metrics"][0]
    assert off is not None and free is not None, probe["metrics"]
    assert off["num_draft_tokens"] == 0, off
    assert free["num_draft_tokens"] > 0, free
    assert all(1 not in asked for asked in probe["asked_prompts"].values()), probe["asked_prompts"]


def test_max_k_bounds_every_draft_of_that_request(probe):
    capped = probe["metrics"][2]
    assert capped["num_draft_tokens"] > 0 and max(capped["per_step_drafted"]) == 2, capped
    assert max(probe["metrics"][0]["per_step_drafted"]) > 2, probe["metrics"][0]


def test_a_request_is_drafted_for_only_by_the_proposers_it_names(probe):
    asked = probe["asked_prompts"]
    assert 3 in asked["suffix"], asked  # prompt 3 names "suffix" only
    assert 3 not in asked["ngram"] and 3 not in asked["draft"], asked
    assert {0, 2} <= asked["ngram"] and {0, 2} <= asked["draft"], asked
    assert probe["metrics"][3]["num_draft_tokens"] > 0, probe["metrics"][3]


def test_attributed_counts_add_up_to_vllms_own_counters(probe):
    proposers = probe["exact"]["proposers"]
    vllm = probe["vllm_counters"]
    assert proposers and set(proposers) <= {"draft", "ngram", "suffix"}, proposers
    for ours, theirs in (("drafts", "vllm:spec_decode_num_drafts"),
                         ("draft_tokens", "vllm:spec_decode_num_draft_tokens"),
                         ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens")):
        assert sum(p[ours] for p in proposers.values()) == vllm[theirs], (ours, proposers, vllm)
    for p in proposers.values():
        assert sum(p["accepted_tokens_per_pos"]) == p["accepted_tokens"]
        assert sum(p["draft_tokens_per_pos"]) == p["draft_tokens"]
    assert probe["exact"]["k_histogram"]["0"] > 0  # the max_k=0 request, every step


def test_the_counters_are_in_vllms_metrics_with_a_proposer_label(probe):
    """``LLM.get_metrics()`` reads the registry ``/metrics`` serves: the published snapshot
    (at most one publishing period behind the exact counts)."""
    published = {}
    for name, labels, value in probe["published"]:
        if name == "vllm:specplugin_accepted_tokens":
            published[labels["proposer"]] = value
    assert published, probe["published"]
    exact = probe["exact"]["proposers"]
    assert all(0 <= published[n] <= exact[n]["accepted_tokens"] for n in published), (
        published, exact)
    assert sum(published.values()) > 0


def test_no_request_record_outlives_the_job(probe):
    """Every request's record (``specplugin.requests``) is dropped when it finishes, at the
    step after (where vLLM tells the workers; an in-process engine runs it with the next
    request): of the job's 20-odd requests only the last one's is held. The gauge is in
    vLLM's metrics. Seen red with ``Union.finish_requests`` keeping the records."""
    assert probe["exact"]["tracked_requests"] <= 1, probe["exact"]
    gauge = [value for name, _, value in probe["published"]
             if name == "vllm:specplugin_tracked_requests"]
    assert len(gauge) == 1 and gauge[0] >= 0, probe["published"]

"""What each sampled draft token was worth, read where vLLM's rejection sampler has it.

A sampled request accepts a draft token drawn from ``q`` with probability
``sum(min(p, q))`` (``p``: the target's distribution at that position), a deterministic
guess ``x`` with probability ``p(x)``
(:func:`~specplugin.scorers.rejection.expected_acceptance`). Learned from instead of the
accept/reject verdicts those probabilities decide, the estimates of acceptance average
the same quantity with far less noise (the verdict's own coin flip, variance
``a(1 - a)``, is gone): two unlucky rejections of a draft that matches the target 70% of
the time teach 0.7 twice, not 0 twice. That matters most where little has been judged:
a fresh engine's first steps, where the union decides whether the draft model is worth
running at all (measured on the validation pair, complete batch 1 temperature 1: one
fresh engine in three decoded plainly in most of its steps, one after its first ten
speculative steps, two draft runs among them, accepted nothing).

vLLM computes ``p`` inside ``rejection_sample`` and keeps nothing of it, so the
module's ``sample_recovered_tokens`` (called by name on the random path with ``p``) is
wrapped: while a runner listens (:func:`listening`, around its ``_sample``), the wrapper
computes the expectations for the step's draft tokens before vLLM's code goes on.
Outside a listener it only calls vLLM's function. Greedy rows get values too (the
kernel's inputs cover every row); the learners use them for sampled requests only.

The same wrapper draws the recovered tokens itself while the plugin's runner samples
(:func:`listening`, :func:`recovering`) on CPU, unless a request brings its own seed:
:func:`~specplugin.scorers.rejection.draw_recovered` inverts each residual's cumulative
sum where vLLM's function draws an exponential for every vocabulary entry of every
request (measured on this CPU, batch 8, vocabulary 6,144: 1.1 ms of a ~1.4 ms
``rejection_sample``, in every speculative step that has a sampled request; 2.2 ms at
batch 16). Both are exact draws from the residual: the output's distribution is the
target's either way. Seeded requests keep vLLM's draw (their seed's random stream is
vLLM's to define), as does every engine without the plugin's runner.

A batch in which every request is greedy and asks for nothing that moves the argmax
(no penalties, logit bias, minimum tokens, allowed or bad words, thinking budget) nor
for logprobs is verified by :func:`verify_greedy` instead of vLLM's rejection sampler:
the same tokens (:func:`~specplugin.scorers.rejection.greedy_verify`), without the
sampler's fixed costs: ``specplugin profile --zoo validation --workload complete
--batch-size 1 --temperature 0 --methods vllm-suffix,plugin-union --timers fine``
measured vLLM's sampling at 0.590 ms of vllm-suffix's speculative step, the union's
sampling and this shortcut at 0.153 ms of its own (``python -m
specplugin.bench.verify_bench``, warm, on this CPU: vLLM's rejection sampler 0.466 ms at
batch 1, 1.240 ms at batch 8, 8 draft tokens each, against 0.051 and 0.104 ms).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from specplugin.metrics import FailureCounter
from specplugin.proposers.draft import UniformPool
from specplugin.scorers.rejection import (draw_recovered, expected_acceptance, greedy_verify,
                                          sampled_verify)
from specplugin.vllm_layer import patches

logger = logging.getLogger("specplugin")

# The two shortcuts' failures (a bug, an unforeseen input): each costs the step the
# shortcut, never a request; counted with the proposers' (``proposer_failures``) and
# logged once in full, then periodically, not once per step.
DRAW_FAILURES = FailureCounter("recovered draw", logger, fallback="vLLM's own draw")
EXPECTATION_FAILURES = FailureCounter("expected acceptance", logger,
                                      fallback="learning from the verdicts alone")
GREEDY_FAILURES = FailureCounter("greedy verification", logger,
                                 fallback="vLLM's rejection sampler")
SAMPLED_FAILURES = FailureCounter("sampled verification", logger,
                                  fallback="vLLM's rejection sampler")


def failures() -> dict[str, int]:
    """This process's counts, those above 0 (added to each drafter's
    ``proposer_failures``: the metric names a shortcut only once it failed)."""
    return {f.name: f.count for f in (DRAW_FAILURES, EXPECTATION_FAILURES, GREEDY_FAILURES,
                                      SAMPLED_FAILURES) if f.count}


class Heard:
    """What the rejection sampler told one listener: per-token expectations and the
    rows' cumulative draft counts, as tensors (read as lists only if asked)."""

    def __init__(self):
        self.values: torch.Tensor | None = None  # [num_tokens]
        self.cu_num_draft_tokens: torch.Tensor | None = None  # [num_reqs]

    def per_row(self) -> list[list[float]] | None:
        """[num_reqs] each row's expected acceptance per draft token; None when no row
        sampled (vLLM's greedy path computes no target distribution)."""
        if self.values is None:
            return None
        values, ends = self.values.tolist(), self.cu_num_draft_tokens.tolist()
        starts = [0] + ends[:-1]
        return [values[a:b] for a, b in zip(starts, ends)]


_listener: Heard | None = None
_recovering = False
# the recovered draws' uniforms (CPU only: the shortcut runs there), see UniformPool
_recovered_uniforms = UniformPool("cpu")
_greedy_steps = 0
_sampled_steps = 0


@contextlib.contextmanager
def listening() -> Iterator[Heard]:
    """While inside, the step's rejection sampler reports to the returned :class:`Heard`
    (and the recovered tokens are drawn as in :func:`recovering`)."""
    global _listener
    heard = _listener = Heard()
    try:
        with recovering():
            yield heard
    finally:
        _listener = None


@contextlib.contextmanager
def recovering() -> Iterator[None]:
    """While inside, the plugin's runner samples: on CPU, the recovered tokens of
    requests without a seed of their own are drawn by
    :func:`~specplugin.scorers.rejection.draw_recovered` (see the module's docstring)."""
    global _recovering
    _recovering = True
    try:
        yield
    finally:
        _recovering = False


def _listened(original):
    """vLLM's ``sample_recovered_tokens`` (a plain function that the random path of
    ``rejection_sample`` calls by name, with the step's final target distribution, right
    before the random-sampling kernel) with the listener in front."""

    @functools.wraps(original)
    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                draft_token_ids, draft_probs, target_probs, *args, **kwargs):
        heard = _listener
        if heard is not None:
            try:
                heard.values = expected_acceptance(draft_token_ids, draft_probs, target_probs)
                heard.cu_num_draft_tokens = cu_num_draft_tokens
            except Exception:  # the learners fall back to the verdicts; never the request
                heard.values = heard.cu_num_draft_tokens = None
                EXPECTATION_FAILURES.record()
        if _recovering and target_probs.device.type == "cpu" and not _seeded(args, kwargs):
            try:
                uniform = _recovered_uniforms.take((draft_token_ids.shape[0], 1))
                return draw_recovered(draft_token_ids, draft_probs, target_probs,
                                      uniform).to(draft_token_ids.dtype)
            except Exception:  # vLLM's draw instead: a bug here costs speed, never a request
                DRAW_FAILURES.record()
        return original(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                        draft_probs, target_probs, *args, **kwargs)

    return sample_recovered_tokens


def verify_greedy(logits: torch.Tensor, metadata, sampling_metadata, rejection_sampler):
    """vLLM's ``SamplerOutput`` for a speculative step whose requests are all plainly
    greedy (see the module's docstring), verified on the host; None where vLLM's
    rejection sampler must run (another batch, another device, or a failure here, which
    costs the step this shortcut, never a request). ``logits``: [num_draft_tokens_total
    + num_reqs, vocab_size], ``metadata``: vLLM's ``SpecDecodeMetadata``."""
    global _greedy_steps
    if logits.device.type != "cpu":
        return None
    try:  # (vLLM's metadata read here too: a field renamed by vLLM costs the shortcut)
        if not _plainly_greedy(sampling_metadata, rejection_sampler):
            return None
        token_ids = greedy_verify(logits, metadata.draft_token_ids, metadata.num_draft_tokens)
        output = _vllm_classes()[0](sampled_token_ids=token_ids, logprobs_tensors=None)
    except Exception:
        GREEDY_FAILURES.record()
        return None
    _greedy_steps += 1
    return output


def plainly_sampled(logits: torch.Tensor, sampling_metadata, rejection_sampler) -> bool:
    """:func:`verify_sampled` can verify this speculative step: on CPU, some request
    samples, and every request samples from ``softmax(logits / temperature)`` alone (no
    top-k, top-p or min-p, no penalties, logit bias, minimum tokens, allowed or bad words,
    thinking budget), asks for no logprobs and brings no seed of its own (its random
    stream is vLLM's to define)."""
    m = sampling_metadata
    try:
        return (logits.device.type == "cpu" and not m.all_greedy
                and m.top_k is None and m.top_p is None and not m.generators
                and _leaves_distribution(m, rejection_sampler))
    except Exception:  # (a field vLLM renamed costs the shortcut, never the step)
        SAMPLED_FAILURES.record()
        return False


def verify_sampled(logits: torch.Tensor, metadata, sampling_metadata, draft_probs,
                   heard: "Heard"):
    """vLLM's ``SamplerOutput`` for a speculative step that :func:`plainly_sampled`
    admits, verified on the host by :func:`~specplugin.scorers.rejection.sampled_verify`
    (exactly the target's distribution: accepted drafts, then a recovered or bonus token);
    ``heard`` gets each draft token's expected acceptance, as :func:`listening` would.
    None on a failure here, which costs the step this shortcut, never a request.
    ``logits``: [num_draft_tokens_total + num_reqs, vocab_size]; ``metadata``: vLLM's
    ``SpecDecodeMetadata``; ``draft_probs``: [num_draft_tokens_total, vocab_size] or None
    (every draft a deterministic guess)."""
    global _sampled_steps
    try:
        num_draft_tokens = metadata.num_draft_tokens  # [num_reqs] (a list)
        num_reqs = len(num_draft_tokens)
        uniforms = _recovered_uniforms.take_host((metadata.draft_token_ids.shape[0] + num_reqs,))
        token_ids, expected = sampled_verify(
            logits, metadata.draft_token_ids, num_draft_tokens, draft_probs,
            sampling_metadata.temperature[:num_reqs].numpy(), uniforms)
        output = _vllm_classes()[0](sampled_token_ids=token_ids, logprobs_tensors=None)
    except Exception:
        SAMPLED_FAILURES.record()
        return None
    heard.values = torch.from_numpy(expected)
    heard.cu_num_draft_tokens = metadata.cu_num_draft_tokens
    _sampled_steps += 1
    return output


def sampled_steps() -> int:
    """Speculative steps this process verified with :func:`verify_sampled` (published as
    ``steps_verified_sampled``)."""
    return _sampled_steps


def greedy_steps() -> int:
    """Speculative steps this process verified with :func:`verify_greedy` (published as
    ``steps_verified_greedy``)."""
    return _greedy_steps


def _plainly_greedy(sampling_metadata, rejection_sampler) -> bool:
    """Every request greedy, and nothing that vLLM's samplers apply before the argmax
    or return beside it in use."""
    m = sampling_metadata
    if not (m.all_greedy and _nothing_applied(m, rejection_sampler)):
        return False
    return all(_leaves_argmax(p) for p in m.logitsprocs.non_argmax_invariant)


def _nothing_applied(m, rejection_sampler) -> bool:
    """No penalties, logprobs, allowed or bad words, thinking budget, nor vLLM's
    synthetic acceptance in use."""
    if not (m.no_penalties and m.max_num_logprobs is None
            and not m.logprob_token_ids and m.allowed_token_ids_mask is None
            and not m.bad_words_token_ids
            and not getattr(rejection_sampler, "synthetic_mode", True)):
        return False
    holder = m.thinking_budget_state_holder
    return holder is None or not holder.has_tracked_requests()


def _leaves_distribution(m, rejection_sampler) -> bool:
    """Nothing changes a sampled request's distribution beyond its temperature: what
    :func:`_nothing_applied` excludes, and no logits processor in use (vLLM's min-p
    among them, which leaves the argmax alone but not the distribution)."""
    if not _nothing_applied(m, rejection_sampler):
        return False
    return (all(_leaves_argmax(p) for p in m.logitsprocs.non_argmax_invariant)
            and all(_min_p_unused(p) for p in m.logitsprocs.argmax_invariant))


def _min_p_unused(processor) -> bool:
    """vLLM's min-p processor while no request uses it; any other argmax-invariant
    processor might change the distribution."""
    return isinstance(processor, _vllm_classes()[3]) and not processor.min_p_count


def _leaves_argmax(processor) -> bool:
    """vLLM's built-in processors that can move the argmax, while no request uses them
    (logit bias, minimum tokens); any other processor might."""
    _, LogitBiasLogitsProcessor, MinTokensLogitsProcessor, _ = _vllm_classes()
    if isinstance(processor, LogitBiasLogitsProcessor):
        return not processor.biases
    if isinstance(processor, MinTokensLogitsProcessor):
        return not processor.min_toks
    return False


@functools.cache
def _vllm_classes() -> tuple[type, type, type, type]:
    """vLLM's ``SamplerOutput``, the two built-in processors :func:`_leaves_argmax` knows
    and the min-p processor :func:`_min_p_unused` knows, imported once, on first use (not
    at import: this module loads with the plugin, in processes that never verify)."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    return SamplerOutput, LogitBiasLogitsProcessor, MinTokensLogitsProcessor, MinPLogitsProcessor


def _seeded(args, kwargs) -> bool:
    """Some request of the batch brings its own random generator (a seed): vLLM's
    ``sampling_metadata.generators``, the argument after ``target_probs``."""
    metadata = args[0] if args else kwargs.get("sampling_metadata")
    return metadata is None or bool(metadata.generators)


def install() -> None:
    """Wrap vLLM's ``sample_recovered_tokens`` (once per process). Not the random-sampling
    kernel's launcher beside it: vLLM's CPU platform rebinds the kernel inside that
    launcher object after plugins load, and finds it only where it left it."""
    from vllm.v1.sample import rejection_sampler

    if not hasattr(rejection_sampler, "sample_recovered_tokens"):  # (a test fails loudly)
        logger.warning("specplugin: vLLM's rejection sampler has no sample_recovered_tokens; "
                       "sampled requests' acceptance is learned from verdicts only")
        return
    if not patches.is_patched(rejection_sampler, "sample_recovered_tokens"):
        patches.replace_attribute(rejection_sampler, "sample_recovered_tokens",
                                  _listened(rejection_sampler.sample_recovered_tokens))

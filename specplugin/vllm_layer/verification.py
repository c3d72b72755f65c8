"""What each sampled draft token was worth, read where vLLM's rejection sampler has it,
and host-side shortcuts around that sampler on CPU.

- Expected acceptance: a draft drawn from ``draft_probs`` is accepted with probability
  ``sum(min(target_probs, draft_probs))``, a deterministic guess ``x`` with
  ``target_probs[x]``. Learning from these rather than verdicts removes coin-flip noise.
  vLLM keeps no ``target_probs``, so its ``sample_recovered_tokens`` is wrapped and
  records them inside :func:`listening`.
- Recovered draw: inside :func:`recovering` (CPU, unseeded) the wrapper draws recovered
  tokens by inverse CDF (``draw_recovered``); vLLM's per-vocab exponentials take ~1.1 ms
  of a ~1.4 ms ``rejection_sample`` at batch 8. Both are exact; seeded requests keep vLLM's.
- Shortcuts: all-plain-greedy (:func:`verify_greedy`) or plain temperature sampling
  (:func:`verify_sampled`) batches are verified on the host, skipping the rejection
  sampler's fixed costs (~0.5 ms -> ~0.05 ms at batch 1). Output is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from specplugin.metrics import FailureCounter
from specplugin.profiling import phase
from specplugin.proposers.draft import UniformPool
from specplugin.scorers.rejection import (draw_recovered, expected_acceptance, greedy_verify,
                                          sampled_verify)
from specplugin.vllm_layer import patches

logger = logging.getLogger("specplugin")

# A shortcut's failure costs the step the shortcut, never a request (``proposer_failures``).
DRAW_FAILURES = FailureCounter("recovered draw", logger, fallback="vLLM's own draw")
EXPECTATION_FAILURES = FailureCounter("expected acceptance", logger,
                                      fallback="learning from the verdicts alone")
GREEDY_FAILURES = FailureCounter("greedy verification", logger,
                                 fallback="vLLM's rejection sampler")
SAMPLED_FAILURES = FailureCounter("sampled verification", logger,
                                  fallback="vLLM's rejection sampler")


def failures() -> dict[str, int]:
    """This process's non-zero counts (merged into the drafter's ``proposer_failures``)."""
    return {f.name: f.count for f in (DRAW_FAILURES, EXPECTATION_FAILURES, GREEDY_FAILURES,
                                      SAMPLED_FAILURES) if f.count}


class Heard:
    """What the rejection sampler told one listener."""

    def __init__(self):
        self.values: torch.Tensor | None = None  # [num_tokens]
        self.cu_num_draft_tokens: torch.Tensor | None = None  # [num_reqs]

    def per_row(self) -> list[list[float]] | None:
        """[num_reqs][num_draft_tokens] expected acceptance; None if no row sampled."""
        if self.values is None:
            return None
        values, ends = self.values.tolist(), self.cu_num_draft_tokens.tolist()
        starts = [0] + ends[:-1]
        return [values[a:b] for a, b in zip(starts, ends)]


_listener: Heard | None = None
_recovering = False
# uniforms for the recovered draws (CPU only)
_recovered_uniforms = UniformPool("cpu")
_greedy_steps = 0
_sampled_steps = 0


@contextlib.contextmanager
def listening() -> Iterator[Heard]:
    """Inside, the rejection sampler reports to the returned :class:`Heard` (and recovers)."""
    global _listener
    heard = _listener = Heard()
    try:
        with recovering():
            yield heard
    finally:
        _listener = None


@contextlib.contextmanager
def recovering() -> Iterator[None]:
    """Inside, unseeded CPU batches get their recovered tokens from ``draw_recovered``."""
    global _recovering
    _recovering = True
    try:
        yield
    finally:
        _recovering = False


def _listened(original):
    """vLLM's ``sample_recovered_tokens`` with the listener and the recovered draw in front."""

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


@phase("plugin: verify")
def verify_greedy(logits: torch.Tensor, metadata, sampling_metadata, rejection_sampler):
    """vLLM's ``SamplerOutput`` for an all-plain-greedy CPU step, verified on the host;
    None where vLLM's rejection sampler must run (other batch/device, or a failure).
    ``logits``: [num_draft_tokens_total + num_reqs, vocab_size]."""
    global _greedy_steps
    if logits.device.type != "cpu":
        return None
    try:  # a field renamed by vLLM costs the shortcut, not the step
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
    """True if :func:`verify_sampled` can verify this step: on CPU, some request samples,
    and each samples from ``softmax(logits / temperature)`` alone (no top-k/p, min-p,
    penalties, processors, logprobs or per-request seed)."""
    m = sampling_metadata
    try:
        return (logits.device.type == "cpu" and not m.all_greedy
                and m.top_k is None and m.top_p is None and not m.generators
                and _leaves_distribution(m, rejection_sampler))
    except Exception:  # a field vLLM renamed costs the shortcut, never the step
        SAMPLED_FAILURES.record()
        return False


@phase("plugin: verify")
def verify_sampled(logits: torch.Tensor, metadata, sampling_metadata, draft_probs,
                   heard: "Heard"):
    """vLLM's ``SamplerOutput`` for a step :func:`plainly_sampled` admits, verified on the
    host by ``sampled_verify`` (exact); fills ``heard`` as :func:`listening` would. None
    on failure. ``logits``: [num_draft_tokens_total + num_reqs, vocab_size];
    ``draft_probs``: [num_draft_tokens_total, vocab_size] or None (deterministic drafts)."""
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
    """Steps verified by :func:`verify_sampled` (``steps_verified_sampled``)."""
    return _sampled_steps


def greedy_steps() -> int:
    """Steps verified by :func:`verify_greedy` (``steps_verified_greedy``)."""
    return _greedy_steps


def _plainly_greedy(sampling_metadata, rejection_sampler) -> bool:
    """All greedy, and nothing in use that moves the argmax or is returned beside it."""
    m = sampling_metadata
    if not (m.all_greedy and _nothing_applied(m, rejection_sampler)):
        return False
    return all(_leaves_argmax(p) for p in m.logitsprocs.non_argmax_invariant)


def _nothing_applied(m, rejection_sampler) -> bool:
    """No penalties, logprobs, allowed/bad words, thinking budget or synthetic acceptance."""
    if not (m.no_penalties and m.max_num_logprobs is None
            and not m.logprob_token_ids and m.allowed_token_ids_mask is None
            and not m.bad_words_token_ids
            and not getattr(rejection_sampler, "synthetic_mode", True)):
        return False
    holder = m.thinking_budget_state_holder
    return holder is None or not holder.has_tracked_requests()


def _leaves_distribution(m, rejection_sampler) -> bool:
    """Nothing but temperature changes a sampled request's distribution (incl. min-p,
    which keeps the argmax but not the distribution)."""
    if not _nothing_applied(m, rejection_sampler):
        return False
    return (all(_leaves_argmax(p) for p in m.logitsprocs.non_argmax_invariant)
            and all(_min_p_unused(p) for p in m.logitsprocs.argmax_invariant))


def _min_p_unused(processor) -> bool:
    """vLLM's min-p processor while unused; any other might change the distribution."""
    return isinstance(processor, _vllm_classes()[3]) and not processor.min_p_count


def _leaves_argmax(processor) -> bool:
    """vLLM's logit-bias / min-tokens processors while unused; any other might move the argmax."""
    _, LogitBiasLogitsProcessor, MinTokensLogitsProcessor, _ = _vllm_classes()
    if isinstance(processor, LogitBiasLogitsProcessor):
        return not processor.biases
    if isinstance(processor, MinTokensLogitsProcessor):
        return not processor.min_toks
    return False


@functools.cache
def _vllm_classes() -> tuple[type, type, type, type]:
    """vLLM classes used here, imported on first use (this module loads in processes that
    never verify)."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    return SamplerOutput, LogitBiasLogitsProcessor, MinTokensLogitsProcessor, MinPLogitsProcessor


def _seeded(args, kwargs) -> bool:
    """Some request has its own seed (``sampling_metadata`` follows ``target_probs``)."""
    metadata = args[0] if args else kwargs.get("sampling_metadata")
    return metadata is None or bool(metadata.generators)


def install() -> None:
    """Wrap vLLM's ``sample_recovered_tokens`` (once per process). Not the kernel launcher:
    vLLM's CPU platform rebinds the kernel inside it after plugins load."""
    from vllm.v1.sample import rejection_sampler

    if not hasattr(rejection_sampler, "sample_recovered_tokens"):  # (a test fails loudly)
        logger.warning("specplugin: vLLM's rejection sampler has no sample_recovered_tokens; "
                       "sampled requests' acceptance is learned from verdicts only")
        return
    if not patches.is_patched(rejection_sampler, "sample_recovered_tokens"):
        patches.replace_attribute(rejection_sampler, "sample_recovered_tokens",
                                  _listened(rejection_sampler.sample_recovered_tokens))

"""Acceptance: greedy edge cases, batched == reference, and statistical losslessness.

The statistical tests speculate in a toy world where both models are order-1 Markov
chains over a small vocabulary (``TARGET_TABLE[prev]`` is the target's next-token
distribution, row ``BOS`` the first token's). Speculative decoding must emit the first
token with law ``TARGET_TABLE[BOS]`` and the first two with law
``TARGET_TABLE[BOS, a] * TARGET_TABLE[a, b]``; when a step emits only one token, the
second comes from a second speculative step, as in real decoding. Seeds are fixed, so
every test is deterministic; negative controls show the tests can fail.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specplugin import host_kernels
from specplugin.scorers import (
    PLACEHOLDER_TOKEN_ID,
    concat_noise,
    draw_batch_noise,
    draw_noise,
    greedy_multi_draft_verify,
    multi_draft,
    reference_multi_draft_verify,
    reference_verify,
    rejection,
    verify_batch,
)
from specplugin.stats import chi_square_gof

VOCAB_SIZE = 5
BOS = VOCAB_SIZE  # extra row of the Markov tables: the first token's distribution
NUM_DRAWS = 20_000
NUM_MULTI_DRAFT_DRAWS = 5_000
P_THRESHOLD = 1e-3
NEGATIVE_CONTROL_P = 1e-6


# ---------------------------------------------------------------- constructed inputs


def peaked_probs(argmax_ids: list[int], vocab_size: int = 8) -> torch.Tensor:  # [rows, vocab_size]
    """Softmax of logits 4 at ``argmax_ids``, 0 elsewhere: a clear argmax, all probs > 0."""
    logits = torch.zeros(len(argmax_ids), vocab_size)
    logits[torch.arange(len(argmax_ids)), torch.tensor(argmax_ids, dtype=torch.long)] = 4.0
    return logits.softmax(-1)


def ragged_batch(drafts: list[list[int]], targets: list[torch.Tensor]):
    """Flat draft ids, cu_num_draft_tokens and target rows for a list of requests."""
    draft_token_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)  # [total]
    cu_num_draft_tokens = torch.tensor([len(d) for d in drafts]).cumsum(0)  # [num_reqs]
    return draft_token_ids, cu_num_draft_tokens, torch.cat(targets)


GREEDY_CASES = [  # (draft, target argmax per position, expected emitted)
    ([3, 1, 4], [3, 1, 4, 2], [3, 1, 4, 2]),  # all accepted -> bonus
    ([3, 1, 4], [5, 1, 4, 2], [5]),  # first rejected -> recovered
    ([], [6], [6]),  # empty draft -> one token from the target
    ([3, 1, 4, 1, 5], [3, 1, 6, 1, 5, 0], [3, 1, 6]),  # draft longer than the match
]


@pytest.mark.parametrize(("draft", "argmax_ids", "expected"), GREEDY_CASES)
def test_greedy_reference(draft, argmax_ids, expected):
    draft_token_ids = torch.tensor(draft, dtype=torch.long)  # [k]
    emitted = reference_verify(draft_token_ids, None, peaked_probs(argmax_ids), None, greedy=True)
    assert emitted.tolist() == expected


def test_greedy_batched_handles_all_cases_in_one_batch():
    drafts, argmaxes, expected = zip(*GREEDY_CASES)
    targets = [peaked_probs(a) for a in argmaxes]
    draft_token_ids, cu, target_probs = ragged_batch(list(drafts), targets)
    noise = draw_batch_noise(cu, 8, torch.Generator().manual_seed(0))
    is_greedy = torch.ones(len(drafts), dtype=torch.bool)  # [num_reqs]
    out = verify_batch(draft_token_ids, cu, None, target_probs, is_greedy, noise)
    assert out.output_token_ids.shape == (4, 6)
    assert out.num_emitted.tolist() == [len(e) for e in expected]
    for row, emitted in zip(out.output_token_ids.tolist(), expected):
        assert row == emitted + [PLACEHOLDER_TOKEN_ID] * (6 - len(emitted))


@pytest.mark.parametrize(("draft", "argmax_ids", "expected"), GREEDY_CASES)
def test_greedy_multi_draft_single_candidate_is_plain_greedy(draft, argmax_ids, expected):
    draft_token_ids = torch.tensor(draft, dtype=torch.long)  # [k]
    result = greedy_multi_draft_verify([draft_token_ids], [peaked_probs(argmax_ids)])
    assert result.token_ids.tolist() == expected and result.winner == 0


def test_greedy_multi_draft_longest_match_wins_ties_lowest_index():
    target_after = {(): 3, (3,): 1, (3, 1): 4, (3, 1, 4): 2, (5,): 0, (3, 0): 7}

    def target(draft):  # target rows along this candidate's own prefixes
        return peaked_probs([target_after.get(tuple(draft[:i]), 0) for i in range(len(draft) + 1)])

    def verify(candidates):
        return greedy_multi_draft_verify(
            [torch.tensor(c) for c in candidates], [target(c) for c in candidates]
        )

    candidates = [[5, 0], [3, 0], [3, 1, 9], [3, 1, 4], [3, 1, 4]]
    result = verify(candidates)  # candidates 3 and 4 tie with all 3 accepted
    assert result.token_ids.tolist() == [3, 1, 4, 2] and result.winner == 3
    result = verify(candidates[:3])  # candidate 2 matches 2 tokens, then 9 != 4
    assert result.token_ids.tolist() == [3, 1, 4] and result.winner == 2
    result = verify([[5, 0], [4]])  # nothing accepted
    assert result.token_ids.tolist() == [3] and result.winner == 0


def test_multi_draft_needs_a_candidate():
    with pytest.raises(ValueError, match="at least one candidate"):
        greedy_multi_draft_verify([], [])


# ---------------------------------------------------------------- exact sampling facts


@pytest.mark.parametrize("seed", range(5))
def test_draft_equal_to_target_is_always_accepted(seed):
    generator = torch.Generator().manual_seed(seed)
    target_probs = torch.randn(4, 6, generator=generator).softmax(-1)  # [k + 1, vocab_size]
    draft_token_ids = torch.multinomial(target_probs[:3], 1, generator=generator).squeeze(1)
    emitted = reference_verify(draft_token_ids, target_probs[:3], target_probs, generator)
    assert emitted[:3].tolist() == draft_token_ids.tolist() and len(emitted) == 4


@pytest.mark.parametrize("seed", range(5))
def test_impossible_draft_is_rejected_and_recovered_elsewhere(seed):
    generator = torch.Generator().manual_seed(seed)
    target_probs = torch.randn(3, 6, generator=generator).softmax(-1)
    target_probs[1, 2] = 0.0  # the target never emits token 2 at position 1
    target_probs[1] /= target_probs[1].sum()
    for draft_probs in (None, torch.randn(2, 6, generator=generator).softmax(-1)):
        emitted = reference_verify(torch.tensor([0, 2]), draft_probs, target_probs, generator)
        assert len(emitted) <= 2 and (len(emitted) < 2 or emitted[1] != 2)


def test_multi_draft_tries_the_next_candidate_after_a_rejection():
    target_probs = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])  # [k + 1, vocab]: 1 surely
    for seed in range(5):
        result = reference_multi_draft_verify(
            [torch.tensor([0]), torch.tensor([2]), torch.tensor([1])],
            None,
            [target_probs, target_probs, target_probs],
            torch.Generator().manual_seed(seed),
        )
        assert result.token_ids[0] == 1 and result.winner == 2 and len(result.token_ids) == 2


def test_batch_of_empty_drafts_emits_one_token_per_row():
    target_probs = peaked_probs([2, 5, 1])  # [num_reqs, vocab_size]: k = 0 for all
    cu = torch.zeros(3, dtype=torch.long)
    noise = draw_batch_noise(cu, 8, torch.Generator().manual_seed(0))
    no_drafts = torch.empty(0, dtype=torch.long)
    out = verify_batch(no_drafts, cu, None, target_probs, torch.ones(3, dtype=torch.bool), noise)
    assert out.output_token_ids.tolist() == [[2], [5], [1]]
    assert out.num_emitted.tolist() == [1, 1, 1]
    is_greedy = torch.zeros(3, dtype=torch.bool)
    sampled = verify_batch(no_drafts, cu, None, target_probs, is_greedy, noise)
    assert sampled.output_token_ids.shape == (3, 1) and sampled.num_accepted.tolist() == [0, 0, 0]


def test_batch_rejects_inconsistent_shapes():
    draft_token_ids, cu, target_probs = ragged_batch(
        [[1, 2], [3]], [peaked_probs([0, 0, 0]), peaked_probs([0, 0])]
    )
    noise, is_greedy = draw_batch_noise(cu, 8), torch.zeros(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="target_probs"):
        verify_batch(draft_token_ids, cu, None, target_probs[:-1], is_greedy, noise)
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        verify_batch(draft_token_ids[:-1], cu, None, target_probs, is_greedy, noise)


# ---------------------------------------------------------------- batched == reference


def random_probs(generator: torch.Generator, num_rows: int, vocab_size: int) -> torch.Tensor:
    """Peaky random distributions with some exact zeros (the edge that breaks naive ratios)."""
    logits = 3 * torch.randn(num_rows, vocab_size, generator=generator)  # [num_rows, vocab_size]
    zero = torch.rand(num_rows, vocab_size, generator=generator) < 0.25
    zero[torch.arange(num_rows), logits.argmax(-1)] = False  # keep at least one nonzero
    return logits.masked_fill(zero, float("-inf")).softmax(-1)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    num_draft_tokens=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    vocab_size=st.integers(2, 7),
    one_hot_drafts=st.booleans(),
    greedy_bits=st.integers(0, 2**6 - 1),
    seed=st.integers(0, 2**31 - 1),
)
def test_batched_equals_reference(num_draft_tokens, vocab_size, one_hot_drafts, greedy_bits, seed):
    generator = torch.Generator().manual_seed(seed)
    num_reqs, total = len(num_draft_tokens), sum(num_draft_tokens)
    is_greedy = torch.tensor([bool(greedy_bits >> i & 1) for i in range(num_reqs)])  # [num_reqs]
    target_probs = random_probs(generator, total + num_reqs, vocab_size)  # [total + num_reqs, V]
    draft_probs = None  # one-hot drafts
    if not one_hot_drafts:
        draft_probs = random_probs(generator, total, vocab_size)  # [total, V]
    proposal = target_probs if draft_probs is None else draft_probs  # half the drafts: its argmax
    draft_token_ids = torch.where(
        torch.rand(total, generator=generator) < 0.5,
        torch.randint(vocab_size, (total,), generator=generator),
        proposal[: total].argmax(-1),
    )  # [total]
    cu = torch.tensor(num_draft_tokens).cumsum(0)  # [num_reqs]
    request_seeds = [seed + i for i in range(num_reqs)]
    noise = concat_noise([
        draw_noise(k, vocab_size, torch.Generator().manual_seed(s))
        for k, s in zip(num_draft_tokens, request_seeds)
    ])
    out = verify_batch(draft_token_ids, cu, draft_probs, target_probs, is_greedy, noise)
    for i, k in enumerate(num_draft_tokens):
        start = int(cu[i]) - k
        expected = reference_verify(
            draft_token_ids[start : start + k],
            None if draft_probs is None else draft_probs[start : start + k],
            target_probs[start + i : start + i + k + 1],
            torch.Generator().manual_seed(request_seeds[i]),
            greedy=bool(is_greedy[i]),
        )
        num_emitted = int(out.num_emitted[i])
        assert out.output_token_ids[i, :num_emitted].tolist() == expected.tolist()
        assert (out.output_token_ids[i, num_emitted:] == PLACEHOLDER_TOKEN_ID).all()


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    num_draft_tokens=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    vocab_size=st.integers(2, 9),
    tied=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_verify_emits_what_the_reference_does(num_draft_tokens, vocab_size, tied,
                                                     bfloat16, seed):
    """The all-greedy shortcut (the plugin's runner uses it instead of vLLM's rejection
    sampler) emits, per request, exactly the greedy reference's tokens: drafts while they
    are the argmax, then the argmax; ties (integer logits) broken at the lowest index;
    bfloat16 logits (a model's dtype; numpy has none) as well."""
    generator = torch.Generator().manual_seed(seed)
    num_reqs, total = len(num_draft_tokens), sum(num_draft_tokens)
    logits = (torch.randint(0, 3, (total + num_reqs, vocab_size), generator=generator).float()
              if tied else torch.randn(total + num_reqs, vocab_size, generator=generator))
    if bfloat16:
        logits = logits.to(torch.bfloat16)
    rows = torch.tensor([r for i, k in enumerate(num_draft_tokens)  # each draft's logits row
                         for r in range(sum(num_draft_tokens[:i]) + i,
                                        sum(num_draft_tokens[:i]) + i + k)], dtype=torch.long)
    draft_token_ids = torch.where(  # [total] half of them the argmax there
        torch.rand(total, generator=generator) < 0.5,
        torch.randint(vocab_size, (total,), generator=generator),
        logits[rows].argmax(-1) if total else torch.zeros(0, dtype=torch.long),
    ).to(torch.int32)
    out = rejection.greedy_verify(logits, draft_token_ids, num_draft_tokens)
    assert out.dtype == torch.int32 and out.shape == (num_reqs, max(num_draft_tokens) + 1)
    first_row = first_draft = 0
    for i, k in enumerate(num_draft_tokens):
        expected = reference_verify(draft_token_ids[first_draft:first_draft + k], None,
                                    logits[first_row:first_row + k + 1].float().softmax(-1),
                                    None, greedy=True).tolist()
        assert out[i, :len(expected)].tolist() == expected
        assert (out[i, len(expected):] == PLACEHOLDER_TOKEN_ID).all()
        first_row, first_draft = first_row + k + 1, first_draft + k


# ---------------------------------------------------------------- statistical losslessness


def markov_table(seed: int, sharpness: float, num_zeros: int = 0) -> torch.Tensor:
    """Next-token distributions of a toy model, ``[VOCAB_SIZE + 1, VOCAB_SIZE]``: one row per
    previous token, plus BOS."""
    generator = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(VOCAB_SIZE + 1, VOCAB_SIZE, generator=generator)
    for z in range(num_zeros):  # a token the model never emits after each prev
        rows = torch.arange(VOCAB_SIZE + 1)
        logits[rows, (rows + z) % VOCAB_SIZE] = float("-inf")
    return logits.softmax(-1)


TARGET_TABLE = markov_table(seed=1, sharpness=1.0, num_zeros=1)
DRAFT_TABLE = markov_table(seed=2, sharpness=1.5)
# deterministic drafters: a fixed next token per previous token (n-gram-like, often wrong)
ONE_HOT_DRAFTERS = [
    torch.tensor([1, 2, 3, 4, 0, 1]),
    torch.tensor([1, 3, 0, 2, 2, 3]),
    torch.tensor([4, 4, 1, 0, 3, 1]),  # shares its first token with the first drafter
]


def expected_joint() -> torch.Tensor:  # [VOCAB_SIZE * VOCAB_SIZE]
    return (TARGET_TABLE[BOS][:, None] * TARGET_TABLE[:VOCAB_SIZE]).flatten()


def draft_chain(prev_ids: torch.Tensor, num_steps: int, drafter, generator):
    """Draft ``num_steps`` tokens after each prev: sampled from DRAFT_TABLE (drafter None)
    or deterministic from a one-hot drafter table. Returns ids [N, num_steps] and
    draft probs [N, num_steps, VOCAB_SIZE] (None for deterministic drafts)."""
    ids, probs = [], []
    for _ in range(num_steps):
        if drafter is None:
            probs.append(DRAFT_TABLE[prev_ids])  # [N, VOCAB_SIZE]
            prev_ids = torch.multinomial(probs[-1], 1, generator=generator).squeeze(1)
        else:
            prev_ids = drafter[prev_ids]
        ids.append(prev_ids)
    stacked_probs = torch.stack(probs, dim=1) if probs else None
    return torch.stack(ids, dim=1), stacked_probs


def speculative_step(prev_ids: torch.Tensor, drafter, generator, uniforms_override=None):
    """One batched verification step for N independent requests whose last token is prev_ids.

    Draft lengths are ragged (0..3); returns the VerifyOutput."""
    num_reqs, max_k = prev_ids.shape[0], 3
    num_draft_tokens = torch.randint(0, max_k + 1, (num_reqs,), generator=generator)  # [N]
    chain_ids, chain_probs = draft_chain(prev_ids, max_k, drafter, generator)  # [N, max_k](, V)
    in_draft = torch.arange(max_k)[None, :] < num_draft_tokens[:, None]  # [N, max_k]
    contexts = torch.cat([prev_ids[:, None], chain_ids], dim=1)  # [N, max_k + 1]: prev per row
    in_target = torch.arange(max_k + 1)[None, :] <= num_draft_tokens[:, None]  # [N, max_k + 1]
    cu = num_draft_tokens.cumsum(0)  # [N]
    noise = draw_batch_noise(cu, VOCAB_SIZE, generator)
    if uniforms_override is not None:
        uniforms = torch.full_like(noise.uniforms, uniforms_override)  # [total]
        noise = rejection.VerifyNoise(uniforms, noise.exponentials)
    return verify_batch(
        chain_ids[in_draft],
        cu,
        None if chain_probs is None else chain_probs[in_draft],
        TARGET_TABLE[contexts[in_target]],
        torch.zeros(num_reqs, dtype=torch.bool),
        noise,
    )


def first_two_tokens(step, num_draws: int, generator) -> torch.Tensor:  # [num_draws, 2]
    """Run ``step(prev_ids) -> (tokens [N, >=1] padded, num_emitted [N])`` from BOS, and
    again from the first token where the first step emitted only one."""
    tokens, num_emitted = step(torch.full((num_draws,), BOS), generator)  # [num_draws, width]
    second = tokens[:, 1].clone()  # [num_draws]
    needs_another_step = num_emitted < 2
    again, _ = step(tokens[needs_another_step, 0], generator)
    second[needs_another_step] = again[:, 0]
    return torch.stack([tokens[:, 0], second], dim=1)


def target_p_values(pairs: torch.Tensor) -> tuple[float, float]:  # pairs [num_draws, 2]
    """Chi-square p-values of the first token and of the first two tokens jointly."""
    first_counts = torch.bincount(pairs[:, 0], minlength=VOCAB_SIZE)  # [VOCAB_SIZE]
    joint_counts = torch.bincount(pairs[:, 0] * VOCAB_SIZE + pairs[:, 1], minlength=VOCAB_SIZE**2)
    first = chi_square_gof(first_counts, TARGET_TABLE[BOS])
    joint = chi_square_gof(joint_counts, expected_joint())
    return first.p_value, joint.p_value


def batched_step(drafter, uniforms_override=None):
    def step(prev_ids, generator):
        out = speculative_step(prev_ids, drafter, generator, uniforms_override)
        return out.output_token_ids, out.num_emitted

    return step


@pytest.mark.parametrize(
    "drafter", [None, ONE_HOT_DRAFTERS[0]], ids=["sampled-draft", "one-hot-draft"]
)
def test_single_draft_sampling_follows_target(drafter):
    pairs = first_two_tokens(batched_step(drafter), NUM_DRAWS, torch.Generator().manual_seed(11))
    first_p, joint_p = target_p_values(pairs)
    assert first_p > P_THRESHOLD and joint_p > P_THRESHOLD, (first_p, joint_p)


def test_negative_control_always_accept_is_detected():
    """Uniforms of 0 accept every draft the target does not forbid: the draft's law leaks."""
    always_accept = batched_step(None, uniforms_override=0.0)
    pairs = first_two_tokens(always_accept, NUM_DRAWS, torch.Generator().manual_seed(11))
    first_p, _ = target_p_values(pairs)
    assert first_p < NEGATIVE_CONTROL_P, first_p


def test_negative_control_recovered_from_target_is_detected(monkeypatch):
    """A classic bug: drawing the recovered token from the target instead of the residual."""
    monkeypatch.setattr(rejection, "_residual_probs", lambda final_target, *_: final_target)
    pairs = first_two_tokens(batched_step(None), NUM_DRAWS, torch.Generator().manual_seed(11))
    first_p, _ = target_p_values(pairs)
    assert first_p < NEGATIVE_CONTROL_P, first_p


def host_sampled_step(drafter, temperature: float = 1.0):
    """``speculative_step``'s batch through :func:`rejection.sampled_verify` (the plugin's
    host-side verification of sampled batches): logits are ``temperature * log(p)``, so
    that the target's distribution at that temperature is the table's ``p``."""

    def step(prev_ids, generator):
        num_reqs, max_k = prev_ids.shape[0], 3
        num_draft_tokens = torch.randint(0, max_k + 1, (num_reqs,), generator=generator)
        chain_ids, chain_probs = draft_chain(prev_ids, max_k, drafter, generator)
        in_draft = torch.arange(max_k)[None, :] < num_draft_tokens[:, None]  # [N, max_k]
        contexts = torch.cat([prev_ids[:, None], chain_ids], dim=1)  # [N, max_k + 1]
        in_target = torch.arange(max_k + 1)[None, :] <= num_draft_tokens[:, None]
        logits = temperature * TARGET_TABLE[contexts[in_target]].log()  # -inf where p = 0
        total = int(num_draft_tokens.sum())
        uniforms = 1.0 - torch.rand(total + num_reqs, dtype=torch.float64, generator=generator)
        tokens, _ = rejection.sampled_verify(
            logits, chain_ids[in_draft], num_draft_tokens.tolist(),
            None if chain_probs is None else chain_probs[in_draft],
            np.full(num_reqs, temperature), uniforms.numpy())
        return tokens.long(), (tokens != PLACEHOLDER_TOKEN_ID).sum(dim=1)

    return step


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    "drafter", [None, ONE_HOT_DRAFTERS[0]], ids=["sampled-draft", "one-hot-draft"]
)
def test_host_sampled_verification_follows_target(drafter, temperature):
    """The plugin's host-side verification of sampled batches (its runner's shortcut past
    vLLM's rejection sampler) emits the target's distribution, the first token and the
    first two jointly, at temperature 1 and below."""
    pairs = first_two_tokens(host_sampled_step(drafter, temperature), NUM_DRAWS,
                             torch.Generator().manual_seed(13))
    first_p, joint_p = target_p_values(pairs)
    assert first_p > P_THRESHOLD and joint_p > P_THRESHOLD, (first_p, joint_p)


@pytest.mark.parametrize("bug", ["recovered from the target", "always accept"])
def test_negative_control_host_sampled_verification_bugs_are_detected(monkeypatch, bug):
    """Two classic bugs in the host-side path are caught: the recovered token drawn from
    the target instead of the residual, and acceptance tests that (almost) always pass."""
    if bug == "recovered from the target":
        original = host_kernels.verify_rows

        def no_residual(logits, target_probs, counts, greedy, drafts, q, has_q, uniforms,
                        output, *rest):  # every request samples here
            original(logits, target_probs, counts, greedy, drafts, q, has_q, uniforms,
                     output, *rest)
            first_row = 0  # each request's final token drawn again, from p alone
            for r, k in enumerate(counts.tolist()):
                final = int((output[r] != PLACEHOLDER_TOKEN_ID).sum()) - 1
                output[r, final] = host_kernels.cdf_draw(
                    target_probs[first_row + final], uniforms[drafts.size + r])
                first_row += k + 1

        monkeypatch.setattr(host_kernels, "verify_rows", no_residual)
        stepper = host_sampled_step(None)
    else:
        original = rejection.sampled_verify
        monkeypatch.setattr(rejection, "sampled_verify",
                            lambda logits, ids, counts, probs, t, u: original(
                                logits, ids, counts, probs, t, np.zeros_like(u) + 1e-12))
        stepper = host_sampled_step(None)
    pairs = first_two_tokens(stepper, NUM_DRAWS, torch.Generator().manual_seed(13))
    first_p, _ = target_p_values(pairs)
    assert first_p < NEGATIVE_CONTROL_P, first_p


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    num_draft_tokens=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    greedy_bits=st.lists(st.booleans(), min_size=6, max_size=6),
    one_hot=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_host_sampled_verification_greedy_rows_and_expectations(num_draft_tokens, greedy_bits,
                                                                 one_hot, seed):
    """In a batch mixing greedy and sampled requests, the greedy ones emit exactly what
    :func:`greedy_verify` emits; every request emits its accepted drafts, then one token,
    then placeholders; the expected acceptance of each sampled request's draft token is
    :func:`expected_acceptance`'s at the same temperature, and a greedy request's is its
    verdict (1 for an accepted token, else 0: nothing learns from a greedy draft's
    expectation, so its rows' softmax is skipped)."""
    generator = torch.Generator().manual_seed(seed)
    num_reqs, total, vocab_size = len(num_draft_tokens), sum(num_draft_tokens), 7
    logits = torch.randn(total + num_reqs, vocab_size, generator=generator)
    temperature = np.where(greedy_bits[:num_reqs], 0.0, 0.8)
    draft_probs = None if one_hot else torch.rand(total, vocab_size, generator=generator)
    if draft_probs is not None:
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    draft_ids = torch.randint(vocab_size, (total,), generator=generator)
    uniforms = 1.0 - torch.rand(total + num_reqs, dtype=torch.float64, generator=generator)
    out, expected = rejection.sampled_verify(logits, draft_ids, num_draft_tokens, draft_probs,
                                             temperature, uniforms.numpy())
    assert out.dtype == torch.int32 and out.shape == (num_reqs, max(num_draft_tokens) + 1)
    greedy = rejection.greedy_verify(logits, draft_ids, num_draft_tokens)
    row_t = torch.from_numpy(np.repeat(np.where(temperature == 0, 1.0, temperature),
                                       np.asarray(num_draft_tokens) + 1)).float()
    target_probs = (logits / row_t[:, None]).softmax(-1)
    rows = [row for i, k in enumerate(num_draft_tokens)
            for row in range(sum(num_draft_tokens[:i]) + i, sum(num_draft_tokens[:i]) + i + k)]
    want = rejection.expected_acceptance(draft_ids, draft_probs, target_probs[rows]).numpy()
    first = 0
    for i, k in enumerate(num_draft_tokens):
        emitted = int((out[i] != PLACEHOLDER_TOKEN_ID).sum())
        assert 1 <= emitted <= k + 1 and (out[i, :emitted] >= 0).all()
        assert out[i, :emitted - 1].tolist() == draft_ids[first:first + emitted - 1].tolist()
        if temperature[i] == 0:
            assert out[i].tolist() == greedy[i].tolist()
            verdicts = [1.0] * (emitted - 1) + [0.0] * (k - emitted + 1)
            assert expected[first:first + k].tolist() == verdicts
        else:
            assert np.allclose(expected[first:first + k], want[first:first + k], atol=1e-5)
        first += k


def test_host_sampled_verification_draws_from_p_where_the_residual_has_no_mass():
    """A draft whose distribution equals the target's is rejected only by a uniform of
    exactly 1, and then its residual ``max(0, p - q)`` has no mass: the recovered token is
    drawn from ``p`` instead, never a token ``p`` rules out (token 0 here, which an empty
    residual's cumulative sum would give)."""
    generator = torch.Generator().manual_seed(3)
    num_draft_tokens, vocab_size = [2, 1, 3], 9
    total, num_reqs = sum(num_draft_tokens), len(num_draft_tokens)
    logits = torch.randn(total + num_reqs, vocab_size, generator=generator)
    logits[:, 0] = float("-inf")  # token 0: probability 0 everywhere
    rows = [row for i, k in enumerate(num_draft_tokens)
            for row in range(sum(num_draft_tokens[:i]) + i, sum(num_draft_tokens[:i]) + i + k)]
    draft_probs = logits[rows].softmax(-1)  # q == p at temperature 1
    draft_ids = torch.randint(1, vocab_size, (total,), generator=generator)
    uniforms = np.concatenate([np.ones(total), [0.3, 0.6, 0.9]])  # u = 1: every draft rejected
    out, _ = rejection.sampled_verify(logits, draft_ids, num_draft_tokens, draft_probs,
                                      np.ones(num_reqs), uniforms)
    assert (out[:, 0] != 0).all() and (out[:, 1:] == PLACEHOLDER_TOKEN_ID).all(), out
    firsts = [0, 3, 5]  # each request's first row: where its first draft was rejected
    for r, row in enumerate(firsts):
        want = rejection.inverse_cdf_draw(logits[row].softmax(-1)[None],
                                          torch.tensor([[uniforms[total + r]]]))
        assert int(out[r, 0]) == int(want[0])


CANDIDATE_LENGTHS = (2, 1, 2)  # candidates 0 and 2 may share a prefix, then branch


def multi_draft_step(drafters, verify=None):
    """A step of multi-draft verification; ``drafters[c]`` None means sampled from DRAFT_TABLE.
    ``verify(ids, probs, targets, generator)``: one request's verification (default the
    reference)."""
    verify = verify or reference_multi_draft_verify

    def step(prev_ids, generator):
        num_reqs = prev_ids.shape[0]
        chains = [  # num_candidates x ([N, k_c], [N, k_c, V] or None)
            draft_chain(prev_ids, k, d, generator) for k, d in zip(CANDIDATE_LENGTHS, drafters)
        ]
        tokens = torch.full((num_reqs, max(CANDIDATE_LENGTHS) + 1), PLACEHOLDER_TOKEN_ID)
        num_emitted = torch.zeros(num_reqs, dtype=torch.long)
        targets = [  # num_candidates x [N, k_c + 1, V]
            TARGET_TABLE[torch.cat([prev_ids[:, None], ids], dim=1)] for ids, _ in chains
        ]
        for r in range(num_reqs):
            result = verify(
                [ids[r] for ids, _ in chains],
                [None if probs is None else probs[r] for _, probs in chains],
                [target[r] for target in targets],
                generator,
            )
            tokens[r, : len(result.token_ids)] = result.token_ids
            num_emitted[r] = len(result.token_ids)
        return tokens, num_emitted

    return step


MULTI_DRAFT_CASES = {
    "iid-sampled-x3": [None, None, None],
    "one-hot-x3": ONE_HOT_DRAFTERS,
    "mixed-sampled-and-one-hot": [None, ONE_HOT_DRAFTERS[1], None],
    "iid-sampled-x2": [None, None],
}


@pytest.mark.parametrize("drafters", MULTI_DRAFT_CASES.values(), ids=MULTI_DRAFT_CASES.keys())
def test_multi_draft_sampling_follows_target(drafters):
    generator = torch.Generator().manual_seed(5)
    pairs = first_two_tokens(multi_draft_step(drafters), NUM_MULTI_DRAFT_DRAWS, generator)
    first_p, joint_p = target_p_values(pairs)
    assert first_p > P_THRESHOLD and joint_p > P_THRESHOLD, (first_p, joint_p)


def test_negative_control_multi_draft_without_residual_update_is_detected(monkeypatch):
    """The bug of testing every candidate against the unchanged target is caught."""
    monkeypatch.setattr(multi_draft, "_residual_after_rejection", lambda residual, _: residual)
    generator = torch.Generator().manual_seed(5)
    pairs = first_two_tokens(multi_draft_step([None, None, None]), NUM_MULTI_DRAFT_DRAWS, generator)
    first_p, _ = target_p_values(pairs)
    assert first_p < NEGATIVE_CONTROL_P, first_p


def test_sampling_is_seeded():
    outputs = [
        first_two_tokens(batched_step(None), 200, torch.Generator().manual_seed(3)),
        first_two_tokens(batched_step(None), 200, torch.Generator().manual_seed(3)),
        first_two_tokens(multi_draft_step([None, None]), 50, torch.Generator().manual_seed(3)),
        first_two_tokens(multi_draft_step([None, None]), 50, torch.Generator().manual_seed(3)),
    ]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[2], outputs[3])


def one_hot_serving_step(drafters):
    """``multi_draft_step`` through the serving path for deterministic candidates."""
    return multi_draft_step(drafters, lambda ids, _, targets, generator:
                            multi_draft.one_hot_multi_draft_verify(ids, targets, generator))


def test_one_hot_serving_path_follows_target():
    """The scorer's sampling path: one-hot candidates that share prefixes and repeat tokens."""
    generator = torch.Generator().manual_seed(9)
    pairs = first_two_tokens(one_hot_serving_step(ONE_HOT_DRAFTERS), NUM_MULTI_DRAFT_DRAWS, generator)
    first_p, joint_p = target_p_values(pairs)
    assert first_p > P_THRESHOLD and joint_p > P_THRESHOLD, (first_p, joint_p)


def test_negative_control_one_hot_serving_path_keeping_rejected_tokens(monkeypatch):
    """Drawing the recovered token with the rejected candidates' tokens still in is caught."""
    monkeypatch.setattr(multi_draft, "_without", lambda residual, tokens: residual)
    generator = torch.Generator().manual_seed(9)
    pairs = first_two_tokens(one_hot_serving_step(ONE_HOT_DRAFTERS), NUM_MULTI_DRAFT_DRAWS, generator)
    first_p, _ = target_p_values(pairs)
    assert first_p < NEGATIVE_CONTROL_P, first_p


def test_one_hot_serving_path_winner_holds_the_emitted_prefix():
    target = torch.eye(5)[[1, 2, 3, 4]].double()  # deterministic target: 1, 2, 3, 4
    ids = [torch.tensor([1, 0, 0]), torch.tensor([1, 2, 3]), torch.tensor([0])]
    probs = [target, target, target[:2]]
    result = multi_draft.one_hot_multi_draft_verify(ids, probs, torch.Generator().manual_seed(0))
    assert result.token_ids.tolist() == [1, 2, 3, 4] and result.winner == 1


# ---------------------------------------------------------------- expected acceptance


def test_expected_acceptance_is_the_acceptance_rate_of_a_drawn_draft_token():
    """sum(min(p, q)) is how often rejection sampling keeps a token drawn from q (and p[x]
    how often it keeps a fixed guess x): checked against the reference verifier's
    verdicts, 20,000 draws each, and on the cases the formula must get exactly."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    generator = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(NUM_DRAWS):
        token = torch.multinomial(q, 1, generator=generator)
        emitted = reference_verify(token, q[None], torch.stack([p, p]), generator)
        accepted += int(emitted.shape[0] == 2)
    expected = rejection.expected_acceptance(torch.tensor([0]), q[None], p[None])
    assert expected.tolist() == pytest.approx([0.1 + 0.2 + 0.1 + 0.1 + 0.0])
    # binomial standard error at 20,000 draws and a ~0.5 rate: 0.0035
    assert abs(accepted / NUM_DRAWS - expected.item()) < 0.015
    fixed = rejection.expected_acceptance(torch.tensor([1, 3]), None, torch.stack([p, p]))
    assert fixed.tolist() == pytest.approx([0.2, 0.1])
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 3]), VOCAB_SIZE).float()
    assert rejection.expected_acceptance(torch.tensor([1, 3]), one_hot,
                                         torch.stack([p, p])).tolist() == pytest.approx([0.2, 0.1])
    assert rejection.expected_acceptance(torch.tensor([0]), p[None], p[None]).item() == pytest.approx(1.0)

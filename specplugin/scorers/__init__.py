"""Acceptance: which draft tokens the target keeps, and what it emits after them. No vLLM here.

- ``rejection``: one draft per request. :func:`reference_verify` is the readable oracle
  for one request; :func:`verify_batch` does a ragged batch in one vectorised pass and
  returns the same tokens given the same :class:`VerifyNoise`.
- ``multi_draft``: several candidate drafts per request (for the batch-expanding
  scorer): longest match under greedy, recursive rejection sampling otherwise.

Dimension names in shape comments: num_reqs (requests in the batch), k (draft length
of one request), num_draft_tokens_total (sum of k over the batch), num_candidates,
vocab_size.
"""

from specplugin.scorers.multi_draft import (
    MultiDraftOutput,
    greedy_multi_draft_verify,
    reference_multi_draft_verify,
)
from specplugin.scorers.rejection import (
    PLACEHOLDER_TOKEN_ID,
    VerifyNoise,
    VerifyOutput,
    concat_noise,
    draw_batch_noise,
    draw_noise,
    reference_verify,
    verify_batch,
)

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "MultiDraftOutput",
    "VerifyNoise",
    "VerifyOutput",
    "concat_noise",
    "draw_batch_noise",
    "draw_noise",
    "greedy_multi_draft_verify",
    "reference_multi_draft_verify",
    "reference_verify",
    "verify_batch",
]

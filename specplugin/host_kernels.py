"""Compiled loops for the host's share of a speculative step (numba, which vLLM requires).

Why compiled: on CPU the plugin's per-step work runs right after the target's or the
draft's forward, whose kernels have swept the caches, and there every torch or numpy call
costs microseconds of cold dispatch code before it touches its data. Verifying a step or
drawing a draft token took a dozen or two such calls; each function here is one call that
walks its rows in a loop. In an engine (``specplugin profile --zoo validation --workload
complete --batch-size 1 --temperature 1 --methods none,plugin-draft-vllm-k --timers fine
--set step_arbiter=false``) verification went from 0.211 to 0.115-0.136 ms a step, the
draft's draws from 0.130 to 0.080-0.099 ms (1.93 a step) and the draft's inputs and
metadata from 0.225-0.236 to 0.155-0.165 ms (the first pass's and the decode passes'
positions, token ids and slots). The draft's softmax joined its draw later
(:func:`softmax_draw_rows`): a scalar ``exp`` loop here is several times slower than
torch's vectorised one, so its exponential is a polynomial that LLVM vectorises.

What it does not buy: the first call after a forward pays for the caches the forward swept,
whichever call it is, so removing one small call moves much of its cost to the next.

The arithmetic is the torch and numpy code's it replaced, operation for operation where it
decides a token: float64 running sums of float32 probabilities, the first token whose sum
reaches ``u * total`` (a token of no mass never wins), ``u * q(x) < p(x)`` as float64
products. Given the same probabilities and uniforms, the same tokens come out: the
verification against the numpy code it replaced on 3,000 random batches (1-9 requests,
greedy, temperature 1 and 0.7, one-hot and sampled drafts, vocabularies of 7, 50 and
6,144), before that code was removed; the draw against :func:`inverse_cdf_draw
<specplugin.proposers.draft.inverse_cdf_draw>` in ``tests/test_draft_core.py``; the
verification's output distribution in ``tests/test_rejection.py``.

Every kernel is compiled for one signature when this module is imported (cached on disk by
numba after the first time), so that no compile ever lands inside a timed step.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite.binding import ffi

JIT = {"cache": True, "nogil": True}


def _answer_dict_lookups() -> None:
    """Make numba's compiler library (``llvmlite.binding.ffi.lib``) answer ``vars()``.

    vLLM's CPU platform, as each worker starts, swaps its Triton kernels for C++ ones by
    scanning every loaded module's attributes and calling ``vars(value).get(...)`` on any
    that has a ``__dict__`` (``vllm/triton_utils/dispatcher.py``). ``ffi.lib`` has none
    of its own, and its ``__getattr__`` wraps whatever name it is asked for, so its
    ``__dict__`` is a wrapped function without ``.get``: the scan raises and the worker
    dies, in every process that imported numba before starting an engine (the test
    suite's in-process engines; any user who imports this module first). An empty entry
    in its function table is what its ``__getattr__`` returns for that name."""
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_answer_dict_lookups()


_WEIGHTS = ["int64(float64[::1], float64)", "int64(float32[:], float64)"]  # [vocab_size]


@numba.njit(_WEIGHTS, **JIT)
def first_reaching(weights, target):  # weights: [vocab_size] >= 0
    """The first index whose running float64 sum of ``weights`` reaches ``target``."""
    running = 0.0
    for v in range(weights.shape[0]):
        running += weights[v]
        if running >= target:
            return v
    return weights.shape[0] - 1  # (unreachable for a target at most the total)


@numba.njit(_WEIGHTS, **JIT)
def cdf_draw(weights, u):  # weights: [vocab_size] >= 0; u in (0, 1]
    """The first index whose running float64 sum of ``weights`` reaches ``u * total``:
    a draw in proportion to ``weights`` (index 0 when they have no mass at all)."""
    total = 0.0
    for v in range(weights.shape[0]):
        total += weights[v]
    return first_reaching(weights, u * total)


@numba.njit("void(float32[:, :], float64[:], boolean[::1], int64[::1], float32[::1], "
             "int32[::1])", **JIT)
def draw_rows(probs, uniforms, greedy, token_ids, confidence, ids32):
    """One draft token per row of ``probs`` ([num_rows, vocab_size], rows summing to 1):
    the argmax where ``greedy``, else the draw of :func:`cdf_draw` at the row's uniform
    (``uniforms``: [num_rows] in (0, 1]); writes ``token_ids`` [num_rows], ``confidence``
    [num_rows] (each row's top probability) and, unless it is empty, ``ids32``
    [num_rows] (the tokens again, as the next forward's int32 input ids). One pass finds
    the top and the total, a second walks the running sum to the draw."""
    vocab = probs.shape[1]
    for i in range(probs.shape[0]):
        row = probs[i]
        best, top, total = 0, row[0], 0.0
        for v in range(vocab):
            p = row[v]
            total += p
            if p > top:
                best, top = v, p
        confidence[i] = top
        token_ids[i] = best if greedy[i] else first_reaching(row, uniforms[i] * total)
        if ids32.shape[0] > 0:
            ids32[i] = token_ids[i]


# 2**f for f in [0, 1): exp(f ln 2) to degree 7 (coefficients ln(2)**k / k!), within 2e-6
# of it; a polynomial LLVM vectorises, where ``math.exp`` is a scalar call per entry
_LOG2E = np.float32(1.4426950408889634)
_EXP2 = tuple(np.float32(c) for c in (
    1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158,
    0.009618129107628477, 0.0013333558146428443, 0.00015403530393381606,
    1.525273380405984e-05))
_LOWEST = np.float32(-126.0)  # 2**-126, float32's smallest normal: below it, 0
_BLOCK = 64  # a draw's block: summed vectorised, then walked entry by entry


@numba.njit("float32(float32[::1], int64)", fastmath=True, **JIT)
def _block_sum(weights, start):  # the float32 sum of weights[start:start + _BLOCK]
    total = np.float32(0.0)
    for v in range(start, min(start + _BLOCK, weights.shape[0])):
        total += weights[v]
    return total


@numba.njit("int64(float32[::1], float64)", **JIT)
def _blocked_draw(weights, u):  # weights: [vocab_size] >= 0; u in (0, 1]
    """The first token whose running sum of ``weights`` reaches ``u`` times their total,
    the sums taken block by block (see :func:`softmax_draw_rows`)."""
    vocab = weights.shape[0]
    sums = np.empty(-(-vocab // _BLOCK), dtype=np.float64)
    total = 0.0
    for b in range(sums.shape[0]):
        sums[b] = _block_sum(weights, b * _BLOCK)
        total += sums[b]
    target = u * total
    running = 0.0
    for b in range(sums.shape[0]):
        if running + sums[b] >= target:
            inside = running
            for v in range(b * _BLOCK, min((b + 1) * _BLOCK, vocab)):
                inside += weights[v]
                if weights[v] > 0 and inside >= target:
                    return v
        running += sums[b]
    for v in range(vocab - 1, -1, -1):  # (rounding carried the target past the end)
        if weights[v] > 0:
            return v
    return 0  # (a row of no mass at all)


@numba.njit("void(float32[:, ::1], float32[::1], float64[:], boolean[::1], float32[:, ::1], "
             "int64[::1], float32[::1], int32[::1], int32[::1])", fastmath=True, **JIT)
def softmax_draw_rows(logits, scale, uniforms, greedy, probs, token_ids, confidence, ids32,
                      bits):
    """:func:`draw_rows` from the logits: ``probs`` [num_rows, vocab_size] gets each row's
    ``softmax(logits * scale)`` (``scale``: [num_rows] each row's 1 / temperature), and
    the draw, the top probability and the int32 copy are :func:`draw_rows`'s, in one call
    where the softmax took a torch call of its own (~10-25 us after a draft forward).

    The exponential is ``2**t`` split as ``2**floor(t)`` (the float's exponent bits, through
    ``bits``: [vocab_size] scratch) times a polynomial in the fraction, to within 2e-6 of
    ``exp``; an entry below ``2**-126`` of the row's top gets 0, as ``-inf`` logits do. The
    draft's distribution is whatever these probabilities are: the draw and the verifier
    read the same ones, which is all losslessness asks. The draw walks running sums in
    blocks of :data:`_BLOCK` (each block's float32 sum vectorised, the running total in
    float64) to the first token whose sum reaches ``u * total``, then entry by entry inside
    that block; only a token of positive probability is ever drawn (past the end, through
    the rounding of the block sums, the last such token)."""
    num_rows, vocab = logits.shape
    two = bits.view(np.float32)  # [vocab_size] 2**floor(t), written as exponent bits
    c0, c1, c2, c3, c4, c5, c6, c7 = _EXP2
    for i in range(num_rows):
        x, out = logits[i], probs[i]
        top = x[0]
        for v in range(vocab):
            top = max(top, x[v])
        best = 0
        while x[best] != top:  # the first token at the maximum (argmax's)
            best += 1
        k = scale[i] * _LOG2E
        for v in range(vocab):
            t = max((x[v] - top) * k, _LOWEST)
            n = np.floor(t)
            f = t - n
            out[v] = c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * (
                c6 + f * c7))))))
            bits[v] = 0 if t <= _LOWEST else (np.int32(n) + np.int32(127)) << np.int32(23)
        total = np.float32(0.0)
        for v in range(vocab):
            e = out[v] * two[v]
            out[v] = e
            total += e
        inv = np.float32(1.0) / total
        for v in range(vocab):
            out[v] *= inv
        confidence[i] = out[best]
        token_ids[i] = best if greedy[i] else _blocked_draw(out, uniforms[i])
        if ids32.shape[0] > 0:
            ids32[i] = token_ids[i]


@numba.njit(["void(int64[::1], int32[::1], int64[::1], int32[:, ::1], int32)",
             "void(int64[::1], int64[::1], int64[::1], int32[:, ::1], int32)"], **JIT)
def greedy_rows(best, draft_token_ids, counts, output, placeholder):
    """Greedy verification from each row's argmax, request by request, as
    :func:`specplugin.scorers.rejection.greedy_verify` documents it: ``best``:
    [num_drafted + num_reqs] the argmax of each row of logits (a request's draft rows, then
    its bonus row); ``counts``: [num_reqs] draft tokens; ``output``: [num_reqs, max_k + 1],
    every slot written (``placeholder`` past a request's emitted tokens)."""
    row = start = 0  # the request's first row of logits, its first draft token
    for r in range(counts.shape[0]):
        k = counts[r]
        accepted = 0
        while accepted < k and draft_token_ids[start + accepted] == best[row + accepted]:
            output[r, accepted] = best[row + accepted]
            accepted += 1
        output[r, accepted] = best[row + accepted]  # the correction, or the bonus token
        for j in range(accepted + 1, output.shape[1]):
            output[r, j] = placeholder
        row += k + 1
        start += k


@numba.njit("float64(float32[::1], float32[::1])", fastmath=True, **JIT)
def overlap(p, q):  # p, q: [vocab_size] probabilities
    """``sum(min(p, q))``: a draft token drawn from ``q`` is accepted with this
    probability. What the learners read, never what decides a token, so its sum may run in
    any order (``fastmath``: vectorised, measured 18 -> 3 us for three rows of 6,144)."""
    total = 0.0
    for v in range(p.shape[0]):
        total += min(p[v], q[v])
    return total


@numba.njit("void(float32[:, :], float32[:, ::1], int64[::1], boolean[::1], int64[::1], "
            "float32[:, ::1], boolean, float64[::1], int32[:, ::1], float32[::1], "
            "float64[::1])", **JIT)
def verify_rows(logits, target_probs, counts, greedy, draft_token_ids, draft_probs, has_q,
                uniforms, output, expected, work):
    """Verification of a batch, request by request, as
    :func:`specplugin.scorers.rejection.sampled_verify` documents it.

    ``logits``: [num_drafted + num_reqs, vocab_size] (a greedy request's rows are read:
    their argmax); ``target_probs``: [rows of sampled requests, vocab_size], their rows in
    turn; ``counts``: [num_reqs] draft tokens; ``greedy``: [num_reqs]; ``draft_probs``:
    [num_drafted, vocab_size] when ``has_q`` (else one-hot drafts, any shape);
    ``uniforms``: [num_drafted + num_reqs]; ``output``: [num_reqs, max_k + 1], filled
    with placeholders by the caller; ``expected``: [num_drafted] zeros by the caller;
    ``work``: [vocab_size] scratch for a rejection's residual."""
    vocab = logits.shape[1]
    num_drafted = draft_token_ids.shape[0]
    row = start = prow = 0  # the request's first row of logits, draft token, probs row
    for r in range(counts.shape[0]):
        k = counts[r]
        accepted = 0
        if greedy[r]:  # keep drafts while they equal the argmax, then emit the argmax
            while True:
                logit_row = logits[row + accepted]
                best, top = 0, logit_row[0]
                for v in range(1, vocab):
                    if logit_row[v] > top:
                        best, top = v, logit_row[v]
                if accepted < k and draft_token_ids[start + accepted] == best:
                    output[r, accepted] = best
                    expected[start + accepted] = 1.0
                    accepted += 1
                else:
                    output[r, accepted] = best
                    break
        else:
            for j in range(k):  # every draft's expected acceptance: sum(min(p, q)) or p(x)
                p = target_probs[prow + j]
                if has_q:
                    expected[start + j] = overlap(p, draft_probs[start + j])
                else:
                    expected[start + j] = p[draft_token_ids[start + j]]
            while accepted < k:  # accepted with probability min(1, p(x) / q(x))
                x = draft_token_ids[start + accepted]
                qx = np.float64(draft_probs[start + accepted, x]) if has_q else 1.0
                if uniforms[start + accepted] * qx < np.float64(target_probs[prow + accepted, x]):
                    output[r, accepted] = x
                    accepted += 1
                else:
                    break
            # the recovered token from max(0, p - q) at the rejection, or the bonus from p
            # (a float32 row's float64 sums are those of its float64 copy: no copy needed)
            p = target_probs[prow + accepted]
            u = uniforms[num_drafted + r]
            token = -1
            if accepted < k:  # the residual, in float64 (a difference of float32s, exactly)
                if has_q:
                    q = draft_probs[start + accepted]
                    for v in range(vocab):
                        w = np.float64(p[v]) - np.float64(q[v])
                        work[v] = w if w > 0.0 else 0.0
                else:
                    for v in range(vocab):
                        work[v] = p[v]
                    work[draft_token_ids[start + accepted]] = 0.0
                token = cdf_draw(work, u)
                if not work[token] > 0.0:  # a residual without mass (rounding): from p
                    token = -1
            output[r, accepted] = token if token >= 0 else cdf_draw(p, u)
            prow += k + 1
        row += k + 1
        start += k


@numba.njit("int64(int64[::1], int64[::1], int64[::1], int32[:, :], int32[:, :], int64, "
            "int32[::1], int32[::1], int64[::1], int32[::1], int64[::1], int64, int64)", **JIT)
def first_pass_inputs(rows, starts, ends, token_ids, block_table, block_size, cu_query_lens,
                      seq_lens, positions, input_ids, slots, num_padded, padding_slot):
    """A draft run's first pass reads row ``rows[i]``'s positions ``[starts[i], ends[i])``:
    writes each token's position, token id (``token_ids`` [num_reqs, max_len]) and KV slot
    (through ``block_table`` [num_reqs, max_blocks]) into ``positions``, ``input_ids`` and
    ``slots`` (each [>= num_padded]: the forward's own buffers), in turn; the slots of the
    padding tokens up to ``num_padded`` (a padded forward's dummy tokens) get
    ``padding_slot``, so they never write over real KV; ``cu_query_lens`` [num_rows + 1]
    (0 first) and ``seq_lens`` [num_rows] (each row's ``ends``). Returns the tokens in all."""
    token = 0
    cu_query_lens[0] = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        for position in range(starts[i], ends[i]):
            positions[token] = position
            input_ids[token] = token_ids[r, position]
            slots[token] = (np.int64(block_table[r, position // block_size]) * block_size
                            + position % block_size)
            token += 1
        cu_query_lens[i + 1] = token
        seq_lens[i] = ends[i]
    for t in range(token, num_padded):
        slots[t] = padding_slot
    return token


@numba.njit("void(int32[:, :], int64[::1], int64, int64, int64, int64[:, :, :], "
            "int32[:, ::1])", **JIT)
def decode_pass_inputs(block_table, ends, block_size, max_model_len, padding_slot, out,
                       seq_lens):
    """The positions and slots (``out`` [2, num_passes, num_padded]) and sequence lengths
    (``seq_lens`` [num_passes, num_rows]) of a run's decode passes after a first pass that
    ended at each row's newest token (position ``ends - 1``): pass j (from 1) reads
    position ``ends - 1 + j``; past ``max_model_len``, position 0 into ``padding_slot``
    with a sequence of 1 (as vLLM's update after each pass leaves them). The padding
    columns (``num_padded`` beyond the rows: a padded forward's dummy rows) read position 0
    into ``padding_slot``."""
    max_blocks = block_table.shape[1]
    for j in range(out.shape[1]):
        for i in range(ends.shape[0], out.shape[2]):
            out[0, j, i], out[1, j, i] = 0, padding_slot
        for i in range(ends.shape[0]):
            position = ends[i] + j  # (ends - 1 + (j + 1))
            if position >= max_model_len:
                out[0, j, i], out[1, j, i], seq_lens[j, i] = 0, padding_slot, 1
                continue
            block = min(position // block_size, max_blocks - 1)
            out[0, j, i] = position
            out[1, j, i] = (np.int64(block_table[i, block]) * block_size
                            + position % block_size)
            seq_lens[j, i] = position + 1


def _warm_up() -> None:
    """Call :func:`greedy_rows` once on a tiny input: a kernel's first call in a process
    costs ~4 ms beyond its compile (numba's dispatcher sets itself up; see
    ``specplugin.adaptive.kernels``), which would land in an engine's first verified step."""
    output = np.empty((1, 2), dtype=np.int32)
    greedy_rows(np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int32),
                np.ones(1, dtype=np.int64), output, -1)


_warm_up()

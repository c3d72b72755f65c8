"""Compiled loops for the host's share of a speculative step (numba, which vLLM requires).

Why compiled: on CPU the plugin's per-step work runs right after a forward has swept the
caches, where every torch or numpy call costs microseconds of cold dispatch. Each
function here replaces a dozen or two such calls with one loop (e.g. verification went
from ~0.21 to ~0.13 ms a step). Caveat: the first call after a forward still pays for the
swept caches, so removing one small call moves much of its cost to the next.

Where it decides a token, the arithmetic matches the torch/numpy code it replaced: float64
running sums of float32 probabilities, the first token whose sum reaches ``u * total`` (a
token of no mass never wins), ``u * q(x) < p(x)`` as float64 products. Tested in
``tests/test_draft_core.py`` and ``tests/test_rejection.py``.

Every kernel is compiled for fixed signatures at import (cached on disk by numba), so no
compile lands inside a timed step.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite.binding import ffi

JIT = {"cache": True, "nogil": True}


def _answer_dict_lookups() -> None:
    """Make ``llvmlite.binding.ffi.lib`` answer ``vars()``.

    vLLM quirk: its CPU worker scans loaded modules calling ``vars(value).get(...)``
    (``vllm/triton_utils/dispatcher.py``); ``ffi.lib.__getattr__`` wraps any name, so its
    ``__dict__`` lacks ``.get`` and the worker dies if numba was imported first. An empty
    function-table entry is what ``__getattr__`` returns for that name."""
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
    """A draw in proportion to ``weights``: the first index whose running float64 sum
    reaches ``u * total`` (0 when there is no mass)."""
    total = 0.0
    for v in range(weights.shape[0]):
        total += weights[v]
    return first_reaching(weights, u * total)


@numba.njit("void(float32[:, :], float64[:], boolean[::1], int64[::1], float32[::1], "
             "int32[::1])", **JIT)
def draw_rows(probs, uniforms, greedy, token_ids, confidence, ids32):
    """One draft token per row of ``probs`` [num_rows, vocab_size]: the argmax where
    ``greedy``, else a CDF draw at ``uniforms`` [num_rows]. Writes ``token_ids``,
    ``confidence`` (top probability) and, unless empty, ``ids32`` (int32 copy for the
    next forward's input ids), each [num_rows]."""
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


# 2**f for f in [0, 1): degree-7 Taylor of exp(f ln 2), within 2e-6; LLVM vectorises it,
# unlike math.exp
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
    """:func:`cdf_draw` with block-wise sums (see :func:`softmax_draw_rows`)."""
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
    """:func:`draw_rows` from logits, writing ``softmax(logits * scale)`` (``scale``: 1 / T)
    to ``probs`` [num_rows, vocab_size]. ``exp`` = ``2**floor(t)`` via exponent ``bits``
    (scratch) times a polynomial; lossless since draw and verifier read the same probs."""
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
    """Greedy verification (see :func:`specplugin.scorers.rejection.greedy_verify`):
    ``best`` [num_drafted + num_reqs] row argmaxes; ``counts`` [num_reqs]; ``output``
    [num_reqs, max_k + 1], every slot written."""
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
    """``sum(min(p, q))``, the acceptance probability of a draw from ``q``. Only learners
    read it, never a token decision, so ``fastmath`` reordering is fine (~6x faster)."""
    total = 0.0
    for v in range(p.shape[0]):
        total += min(p[v], q[v])
    return total


@numba.njit("void(float32[:, :], float32[:, ::1], int64[::1], boolean[::1], int64[::1], "
            "float32[:, ::1], boolean, float64[::1], int32[:, ::1], float32[::1], "
            "float64[::1])", **JIT)
def verify_rows(logits, target_probs, counts, greedy, draft_token_ids, draft_probs, has_q,
                uniforms, output, expected, work):
    """Verification of a batch (see :func:`specplugin.scorers.rejection.sampled_verify`).

    ``logits`` [num_drafted + num_reqs, vocab_size] (greedy rows' argmax);
    ``target_probs`` [sampled requests' rows, vocab_size]; ``draft_probs``
    [num_drafted, vocab_size] when ``has_q`` (else one-hot); ``uniforms``
    [num_drafted + num_reqs]; ``output`` prefilled with placeholders and ``expected``
    [num_drafted] with zeros by the caller; ``work`` [vocab_size] scratch."""
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
    """Inputs of a draft run's first pass over positions ``[starts[i], ends[i])`` of row
    ``rows[i]``: fills ``positions``, ``input_ids``, ``slots`` (each [>= num_padded]),
    ``cu_query_lens`` [num_rows + 1] and ``seq_lens`` [num_rows]. Padding tokens get
    ``padding_slot`` so they never overwrite real KV. Returns the token count."""
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
    """Positions and slots (``out`` [2, num_passes, num_padded]) and ``seq_lens``
    [num_passes, num_rows] of a run's decode passes: pass j (from 1) reads position
    ``ends - 1 + j``. Past ``max_model_len`` and in padding columns: position 0 into
    ``padding_slot`` (as vLLM leaves them)."""
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
    """Call :func:`greedy_rows` once: a kernel's first call costs ~4 ms beyond its compile,
    which would land in an engine's first verified step."""
    output = np.empty((1, 2), dtype=np.int32)
    greedy_rows(np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int32),
                np.ones(1, dtype=np.int64), output, -1)


_warm_up()

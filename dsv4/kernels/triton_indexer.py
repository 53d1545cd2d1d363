"""Triton kernel for the lightning indexer's scoring and top-k (CSA layers, ratio 4).

Same result as the scoring loop of :meth:`dsv4.model.indexer.Indexer.forward` (its docstring is the spec), given
the queries after RoPE, the head weights and the index keys: per query ``s`` (document ``q_doc``, doc-local
position ``q_pos``) and compressed key ``p``

    ``I[s, p] = D_I^-0.5 * sum_h w[s, h] * relu(q_I[s, h] . K_I[p])``   (fp32),

``-inf`` where the key is not allowed (``q_doc == 0``, ``key_seq[p] != q_doc`` or ``key_pos[p] >= (q_pos + 1) //
4``); the result holds the indices of the ``k = min(index_topk, P)`` largest scores in descending score order,
equal scores by the LOWEST key index (the torch code's stable descending sort); selections scoring ``-inf`` are
``-1``. ``-0.0`` and ``+0.0`` are the same score (a tie).

Kernel layout
-------------
Grid ``(ceil(L / BLOCK_M), B)``: one program per block of ``BLOCK_M`` consecutive queries of one batch row. The
(query, head) pairs are the M dimension of the score GEMM: per block of ``BLOCK_N`` keys and chunk of ``BLOCK_H``
heads, ``logits [BLOCK_M * BLOCK_H, BLOCK_N] = Q [BLOCK_M * BLOCK_H, D] @ K^T [D, BLOCK_N]`` (fp32 accumulation),
then ReLU, times ``w``, summed over the heads into ``scores [BLOCK_M, BLOCK_N]``. Only that block of fp32 scores
and the running top-k of the program's queries exist at any time; nothing of size ``[L, P]``.

Key range: when ``local_windows`` is given (the model's key layout: the earlier windows of the document the block's
first token continues, in order and ending where the block's own windows begin, then the block's own windows), the
key loop runs from the first window of the block's earliest document (``P - local_windows + floor(start / 4)``,
``start`` = the local row where a query's document began, negative for one begun before the block: the document-
local position gives it) to the causal prefix ``P - local_windows + end // 4`` (``end`` = the block's last query row
+ 1), as the torch code's key floors and prefix; a packed row's program reads only its documents' keys. Without
``local_windows`` it runs over every key. Inside the range a key block is scored only if at least one of its keys is
allowed for at least one query of the block (the rule above evaluated on the block's metadata, two int32 loads per
key): blocks of other documents, of invalid windows and past every query's causal limit cost no GEMM and no merge.

Streaming top-k: each (score, key index) pair is packed into one int64 that orders by score descending, then by
index ascending::

    s       = score, with -0.0 -> +0.0 and every NaN -> the positive quiet NaN
    bits    = int32 bit pattern of s
    ordered = bits if bits >= 0 else bits ^ 0x7FFFFFFF   (order-preserving fp32 -> int32)
    key     = (int64(ordered) << 32) | (P - 1 - index)

so a larger key is a better selection, and keys of finite scores are unique per query (lanes past ``P`` get the
low word 0; every ``-inf`` decodes to ``-1`` whatever its index). Each program keeps, per query,
the ``K_PAD = next_pow2(k)`` largest keys seen so far, sorted ascending (``best [BLOCK_M, K_PAD]``, initially the
key of ``(-inf, P - 1)``; disallowed keys score ``-inf``). A block of keys ``cand [BLOCK_M, BLOCK_N]`` merges in
only if some row has a candidate above its current ``K_PAD``-th key:

* ``K_PAD == 1``: a row maximum.
* ``BLOCK_N >= K_PAD``: ``top = tl.topk(cand, K_PAD)`` (descending); ``max(best, top)`` elementwise is a bitonic
  sequence holding the ``K_PAD`` largest of both; ``tl.bitonic_merge`` sorts it ascending.
* ``BLOCK_N < K_PAD``: only the ``BLOCK_N`` smallest of ``best`` (its first chunk) can be evicted: replace them by
  the ``BLOCK_N`` largest of (that chunk and ``tl.sort(cand, descending)``) sorted descending; the row is then
  descending-then-ascending, i.e. bitonic, and one ``tl.bitonic_merge`` sorts it ascending again.

At the end, column ``j`` of the output is ``best[K_PAD - 1 - j]`` decoded: ``-1`` where its score is ``-inf``
(high word ``<= ordered(-inf)``), else ``P - 1 - low word``. Given the fp32 scores, the selection is exact and
deterministic: it does not depend on the order of the merges (integer keys, unique per query).

Precision: fp32 inputs use IEEE fp32 dots (no TF32); 16-bit inputs feed ``tl.dot`` in their own dtype with fp32
accumulation, i.e. the products of the exactly upcast values summed in fp32 -- the torch code's ``.float()``
inputs, up to summation order. Scores therefore equal the torch scores up to fp32 rounding (summation order over
``D_I`` and over the heads), so two keys whose torch scores differ by an ulp or so may swap; exact ties (e.g. every
head ReLU'd to 0) stay exact ties and go to the lowest index. Under the Triton interpreter bf16 operands are
widened to fp32 first (its ``dot`` multiplies raw bf16 bit patterns); see ``UPCAST``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["triton_indexer_topk"]

INDEX_RATIO = 4  # tokens per compressed window of the indexer (dsv4.model.indexer.INDEX_RATIO)
_NEG_INF_ORDERED = tl.constexpr(-2139095041)  # ordered int32 of -inf: 0xFF800000 ^ 0x7FFFFFFF = 0x807FFFFF
_EMPTY_KEY = tl.constexpr(-2139095041 * 2**32)  # packed (-inf, index P - 1): no real key is smaller


@triton.jit
def _mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` in fp32; ``UPCAST`` (interpreter with bf16) widens the operands to fp32 first (exact)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _pack(scores, idx, P):
    """int64 keys ordering by score descending, then index ascending (see the module docstring)."""
    s = tl.where(scores == 0.0, 0.0, scores)  # -0.0 -> +0.0
    s = tl.where(s != s, float("nan"), s)  # any NaN -> one NaN (above +inf, as in torch's descending sort)
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = tl.maximum(P - 1 - idx, 0)  # lanes past P (scored -inf) must not set the high word
    return (ordered.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _merge(best, cand, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr):
    """The ``K_PAD`` largest of ``best [BLOCK_M, K_PAD]`` (ascending) and ``cand [BLOCK_M, BLOCK_N]``, ascending."""
    if K_PAD == 1:
        return tl.maximum(best, tl.max(cand, axis=1, keep_dims=True))
    elif BLOCK_N >= K_PAD:
        top = tl.topk(cand, K_PAD)  # descending
        return tl.bitonic_merge(tl.maximum(best, top), descending=False)
    else:
        R: tl.constexpr = K_PAD // BLOCK_N
        best3 = tl.reshape(best, [BLOCK_M, R, BLOCK_N])
        first = (tl.arange(0, R) == 0)[None, :, None]
        low = tl.max(tl.where(first, best3, _EMPTY_KEY), axis=1)  # the BLOCK_N smallest, ascending
        low = tl.bitonic_merge(tl.maximum(low, tl.sort(cand, descending=True)), descending=True)
        best3 = tl.where(first, low[:, None, :], best3)
        return tl.bitonic_merge(tl.reshape(best3, [BLOCK_M, K_PAD]), descending=False)


@triton.jit
def _indexer_topk_fwd(
    Q, W, KEYS, QDOC, QPOS, KDOC, KPOS, OUT,
    L, H, D, P, K_OUT, local_windows, scale,
    USE_LOCAL: tl.constexpr, RATIO: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_hb = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_nb = tl.arange(0, BLOCK_N)
    mmask = offs_m < L
    dmask = offs_d < D
    bm = b * L + offs_m  # flat (batch, query) indices, int64

    q_doc = tl.load(QDOC + bm, mask=mmask, other=0)
    limit = (tl.load(QPOS + bm, mask=mmask, other=0) + 1) // RATIO
    active = mmask & (q_doc > 0)

    # Keys that any query of the block may see lie in [lo, hi) (with local_windows: from the first window of the
    # block's earliest document to the causal prefix; else every key).
    lo = 0
    hi = P
    if USE_LOCAL:
        end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L)
        hi = tl.maximum(0, tl.minimum(P, P - local_windows + end // RATIO))
        start_row = offs_m - tl.load(QPOS + bm, mask=mmask, other=0)  # each query's document start (< 0: earlier)
        first = P - local_windows + tl.where(start_row >= 0, start_row // RATIO, -((RATIO - 1 - start_row) // RATIO))
        lo = tl.maximum(tl.min(tl.where(active, first, P), axis=0), 0)
    hi = tl.where(tl.max(active.to(tl.int32), axis=0) > 0, hi, 0)

    best = tl.full([BLOCK_M, K_PAD], _EMPTY_KEY, tl.int64)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + offs_nb
        nmask = offs_n < hi
        kdoc = tl.load(KDOC + b * P + offs_n, mask=nmask, other=0)
        kpos = tl.load(KPOS + b * P + offs_n, mask=nmask, other=0)
        allowed = (active[:, None] & nmask[None, :] & (kdoc[None, :] == q_doc[:, None])
                   & (kpos[None, :] < limit[:, None]))
        if tl.max(tl.max(allowed.to(tl.int32), axis=1), axis=0) > 0:
            kt = tl.load(KEYS + (b * P + offs_n[None, :]) * D + offs_d[:, None],
                         mask=nmask[None, :] & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + offs_hb
                hmask = offs_h < H
                qm = mmask[:, None, None] & hmask[None, :, None] & dmask[None, None, :]
                q = tl.load(Q + ((bm[:, None, None] * H + offs_h[None, :, None]) * D + offs_d[None, None, :]),
                            mask=qm, other=0.0)  # [BLOCK_M, BLOCK_H, BLOCK_D]
                w = tl.load(W + bm[:, None] * H + offs_h[None, :], mask=mmask[:, None] & hmask[None, :],
                            other=0.0)  # [BLOCK_M, BLOCK_H] fp32; padded heads weigh 0
                logits = _mma(tl.reshape(q, [BLOCK_M * BLOCK_H, BLOCK_D]), kt, PRECISION, UPCAST)
                logits = tl.reshape(tl.maximum(logits, 0.0), [BLOCK_M, BLOCK_H, BLOCK_N])
                scores += tl.sum(logits * w[:, :, None], axis=1)
            scores = tl.where(allowed, scores * scale, float("-inf"))
            cand = _pack(scores, offs_n[None, :], P)
            # Merge only when some query has a candidate above its current K_PAD-th best.
            gain = tl.max(cand, axis=1) > tl.min(best, axis=1)
            if tl.max(gain.to(tl.int32), axis=0) > 0:
                best = _merge(best, cand, BLOCK_M, BLOCK_N, K_PAD)

    # best is ascending: output column j is best[K_PAD - 1 - j].
    col = K_PAD - 1 - tl.arange(0, K_PAD)
    low = best.to(tl.int32)  # the low word (truncation): P - 1 - index, in [0, 2^31)
    idx = tl.where((best >> 32) > _NEG_INF_ORDERED, (P - 1 - low).to(tl.int64), -1)
    tl.store(OUT + bm[:, None] * K_OUT + col[None, :], idx, mask=mmask[:, None] & (col[None, :] < K_OUT))


_INTERPRETED = not isinstance(_indexer_topk_fwd, triton.runtime.jit.JITFunction)  # TRITON_INTERPRET=1 at import


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def triton_indexer_topk(
    q: Tensor,
    w: Tensor,
    keys: Tensor,
    query_seq_ids: Tensor,
    query_positions: Tensor,
    key_seq_ids: Tensor,
    key_positions: Tensor,
    k: int,
    local_windows: int | None = None,
    *,
    block_m: int | None = None,
    block_h: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> Tensor:
    """Top-k compressed-key indices ``[B, L, min(k, P)]`` (int64, ``-1`` = none), as ``Indexer.forward``.

    Args:
        q: ``[B, L, H_I, D_I]`` index queries after RoPE (fp32, bf16 or fp16).
        w: ``[B, L, H_I]`` head weights, already times ``H_I^-0.5`` (used in fp32).
        keys: ``[B, P, D_I]`` index keys; when their dtype differs from ``q``'s, both are upcast to fp32 (exact).
        query_seq_ids, query_positions: ``[B, L]`` document ids (0 = pack padding) and doc-local positions.
        key_seq_ids, key_positions: ``[B, P]`` window ids (0 = invalid) and doc-local window indices.
        k: ``index_topk``; the result has ``min(k, P)`` columns.
        local_windows: as in ``Indexer.forward`` (the last ``local_windows`` keys are this block's own windows):
            a block of queries ending at row ``end`` scores only the keys below ``P - local_windows + end // 4``.
            Same result as None whenever that precondition holds.
        block_m, block_h, block_n, num_warps: tuning. ``block_m`` queries per program (default: a power of two
            with ``block_m * K_PAD <= 2048``, at most 16), ``block_h`` heads per GEMM (``block_m * block_h >= 16``),
            ``block_n`` keys per block (power of two >= 16).

    On the meta device only the output is allocated (no launch).
    """
    if q.dim() != 4 or keys.dim() != 3 or w.dim() != 3:
        raise ValueError(f"triton_indexer_topk: q [B, L, H, D], w [B, L, H], keys [B, P, D]; got {tuple(q.shape)}, "
                         f"{tuple(w.shape)}, {tuple(keys.shape)}")
    b, length, h, d = q.shape
    p = keys.shape[1]
    if keys.shape[0] != b or keys.shape[2] != d or tuple(w.shape) != (b, length, h):
        raise ValueError(f"triton_indexer_topk: shapes q {tuple(q.shape)}, w {tuple(w.shape)}, keys "
                         f"{tuple(keys.shape)} do not match")
    if p >= 2**31:
        raise ValueError(f"triton_indexer_topk: P = {p} keys do not fit the 32-bit index field")
    k_out = min(int(k), p)
    out = torch.empty(b, length, k_out, dtype=torch.long, device=q.device)
    if q.device.type == "meta" or length == 0 or k_out == 0 or b == 0:
        if q.device.type != "meta":
            out.fill_(-1)
        return out

    if keys.dtype != q.dtype:  # mixed dtypes: both exactly upcast, as the torch code's .float() does
        q, keys = q.float(), keys.float()
    q, keys = q.contiguous(), keys.contiguous()
    w = w.float().contiguous()
    q_doc = query_seq_ids.to(torch.int32).contiguous()
    q_pos = query_positions.to(torch.int32).contiguous()
    k_doc = key_seq_ids.to(torch.int32).contiguous()
    k_pos = key_positions.to(torch.int32).contiguous()

    k_pad = _pow2(k_out)
    if block_m is None:
        block_m = max(1, min(16, 2048 // k_pad, _pow2(length)))
    block_m = _pow2(block_m)
    if block_h is None:
        block_h = min(_pow2(h), max(1, 64 // block_m))
    block_h = max(_pow2(block_h), 16 // block_m if block_m < 16 else 1)  # tl.dot needs M >= 16
    block_n = max(16, _pow2(block_n))
    block_d = max(16, _pow2(d))
    grid = (triton.cdiv(length, block_m), b)
    _indexer_topk_fwd[grid](
        q, w, keys, q_doc, q_pos, k_doc, k_pos, out,
        length, h, d, p, k_out, 0 if local_windows is None else int(local_windows), d**-0.5,
        USE_LOCAL=local_windows is not None, RATIO=INDEX_RATIO,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, K_PAD=k_pad, num_warps=num_warps,
    )
    return out

"""Triton forward and backward kernels for the DeepSeek-V4 sparse attention (window band + compressed rows + sink).

Same contract as the torch reference :func:`dsv4.model.sparse_attention.sparse_attention` (its module docstring is
the spec): query ``i`` of batch row ``b`` (kv row ``q_row = query_offset + i``) attends to

* window keys: kv rows ``j`` with ``q_row - W < j <= q_row``, ``kv_seq[j] == q_seq > 0``, ``not kv_padding[j]``;
* compressed keys (``ratio > 0``): the CSA selection ``topk[b, i, :]`` (``-1`` = none) or, for HCA, every
  compressed row, each under ``q_seq > 0 and comp_seq[p] == q_seq and comp_pos[p] < (q_pos + 1) // ratio``;

``p_j = exp(z_j) / (sum_allowed exp(z_k) + exp(sink_h))`` with ``z = scale * q . k`` and ``out = sum_j p_j kv_j``
(one K = V head shared by all query heads). A query without an allowed key outputs exactly 0 (only the sink is in
its denominator) with zero, finite gradients.

Kernel layout
-------------
Grid ``(L, B, ceil(H / BLOCK_H))``: one program per (query, batch row, block of heads). All heads of a query share
the single K = V head, so the heads are the M dimension of every GEMM: ``S [BLOCK_H, N] = Q_i [BLOCK_H, D] @
K^T [D, N]``. H and D are padded to powers of two >= 16 (``tl.dot``'s minimum) and masked.

Forward: loop over the band ``[max(0, q_row - W + 1), q_row]`` in key blocks of ``BLOCK_N`` rows, then over the
compressed keys in blocks of ``BLOCK_C`` (CSA: the query's selected rows gathered by index; HCA: all ``P`` rows);
online softmax in fp32 (running max ``m``, running sum ``l``, fp32 accumulator); the sink joins the denominator at
the end. Stores the output (input dtype) and ``lse = log(sum_allowed exp(z) + exp(sink))`` per (query, head), fp32.

Backward (same grid): recompute ``P = exp(S - lse)``; ``delta = rowsum(dO * O)``; ``dP = dO @ K^T`` (V = K);
``dS = P * (dP - delta)``; ``dQ = scale * dS @ K`` (accumulated in registers, stored once); per key block
``dKV = scale * dS^T @ Q + P^T @ dO`` (key path + value path) is ``tl.atomic_add``-ed into an fp32 buffer (up to
``W`` queries and every head block share a window row), likewise into an fp32 buffer for the compressed rows
(shared by every query that selects them). ``d_sink[h] = -sum_{b,i} p_sink * delta`` with ``p_sink = exp(sink_h -
lse)``: each program writes its per-(query, head) term to a ``[B, L, H]`` fp32 buffer, summed over (b, i) afterwards
(deterministic, no atomics on H hot addresses).

Precision: scores, softmax statistics and every accumulation are fp32. 16-bit inputs feed ``tl.dot`` in their own
dtype (``P`` and ``dS`` are rounded to it before their GEMMs, as tensor cores need); fp32 inputs use IEEE fp32
dots (no TF32), so fp32 matches the reference to ~1e-6.

Edge cases: duplicate top-k entries count twice and ``topk >= P`` entries are skipped (the reference counts
duplicates twice too and cannot index past ``P``); with ``sink = -inf`` a query without keys outputs 0 here
(the reference's softmax over nothing gives NaN). Under the Triton interpreter bf16 GEMM operands are widened to
fp32 first (see ``_mma``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsv4.model.sparse_attention import checked_query_offset, selected_row_probs

__all__ = ["triton_sparse_attention"]


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _band_block(KV_B, KDOC_B, start, q_row, q_doc, offs_n, offs_d, D):
    """Window key block: rows ``start + offs_n`` (the caller keeps ``start >= q_row - W + 1``, ``start >= 0``)."""
    rows = start + offs_n
    in_band = rows <= q_row
    kdoc = tl.load(KDOC_B + rows, mask=in_band, other=-1)  # -1 = padding key (set by the wrapper)
    allowed = in_band & (kdoc == q_doc)  # q_doc > 0 is checked by the caller (empty loop otherwise)
    k = tl.load(KV_B + rows[:, None] * D + offs_d[None, :], mask=allowed[:, None] & (offs_d[None, :] < D), other=0.0)
    return k, allowed, rows


@triton.jit
def _comp_block(COMP_B, CDOC_B, CPOS_B, idx, valid, q_doc, limit, offs_d, D):
    """Compressed key block: rows ``idx`` where ``valid``, masked by the compressed rule."""
    rows = tl.where(valid, idx, 0)
    cdoc = tl.load(CDOC_B + rows, mask=valid, other=-1)
    cpos = tl.load(CPOS_B + rows, mask=valid, other=0)
    allowed = valid & (cdoc == q_doc) & (cpos < limit)
    k = tl.load(COMP_B + rows[:, None] * D + offs_d[None, :], mask=allowed[:, None] & (offs_d[None, :] < D), other=0.0)
    return k, allowed, rows


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. ``UPCAST`` (Triton interpreter with bf16 only: its ``dot`` multiplies the raw bf16
    bit patterns) widens the operands to fp32 first, which is exact: a bf16 x bf16 product fits in fp32, so this is
    the tensor-core result up to summation order."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc=acc, input_precision=PRECISION)


@triton.jit
def _fwd_update(q, k, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over a key block ``k [N, D]`` (``allowed [N]``)."""
    s = _mma(q, tl.trans(k), None, PRECISION, UPCAST) * scale  # [BLOCK_H, N] fp32
    s = tl.where(allowed[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep everything at 0
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _mma(p.to(k.dtype), k, acc * alpha[:, None], PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _bwd_block(q, do, k, allowed, lse, delta, dq, scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Gradients of one key block: returns (dq + dS @ K (scale applied once at the end), dKV block [N, D] fp32)."""
    s = _mma(q, tl.trans(k), None, PRECISION, UPCAST) * scale
    p = tl.where(allowed[None, :], tl.exp(s - lse[:, None]), 0.0)  # [BLOCK_H, N]
    dp = _mma(do, tl.trans(k), None, PRECISION, UPCAST)  # V = K
    ds = p * (dp - delta[:, None])
    dq = _mma(ds.to(k.dtype), k, dq, PRECISION, UPCAST)
    dk = _mma(tl.trans(ds.to(q.dtype)), q, None, PRECISION, UPCAST) * scale  # key path
    dk = _mma(tl.trans(p.to(do.dtype)), do, dk, PRECISION, UPCAST)  # value path
    return dq, dk


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _sparse_attn_fwd(
    Q, KV, SINK, QDOC, QPOS, KDOC, COMP, CDOC, CPOS, TOPK, CLO, CHI, OUT, LSE,
    L, H, D, L_KV, P, K_SEL, query_offset, window, ratio, scale,
    HAS_COMP: tl.constexpr, IS_CSA: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    hmask = offs_h < H
    hd_mask = hmask[:, None] & (offs_d[None, :] < D)

    bi = b * L + i  # flat (batch, query) index, int64
    q = tl.load(Q + (bi * H + offs_h[:, None]) * D + offs_d[None, :], mask=hd_mask, other=0.0)
    q_doc = tl.load(QDOC + bi)
    q_row = query_offset + i

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # Window band; a pack-padding query (doc 0) has no key: empty loop.
    lo = tl.maximum(q_row - window + 1, 0)
    hi = tl.where(q_doc > 0, q_row + 1, lo)
    for start in range(lo, hi, BLOCK_N):
        k, allowed, rows = _band_block(KV + b * L_KV * D, KDOC + b * L_KV, start, q_row, q_doc, offs_n, offs_d, D)
        m_i, l_i, acc = _fwd_update(q, k, allowed, m_i, l_i, acc, scale, PRECISION, UPCAST)

    if HAS_COMP:
        limit = (tl.load(QPOS + bi) + 1) // ratio
        comp_b, cdoc_b, cpos_b = COMP + b * P * D, CDOC + b * P, CPOS + b * P
        if IS_CSA:
            n_sel = tl.where(q_doc > 0, K_SEL, 0)
            for c0 in range(0, n_sel, BLOCK_C):
                sel = c0 + offs_c
                idx = tl.load(TOPK + bi * K_SEL + sel, mask=sel < K_SEL, other=-1)
                valid = (idx >= 0) & (idx < P)
                k, allowed, rows = _comp_block(comp_b, cdoc_b, cpos_b, idx, valid, q_doc, limit, offs_d, D)
                m_i, l_i, acc = _fwd_update(q, k, allowed, m_i, l_i, acc, scale, PRECISION, UPCAST)
        else:
            # the rows of the query's document up to its causal prefix ([CLO, CHI), computed by the wrapper)
            c_lo = tl.load(CLO + bi)
            c_hi = tl.where(q_doc > 0, tl.load(CHI + bi), c_lo)
            for c0 in range(c_lo, c_hi, BLOCK_C):
                idx = c0 + offs_c
                k, allowed, rows = _comp_block(comp_b, cdoc_b, cpos_b, idx, idx < c_hi, q_doc, limit, offs_d, D)
                m_i, l_i, acc = _fwd_update(q, k, allowed, m_i, l_i, acc, scale, PRECISION, UPCAST)

    # Sink: one more denominator term exp(sink_h), no value.
    sink = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
    m_fin = tl.maximum(m_i, sink)
    m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)  # sink = -inf and no key: l = 0 below
    alpha = tl.exp(m_i - m_fin)
    l_fin = l_i * alpha + tl.exp(sink - m_fin)
    acc = acc * alpha[:, None]
    l_pos = l_fin > 0
    out = acc / tl.where(l_pos, l_fin, 1.0)[:, None]  # no key: acc == 0 -> exactly 0
    lse = tl.where(l_pos, m_fin + tl.log(tl.where(l_pos, l_fin, 1.0)), float("-inf"))
    tl.store(OUT + (bi * H + offs_h[:, None]) * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=hd_mask)
    tl.store(LSE + bi * H + offs_h, lse, mask=hmask)


@triton.jit
def _sparse_attn_bwd(
    Q, KV, SINK, QDOC, QPOS, KDOC, COMP, CDOC, CPOS, TOPK, CLO, CHI, OUT, LSE, DO,
    DQ, DKV, DCOMP, DSINK,
    L, H, D, L_KV, P, K_SEL, query_offset, window, ratio, scale,
    HAS_COMP: tl.constexpr, IS_CSA: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    hmask = offs_h < H
    dmask = (offs_d < D)[None, :]
    hd_mask = hmask[:, None] & dmask

    bi = b * L + i
    hd_offs = (bi * H + offs_h[:, None]) * D + offs_d[None, :]
    q = tl.load(Q + hd_offs, mask=hd_mask, other=0.0)
    do = tl.load(DO + hd_offs, mask=hd_mask, other=0.0)
    o = tl.load(OUT + hd_offs, mask=hd_mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # [BLOCK_H]
    lse = tl.load(LSE + bi * H + offs_h, mask=hmask, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # nothing in the denominator: every p is 0
    q_doc = tl.load(QDOC + bi)
    q_row = query_offset + i

    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    lo = tl.maximum(q_row - window + 1, 0)
    hi = tl.where(q_doc > 0, q_row + 1, lo)
    dkv_b = DKV + b * L_KV * D
    for start in range(lo, hi, BLOCK_N):
        k, allowed, rows = _band_block(KV + b * L_KV * D, KDOC + b * L_KV, start, q_row, q_doc, offs_n, offs_d, D)
        dq, dk = _bwd_block(q, do, k, allowed, lse, delta, dq, scale, PRECISION, UPCAST)
        tl.atomic_add(dkv_b + rows[:, None] * D + offs_d[None, :], dk, mask=allowed[:, None] & dmask)

    if HAS_COMP:
        limit = (tl.load(QPOS + bi) + 1) // ratio
        comp_b, cdoc_b, cpos_b = COMP + b * P * D, CDOC + b * P, CPOS + b * P
        dcomp_b = DCOMP + b * P * D
        if IS_CSA:
            n_sel = tl.where(q_doc > 0, K_SEL, 0)
            for c0 in range(0, n_sel, BLOCK_C):
                sel = c0 + offs_c
                idx = tl.load(TOPK + bi * K_SEL + sel, mask=sel < K_SEL, other=-1)
                valid = (idx >= 0) & (idx < P)
                k, allowed, rows = _comp_block(comp_b, cdoc_b, cpos_b, idx, valid, q_doc, limit, offs_d, D)
                dq, dk = _bwd_block(q, do, k, allowed, lse, delta, dq, scale, PRECISION, UPCAST)
                tl.atomic_add(dcomp_b + rows[:, None] * D + offs_d[None, :], dk, mask=allowed[:, None] & dmask)
        else:
            c_lo = tl.load(CLO + bi)
            c_hi = tl.where(q_doc > 0, tl.load(CHI + bi), c_lo)
            for c0 in range(c_lo, c_hi, BLOCK_C):
                idx = c0 + offs_c
                k, allowed, rows = _comp_block(comp_b, cdoc_b, cpos_b, idx, idx < c_hi, q_doc, limit, offs_d, D)
                dq, dk = _bwd_block(q, do, k, allowed, lse, delta, dq, scale, PRECISION, UPCAST)
                tl.atomic_add(dcomp_b + rows[:, None] * D + offs_d[None, :], dk, mask=allowed[:, None] & dmask)

    tl.store(DQ + hd_offs, (dq * scale).to(DQ.dtype.element_ty), mask=hd_mask)
    # d sink_h: the sink logit's softmax gradient, p_sink * (0 - delta) (its value slot is 0).
    sink = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
    p_sink = tl.exp(sink - lse)
    tl.store(DSINK + bi * H + offs_h, -p_sink * delta, mask=hmask)


# ----------------------------------------------------------------------------------------------------------------
# Autograd wrapper
# ----------------------------------------------------------------------------------------------------------------


_INTERPRETED = not isinstance(_sparse_attn_fwd, triton.runtime.jit.JITFunction)  # TRITON_INTERPRET=1 at import


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(max(1, n)))


class _Config:
    """Launch parameters (block sizes are constexpr: one compiled kernel per combination)."""

    def __init__(self, h: int, d: int, k_sel: int, block_h: int | None, block_n: int, block_c: int,
                 num_warps: int | None):
        self.block_h = _pow2_at_least_16(min(h, 64) if block_h is None else block_h)
        self.block_d = _pow2_at_least_16(d)
        self.block_n = _pow2_at_least_16(block_n)
        c = min(block_c, k_sel) if k_sel > 0 else block_c
        self.block_c = _pow2_at_least_16(c)
        if num_warps is None:
            num_warps = 8 if self.block_h * self.block_d >= 64 * 128 else 4
        self.num_warps = num_warps


def _ptr(t: Tensor | None, like: Tensor) -> Tensor:
    """A pointer argument; absent or empty tensors become a 1-element stand-in (never read: its loops are empty)."""
    return like.new_zeros(1) if t is None or t.numel() == 0 else t


def _hca_ranges(b: int, length: int, p: int, ratio: int, local_rows: int | None, key_floors: list[list[int]] | None,
                chunk_size: int, device) -> tuple[Tensor, Tensor]:
    """``(first, end)`` ``[B, L]`` int32: the compressed rows query ``i`` of row ``b`` may need: from its chunk's key
    floor (0 without floors) to its causal prefix ``P - local_rows + (i + 1) // ratio`` (``P`` without local
    rows); the kernel still applies the document and causal rule inside."""
    i = torch.arange(length, device=device)
    end = torch.full((length,), p, device=device) if local_rows is None else (p - local_rows + (i + 1) // ratio)
    end = end.clamp(0, p).expand(b, length)
    if key_floors is None:
        first = torch.zeros(b, length, dtype=torch.long, device=device)
    else:
        floors = torch.tensor(key_floors, dtype=torch.long, device=device)  # [B, n_chunks]
        first = floors[:, i // chunk_size]
    return first.minimum(end).to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


class _SparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sink, compressed, q_doc, q_pos, k_doc, c_doc, c_pos, topk, c_lo, c_hi, query_offset, window,
                ratio, scale, cfg):
        b, length, h, d = q.shape
        p = compressed.shape[1] if compressed is not None else 0
        k_sel = topk.shape[-1] if topk is not None else 0
        grid = (length, b, triton.cdiv(h, cfg.block_h))
        meta = (q_doc, q_pos, k_doc, _ptr(compressed, q), _ptr(c_doc, q_doc), _ptr(c_pos, q_doc), _ptr(topk, q_doc),
                _ptr(c_lo, q_doc), _ptr(c_hi, q_doc))
        sizes = (length, h, d, kv.shape[1], p, k_sel, query_offset, window, max(ratio, 1), scale)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: IEEE dots, no TF32 rounding
        consts = dict(
            HAS_COMP=compressed is not None, IS_CSA=topk is not None, PRECISION=precision,
            UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
            BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c,
            num_warps=cfg.num_warps,
        )
        out = torch.empty_like(q)
        lse = torch.empty(b, length, h, device=q.device, dtype=torch.float32)
        if q.device.type != "meta":  # on meta (the memory plan) only the allocations count
            _sparse_attn_fwd[grid](q, kv, sink, *meta, out, lse, *sizes, **consts)
        ctx.save_for_backward(q, kv, sink, compressed, q_doc, q_pos, k_doc, c_doc, c_pos, topk, c_lo, c_hi, out, lse)
        ctx.launch = (grid, sizes, consts)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse=None):
        q, kv, sink, compressed, q_doc, q_pos, k_doc, c_doc, c_pos, topk, c_lo, c_hi, out, lse = ctx.saved_tensors
        grid, sizes, consts = ctx.launch
        meta = (q_doc, q_pos, k_doc, _ptr(compressed, q), _ptr(c_doc, q_doc), _ptr(c_pos, q_doc), _ptr(topk, q_doc),
                _ptr(c_lo, q_doc), _ptr(c_hi, q_doc))
        grad_out = grad_out.to(q.dtype).contiguous()
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)  # atomics: fp32 accumulation
        dcomp = None if compressed is None else torch.zeros(compressed.shape, device=kv.device, dtype=torch.float32)
        dsink = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)  # per (b, i, h) term
        if q.device.type != "meta":
            _sparse_attn_bwd[grid](
                q, kv, sink, *meta, out, lse, grad_out, dq, dkv, _ptr(dcomp, dkv), dsink, *sizes, **consts
            )
        d_sink = dsink.sum(dim=(0, 1)).to(sink.dtype)
        d_comp = None if compressed is None else dcomp.to(compressed.dtype)
        return (dq, dkv.to(kv.dtype), d_sink, d_comp) + (None,) * 13


def triton_sparse_attention(
    q: Tensor,
    kv: Tensor,
    sink: Tensor,
    *,
    window: int,
    query_seq_ids: Tensor,
    query_positions: Tensor,
    kv_seq_ids: Tensor,
    kv_padding: Tensor | None = None,
    query_offset: int | None = None,
    compressed: Tensor | None = None,
    compressed_seq_ids: Tensor | None = None,
    compressed_positions: Tensor | None = None,
    ratio: int = 0,
    topk_indices: Tensor | None = None,
    scale: float | None = None,
    block_h: int | None = None,
    block_n: int = 64,
    block_c: int = 64,
    num_warps: int | None = None,
    compressed_probs: bool = False,
    compressed_local_rows: int | None = None,
    key_floors: list[list[int]] | None = None,
    chunk_size: int = 256,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sliding-window + compressed sparse attention in Triton; same arguments and result as ``sparse_attention``.

    Returns ``[B, L, H, D]`` in ``q.dtype``; differentiable w.r.t. ``q``, ``kv``, ``sink`` and ``compressed``. With
    ``compressed_probs`` (CSA) also the selected rows' head-mean probabilities ``[B, L, k]`` (the indexer loss's
    teacher), computed in torch from the kernel's log-normaliser (:func:`~dsv4.model.sparse_attention.
    selected_row_probs`).
    ``q``, ``kv`` and ``compressed`` must share one dtype (bf16, fp16 or fp32). Tuning (constexpr block sizes):
    ``block_h`` heads per program (default ``min(H, 64)``), ``block_n`` window rows and ``block_c`` compressed rows
    per key block (rounded up to powers of two >= 16), ``num_warps``.
    HCA: as in ``sparse_attention``, ``compressed_local_rows`` bounds each query's compressed rows to its causal
    prefix (``P - compressed_local_rows + (i + 1) // ratio``) and ``key_floors`` (per row and chunk of ``chunk_size``
    queries) starts them at its documents' first row, so a query visits only its document's causal rows.
    """
    b, length, h, d = q.shape
    l_kv = kv.shape[1]
    query_offset = checked_query_offset("triton_sparse_attention", length, l_kv, query_offset, compressed, ratio)
    if kv.dtype != q.dtype or (compressed is not None and compressed.dtype != q.dtype):
        raise ValueError(f"triton_sparse_attention: q, kv and compressed need one dtype, got {q.dtype}, {kv.dtype}"
                         f"{'' if compressed is None else ', ' + str(compressed.dtype)}")
    if compressed is not None:
        if compressed_seq_ids is None or compressed_positions is None:
            raise ValueError("triton_sparse_attention: compressed rows need compressed_seq_ids and _positions")
    elif topk_indices is not None:
        raise ValueError("triton_sparse_attention: topk_indices without compressed rows")
    scale = d**-0.5 if scale is None else float(scale)
    if compressed_probs and topk_indices is None:
        raise ValueError("triton_sparse_attention: compressed_probs needs a CSA selection (topk_indices)")
    if length == 0:
        out = q.new_zeros(b, 0, h, d)
        return (out, q.new_zeros(b, 0, topk_indices.shape[-1], dtype=torch.float32)) if compressed_probs else out

    # Metadata as contiguous int32; padding keys get document id -1 (never equal to a query's id > 0).
    q_doc = query_seq_ids.to(torch.int32).contiguous()
    q_pos = query_positions.to(torch.int32).contiguous()
    k_doc = kv_seq_ids.to(torch.int32)
    if kv_padding is not None:
        k_doc = k_doc.masked_fill(kv_padding, -1)
    k_doc = k_doc.contiguous()
    c_doc = c_pos = topk = None
    if compressed is not None:
        compressed = compressed.contiguous()
        c_doc = compressed_seq_ids.to(torch.int32).contiguous()
        c_pos = compressed_positions.to(torch.int32).contiguous()
        if topk_indices is not None:
            topk = topk_indices.to(torch.int32).contiguous()
    c_lo = c_hi = None
    if compressed is not None and topk is None:  # HCA: each query's [first, last) compressed rows
        c_lo, c_hi = _hca_ranges(b, length, compressed.shape[1], ratio, compressed_local_rows, key_floors, chunk_size,
                                 q.device)
    cfg = _Config(h, d, 0 if topk is None else topk.shape[-1], block_h, block_n, block_c, num_warps)
    out, lse = _SparseAttentionFn.apply(
        q.contiguous(), kv.contiguous(), sink.contiguous(), compressed, q_doc, q_pos, k_doc, c_doc, c_pos, topk,
        c_lo, c_hi, int(query_offset), int(window), int(ratio), scale, cfg,
    )
    if not compressed_probs:
        return out
    return out, selected_row_probs(q, compressed, topk_indices, lse, query_seq_ids, query_positions,
                                   compressed_seq_ids, compressed_positions, ratio, scale)

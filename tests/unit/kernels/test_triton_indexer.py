"""Triton lightning-indexer top-k vs the torch indexer's selection, under the Triton interpreter on CPU tensors
(TRITON_INTERPRET=1 is set before triton is imported), or compiled on CUDA tensors (``tests/unit/kernels/device.py``).

The reference ``reference_topk`` is the scoring loop of ``Indexer.forward`` on given ``q`` (after RoPE), ``w`` and
keys, op for op (fp32 einsum, relu, weighted head sum, D_I^-0.5, masked_fill(-inf), stable descending sort, -1 for
-inf, -1 padding of a short causal prefix); ``test_matches_indexer_module`` also checks the kernel against the
module itself. Index tensors must be EQUAL, ties included.

bf16 rule: the reference runs on the same bf16 values upcast exactly to fp32 (what the module's ``.float()`` does),
with fp32 products and fp32 sums; the kernel's bf16 ``tl.dot`` accumulates the same (exact in fp32) products in
fp32, so both score the same numbers up to summation order -- the same comparison as in fp32.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dsv4.kernels.triton_indexer import triton_indexer_topk  # noqa: E402
from dsv4.model.compressor import window_metadata  # noqa: E402
from dsv4.model.sparse_attention import compressed_key_allowed  # noqa: E402
from tests.unit.kernels.device import DEVICE  # noqa: E402  (cpu under the interpreter; cuda: compiled)


H, D = 2, 16


def reference_topk(q, w, keys, q_seq, q_pos, k_seq, k_pos, k, local_windows=None, chunk=5):
    """``Indexer.forward``'s selection given ``q [B, L, H, D]`` (after RoPE), ``w [B, L, H]`` and ``keys``."""
    b, length = q.shape[:2]
    p = keys.shape[1]
    k = min(k, p)
    q, keys = q.float(), keys.float()
    out = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        hi = p if local_windows is None else max(0, min(p, p - local_windows + end // 4))
        logits = torch.einsum("bchd,bpd->bchp", q[:, start:end], keys[:, :hi]).relu()
        scores = torch.einsum("bchp,bch->bcp", logits, w[:, start:end]) * q.shape[-1] ** -0.5
        allowed = compressed_key_allowed(q_seq[:, start:end], q_pos[:, start:end], k_seq[:, :hi], k_pos[:, :hi], 4)
        scores = scores.masked_fill(~allowed, float("-inf"))
        values, idx = scores.sort(dim=-1, descending=True, stable=True)
        idx = idx[..., :k].masked_fill(torch.isneginf(values[..., :k]), -1)
        if idx.shape[-1] < k:
            idx = torch.nn.functional.pad(idx, (0, k - idx.shape[-1]), value=-1)
        out.append(idx)
    return torch.cat(out, dim=1)


def make_case(kind, seed=0, batch=2, dtype=torch.float32):
    """Query metadata ``[B, L]``, keys = earlier (CP-style) windows followed by the block's own ``L // 4`` windows.

    * ``single``: one document continuing from 32 earlier windows (queries at doc positions 128..191; P = 48).
    * ``packed``: 20 windows of another document (id 7), then 10 earlier windows of document 1, then the block's
      windows: documents of 20 (continuing at position 40), 24 and 16 tokens and 4 pack-padding tokens (P = 46).
    * ``ties``: like ``single`` with q > 0, a third of the keys zero and a third all-negative (relu gives exactly 0
      for every head), head weights of both signs, all-negative (-0.0 scores) or zero for some queries.
    """
    g = torch.Generator().manual_seed(seed)
    length = 64
    if kind == "packed":
        lengths, starts = [20, 24, 16], [40, 0, 0]
        seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(4, dtype=torch.long)])
        pos = torch.cat([s + torch.arange(n) for s, n in zip(starts, lengths)] + [torch.zeros(4, dtype=torch.long)])
        early_seq = torch.cat([torch.full((20,), 7), torch.full((10,), 1)])
        early_pos = torch.cat([torch.arange(20), torch.arange(10)])
    else:
        seq, pos = torch.ones(length, dtype=torch.long), 128 + torch.arange(length)
        early_seq, early_pos = torch.ones(32, dtype=torch.long), torch.arange(32)
    seq, pos = seq.expand(batch, -1).clone(), pos.expand(batch, -1).clone()
    win_seq, win_pos = window_metadata(seq, pos, 4)
    k_seq = torch.cat([early_seq.expand(batch, -1), win_seq], 1)
    k_pos = torch.cat([early_pos.expand(batch, -1), win_pos], 1)
    p = k_seq.shape[1]
    q = torch.randn(batch, length, H, D, generator=g)
    w = torch.randn(batch, length, H, generator=g) * H**-0.5
    keys = torch.randn(batch, p, D, generator=g)
    if kind == "ties":
        q = q.abs()
        kind_of_key = torch.arange(p) % 3
        keys[:, kind_of_key == 1] = 0.0
        keys[:, kind_of_key == 2] = -keys[:, kind_of_key == 2].abs()
        w[:, ::4] = -w[:, ::4].abs()  # every score <= 0: the zero keys (-0.0 here) are the best, a tie
        w[:, 1::8] = 0.0  # every allowed score is exactly 0
    case = dict(q=q.to(dtype), w=w, keys=keys.to(dtype), q_seq=seq, q_pos=pos, k_seq=k_seq, k_pos=k_pos,
                local_windows=win_seq.shape[1])
    return {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in case.items()}


def run_both(case, k, local, **kw):
    args = (case["q"], case["w"], case["keys"], case["q_seq"], case["q_pos"], case["k_seq"], case["k_pos"], k)
    lw = case["local_windows"] if local else None
    return triton_indexer_topk(*args, local_windows=lw, **kw).cpu(), reference_topk(*args, local_windows=lw).cpu()


def check(out, ref):
    assert out.dtype == torch.long and out.shape == ref.shape
    bad = (out != ref).any(-1).nonzero()
    if bad.numel():
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{len(bad)} (batch, query) rows differ, first {first}: {out[first]} vs {ref[first]}")


@pytest.mark.parametrize(
    "kind,k,local,block_n",
    [
        ("single", 8, True, 16),  # 3 key blocks: several merges (BLOCK_N >= K_PAD)
        ("single", 20, False, 16),  # K_PAD 32 > BLOCK_N: chunked merge
        ("packed", 4, True, 16),  # blocks of the other document skipped, pack padding, -1 padding
        ("packed", 100, False, 32),  # k > P: k = P = 46 columns, K_PAD 64
        ("ties", 8, False, 16),
        ("ties", 6, True, 64),  # one key block: P < BLOCK_N
    ],
)
def test_matches_reference_fp32(kind, k, local, block_n):
    case = make_case(kind, seed=len(kind) + k)
    out, ref = run_both(case, k, local, block_n=block_n)
    check(out, ref)
    assert (ref >= 0).any()
    if kind == "packed":
        assert (ref == -1).any()  # pack padding and early queries of a document select fewer than k keys


def test_local_windows_same_as_full_and_block_sizes_agree():
    case = make_case("packed", seed=3)
    full, ref = run_both(case, 8, False, block_n=16)
    check(full, ref)
    for kw in (dict(block_n=16, block_m=4), dict(block_n=32, block_m=8, block_h=4)):  # M = 16 and 32 rows
        local, _ = run_both(case, 8, True, **kw)
        assert torch.equal(local, full)


def test_local_windows_start_at_the_documents_first_window():
    """With ``local_windows`` a program reads keys only from the first window of its earliest document on: in the
    packed case the 20 rows before document 1's earlier windows are made to CLAIM document 1 (ids 1, positions
    0..19; a layout the model never builds), and the kernel still selects what the reference selects on the true
    layout, where those rows belong to another document. Without ``local_windows`` it reads them (and differs)."""
    case = make_case("packed", seed=3)
    _, truth = run_both(case, 8, True, block_n=16)
    case["k_seq"], case["k_pos"] = case["k_seq"].clone(), case["k_pos"].clone()
    case["k_seq"][:, :20] = 1
    case["k_pos"][:, :20] = torch.arange(20, device=case["k_pos"].device)
    for kw in (dict(block_n=16), dict(block_n=16, block_m=4)):
        local, _ = run_both(case, 8, True, **kw)
        check(local, truth)
    full, _ = run_both(case, 8, False, block_n=16)
    assert not torch.equal(full, truth)


@pytest.mark.parametrize("kind", ["single", "ties"])
def test_matches_reference_bf16(kind):
    case = make_case(kind, seed=5, dtype=torch.bfloat16)
    out, ref = run_both(case, 8, True, block_n=16)
    check(out, ref)


def test_matches_indexer_module():
    """The kernel on the module's own q (RoPE applied), w and keys selects what ``Indexer.forward`` selects."""
    from dsv4.config import DSV4Config
    from dsv4.model.attention_metadata import build_attention_metadata
    from dsv4.model.indexer import Indexer
    from dsv4.model.rope import apply_rope

    config = DSV4Config.preset("tiny", attention_chunk_size=5)
    torch.manual_seed(0)
    indexer = Indexer(config)
    with torch.no_grad():
        indexer.compressor.ape.normal_()
    indexer.to(DEVICE)
    lengths = [16, 28]
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(4, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(4, dtype=torch.long)])
    x = torch.randn(1, 48, config.hidden_size).to(DEVICE)
    q_lat = torch.randn(1, 48, config.q_lora_rank).to(DEVICE)
    meta = build_attention_metadata(config, pos[None].to(DEVICE), seq[None].to(DEVICE))
    w4 = meta.windows[4]
    with torch.no_grad():
        keys = indexer.keys(x, w4)
        expected = indexer(x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids, keys, w4.seq_ids,
                           w4.positions, local_windows=w4.seq_ids.shape[1])
        q = indexer.wq_b(q_lat).view(1, 48, config.index_n_heads, config.index_head_dim)
        q = apply_rope(q, meta.rope_compress).float()
        w = torch.nn.functional.linear(x.float(), indexer.weights_proj.weight.float()) * config.index_n_heads**-0.5
    out = triton_indexer_topk(q, w, keys, meta.seq_ids, meta.position_ids, w4.seq_ids, w4.positions,
                              config.index_topk, local_windows=w4.seq_ids.shape[1], block_n=16)
    check(out, expected)


def test_meta_device_and_empty():
    b, length, p = 2, 12, 5
    q = torch.empty(b, length, H, D, device="meta", dtype=torch.bfloat16)
    w = torch.empty(b, length, H, device="meta")
    keys = torch.empty(b, p, D, device="meta", dtype=torch.bfloat16)
    ids = torch.empty(b, length, dtype=torch.long, device="meta")
    kids = torch.empty(b, p, dtype=torch.long, device="meta")
    out = triton_indexer_topk(q, w, keys, ids, ids, kids, kids, 8)
    assert out.device.type == "meta" and out.shape == (b, length, 5) and out.dtype == torch.long
    # no complete window: k = 0 columns; no query: L = 0 rows
    cpu = dict(device=DEVICE)
    out = triton_indexer_topk(torch.randn(1, 3, H, D, **cpu), torch.randn(1, 3, H, **cpu), torch.randn(1, 0, D, **cpu),
                              torch.ones(1, 3, dtype=torch.long, **cpu), torch.arange(3, **cpu)[None],
                              torch.ones(1, 0, dtype=torch.long, **cpu), torch.zeros(1, 0, dtype=torch.long, **cpu), 8)
    assert out.shape == (1, 3, 0)
    out = triton_indexer_topk(torch.randn(1, 0, H, D, **cpu), torch.randn(1, 0, H, **cpu), torch.randn(1, 4, D, **cpu),
                              torch.ones(1, 0, dtype=torch.long, **cpu), torch.zeros(1, 0, dtype=torch.long, **cpu),
                              torch.ones(1, 4, dtype=torch.long, **cpu), torch.arange(4, **cpu)[None], 8)
    assert out.shape == (1, 0, 4)

"""Triton sparse attention (forward + backward) vs the torch reference ``sparse_attention``, under the Triton
interpreter on CPU tensors (TRITON_INTERPRET=1 is set before triton is imported), or compiled on CUDA tensors
(``tests/unit/kernels/device.py``).

Every case compares the output and the gradients w.r.t. q, kv, sink and the compressed rows, with a random
(non-uniform) output weight so that every gradient path is exercised.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dsv4.kernels.triton_sparse_attention import triton_sparse_attention  # noqa: E402
from dsv4.model.compressor import window_metadata  # noqa: E402
from dsv4.model.sparse_attention import compressed_key_allowed, sparse_attention  # noqa: E402
from tests.unit.kernels.device import DEVICE  # noqa: E402  (cpu under the interpreter; cuda: compiled)
from tests.unit.model.test_sparse_attention import packed_meta  # noqa: E402


LEAVES = ("q", "kv", "sink", "comp")


def make_case(length, *, packed, ratio=0, csa=False, batch=2, heads=2, dim=16, k=4, halo=0, seed=0):
    """Random case: ``halo`` extra kv rows precede the queries (CP), plus one trailing kv row when ``halo``."""
    g = torch.Generator().manual_seed(seed)
    l_kv = length + halo + (1 if halo else 0)
    if packed:  # three documents, then 4 pack-padding tokens (id 0)
        seq, pos = packed_meta([8, 12, l_kv - 24], 4)
    else:
        seq, pos = torch.ones(l_kv, dtype=torch.long), torch.arange(l_kv)
    seq, pos = seq.expand(batch, -1).clone(), pos.expand(batch, -1).clone()
    pad = torch.zeros(batch, l_kv, dtype=torch.bool)
    pad[-1, -3:] = True  # padded keys at the end of the last row
    pad[0, min(10, l_kv - 1)] = True
    q_rows = slice(halo, halo + length)
    case = dict(
        q=torch.randn(batch, length, heads, dim, generator=g), kv=torch.randn(batch, l_kv, dim, generator=g),
        sink=torch.randn(heads, generator=g), q_seq=seq[:, q_rows], q_pos=pos[:, q_rows], kv_seq=seq, kv_pad=pad,
        offset=halo,
    )
    if ratio:
        comp_seq, comp_pos = window_metadata(seq[:, q_rows], pos[:, q_rows], ratio)
        p = comp_seq.shape[1]
        case.update(comp=torch.randn(batch, p, dim, generator=g), comp_seq=comp_seq, comp_pos=comp_pos, ratio=ratio)
        if csa:
            topk = torch.stack([torch.stack([torch.randperm(p, generator=g)[:k] for _ in range(length)])
                                for _ in range(batch)])
            drop = torch.rand(topk.shape, generator=g) < 0.3
            case["topk"] = topk.masked_fill(drop, -1)  # -1 entries plus non-causal / other-document picks
    return case


def attend(fn, case, window, leaves, **kw):
    return fn(
        leaves["q"], leaves["kv"], leaves["sink"], window=window, query_seq_ids=case["q_seq"],
        query_positions=case["q_pos"], kv_seq_ids=case["kv_seq"], kv_padding=case["kv_pad"],
        query_offset=case["offset"], compressed=leaves.get("comp"), compressed_seq_ids=case.get("comp_seq"),
        compressed_positions=case.get("comp_pos"), ratio=case.get("ratio", 0), topk_indices=case.get("topk"), **kw,
    )


def out_and_grads(fn, case, window, dtype=torch.float32, sink_dtype=None, **kw):
    """Output and input gradients of ``sum(out * weight)``; the inputs are ``case``'s, cast to ``dtype``."""
    leaves = {}
    for name in LEAVES:
        if name in case:
            t = case[name].detach().clone().to(DEVICE)  # fresh leaves: no .grad shared between runs
            leaves[name] = t.to((sink_dtype or dtype) if name == "sink" else dtype).requires_grad_(True)
    meta = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items() if k not in LEAVES}
    out = attend(fn, meta, window, leaves, **kw)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype).float().to(DEVICE)
    (out.float() * weight).sum().backward()
    return out, {name: t.grad for name, t in leaves.items()}


def assert_matches_reference(case, window, **kw):
    out, grads = out_and_grads(triton_sparse_attention, case, window, **kw)
    ref, ref_grads = out_and_grads(sparse_attention, case, window)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    return out, grads


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind, ratio, csa", [("window", 0, False), ("csa", 4, True), ("hca", 8, False)])
def test_matches_reference(kind, ratio, csa, packed):
    case = make_case(32, packed=packed, ratio=ratio, csa=csa, seed=1)
    if csa:  # the case holds -1 entries and picks the compressed rule must reject (future or other-document rows)
        topk = case["topk"]
        sel = topk.clamp(min=0)
        batch = torch.arange(topk.shape[0])[:, None, None]
        rule = compressed_key_allowed(case["q_seq"], case["q_pos"], case["comp_seq"][batch, sel],
                                      case["comp_pos"][batch, sel], ratio)
        assert (topk < 0).any() and ((topk >= 0) & ~rule).any() and ((topk >= 0) & rule).any()
    assert_matches_reference(case, window=6)


def test_documents_shorter_than_window():
    """Documents of 1-3 tokens (and a whole row shorter than the window) with W = 8."""
    g = torch.Generator().manual_seed(2)
    seq = torch.tensor([[1, 2, 2, 3, 3, 3, 4, 0, 0, 5, 5, 6]])
    pos = torch.tensor([[0, 0, 1, 0, 1, 2, 0, 0, 0, 0, 1, 0]])
    length, heads, dim = seq.shape[1], 3, 16
    case = dict(q=torch.randn(1, length, heads, dim, generator=g), kv=torch.randn(1, length, dim, generator=g),
                sink=torch.randn(heads, generator=g), q_seq=seq, q_pos=pos, kv_seq=seq,
                kv_pad=torch.zeros(1, length, dtype=torch.bool), offset=0)
    assert_matches_reference(case, window=8)
    assert_matches_reference(case, window=16)  # wider than the row: the band starts at row 0 for every query


@pytest.mark.parametrize("ratio, csa", [(4, True), (8, False)])
def test_query_without_allowed_key_is_zero_with_finite_grads(ratio, csa):
    case = make_case(32, packed=True, ratio=ratio, csa=csa, batch=1, seed=3)
    case["kv_pad"][0, 8] = True  # first token of document 2 padded: query 8 has no key (no compressed row yet)
    out, grads = assert_matches_reference(case, window=6)
    no_key = case["q_seq"][0] == 0
    no_key[8] = True
    assert no_key.sum() == 5
    assert torch.equal(out[0, no_key], torch.zeros_like(out[0, no_key]))
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
    assert torch.equal(grads["q"][0, no_key], torch.zeros_like(grads["q"][0, no_key]))


@pytest.mark.parametrize("ratio, csa", [(0, False), (4, True), (8, False)])
def test_cp_query_offset_with_halo_rows(ratio, csa):
    """kv = 5 halo rows + the 24 query rows + 1 trailing row; query_offset = 5 (not L_kv - L)."""
    case = make_case(24, packed=True, ratio=ratio, csa=csa, halo=5, seed=4)
    assert case["kv"].shape[1] == 30 and case["offset"] == 5
    _, grads = assert_matches_reference(case, window=7)
    assert grads["kv"][:, -1].abs().max() == 0  # the trailing row is in no band


def test_padded_heads_and_dim_several_blocks():
    """H = 18 (two head blocks of 16, the second masked), D = 8 (padded to 16); W = 20 and k = 20 span two
    key blocks of 16 (block_n = block_c = 16); ratio 1 (every token is a compressed window)."""
    case = make_case(24, packed=False, ratio=1, csa=True, batch=1, heads=18, dim=8, k=20, seed=5)
    assert_matches_reference(case, window=20, block_h=16, block_n=16, block_c=16)


def test_sink_minus_inf_head():
    """A head with sink = -inf is a plain softmax (p_sink = 0, d_sink = 0); every query sees itself."""
    case = make_case(16, packed=False, ratio=8, batch=1, heads=2, seed=6)
    case["kv_pad"][:] = False
    case["sink"][0] = float("-inf")
    _, grads = assert_matches_reference(case, window=4)
    assert grads["sink"][0] == 0


@pytest.mark.parametrize("dtype, ratio, csa", [(torch.bfloat16, 4, True), (torch.bfloat16, 8, False),
                                               (torch.float16, 4, True)])
def test_low_precision_against_fp32_reference(dtype, ratio, csa):
    """16-bit inputs vs the fp32 reference on the same rounded inputs (sink fp32, as in the model).

    Tolerance: the kernel keeps scores, softmax statistics and every accumulation in fp32, so its differences are
    roundings to the 16-bit format (unit roundoff u = 2^-9 for bf16, 2^-12 for fp16): the stored output and
    gradients (u relative), P and dS rounded before their tensor-core GEMMs (u relative per term of a convex-ish
    combination), and delta = rowsum(dO * O) taken from the rounded output. That is a few u of each tensor's scale;
    we allow 8u of its largest magnitude (measured: 1.1u-4.2u). The sink gradient is a sum over all B * L queries
    of p_sink * delta with strong cancellation, so its error is scaled by the root-sum-square of the per-query delta
    (independent roundings add in quadrature): 4u * rss(delta) per head (measured: 0.06u-1.25u).
    """
    u = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    case = make_case(32, packed=True, ratio=ratio, csa=csa, heads=4, seed=7)
    for name in ("q", "kv", "comp"):
        case[name] = case[name].to(dtype).float()  # the reference sees exactly the kernel's inputs
    out, grads = out_and_grads(triton_sparse_attention, case, 6, dtype=dtype, sink_dtype=torch.float32)
    ref, ref_grads = out_and_grads(sparse_attention, case, 6)
    assert out.dtype == dtype and grads["q"].dtype == dtype and grads["sink"].dtype == torch.float32
    for name, a, b in [("out", out, ref)] + [(n, grads[n], ref_grads[n]) for n in ("q", "kv", "comp")]:
        err = (a.float() - b).abs().max()
        assert err <= 8 * u * b.abs().max(), (name, err.item(), b.abs().max().item())
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9)).to(dtype).float().to(DEVICE)
    delta = (weight * ref.detach()).sum(-1)  # [B, L, H]
    rss = delta.pow(2).sum(dim=(0, 1)).sqrt()
    err = (grads["sink"] - ref_grads["sink"]).abs()
    assert (err <= 4 * u * rss).all(), (err.tolist(), rss.tolist())


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("halo", [0, 5])
def test_compressed_probs_equal_the_torch_teacher(packed, halo):
    """The indexer loss's teacher (head-mean probabilities of the selected rows) from the Triton kernel's
    log-normaliser equals the torch kernel's softmax, invalid and disallowed picks included (0)."""
    case = make_case(40, packed=packed, ratio=4, csa=True, halo=halo)
    leaves = {k: case[k] for k in ("q", "kv", "sink", "comp")}
    out_k, probs_k = attend(triton_sparse_attention, case, 6, leaves, compressed_probs=True)
    out_t, probs_t = attend(sparse_attention, case, 6, leaves, compressed_probs=True, chunk_size=16)
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs_k, probs_t, rtol=1e-5, atol=1e-6)
    assert (probs_t[case["topk"] < 0] == 0).all() and probs_t.sum() > 0


@pytest.mark.parametrize("earlier", [0, 3])
def test_hca_visits_only_the_documents_causal_rows(earlier):
    """HCA with the block's own windows last and per-chunk key floors (the model's metadata): each query's range is
    its documents' rows up to its causal prefix, and the result equals the reference over every row. With
    ``earlier`` rows before the block's own (a CP chunk continuing its first document), the first chunk starts there."""
    from dsv4.kernels.triton_sparse_attention import _hca_ranges
    from dsv4.model.sparse_attention import chunk_document_starts, document_floors

    ratio, chunk = 4, 8
    case = make_case(32, packed=True, ratio=ratio, seed=3)  # documents of 8, 12 and 9 tokens, then padding
    own = case["comp"].shape[1]
    if earlier:  # earlier windows of the first document precede the block's own (positions continue before 0)
        g = torch.Generator().manual_seed(4)
        case["comp"] = torch.cat([torch.randn(2, earlier, case["comp"].shape[-1], generator=g), case["comp"]], 1)
        first = case["q_seq"][:, :1].expand(-1, earlier)
        case["comp_seq"] = torch.cat([first, case["comp_seq"]], 1)
        case["comp_pos"] = torch.cat([torch.arange(earlier).expand(2, -1), case["comp_pos"] + earlier], 1)
        case["q_pos"] = case["q_pos"] + (case["q_seq"] == 1) * earlier * ratio
    rows = case["comp"].shape[1]
    starts = chunk_document_starts(case["q_seq"], case["q_pos"], chunk).tolist()
    floors = document_floors(starts, rows, own, ratio)
    first, end = _hca_ranges(2, 32, rows, ratio, own, floors, chunk, "cpu")
    # query 20's chunk (rows 16-23) begins with document 2 (row 8 -> window 2 + earlier); its causal prefix ends at
    # earlier + 21 // 4; query 2 precedes the first complete window of the block's own
    assert (int(first[0, 20]), int(end[0, 20])) == (earlier + 2, earlier + 5)
    assert int(end[0, 2]) == earlier and int(end[0, 3]) == earlier + 1
    assert_matches_reference(case, window=6, compressed_local_rows=own, key_floors=floors, chunk_size=chunk)

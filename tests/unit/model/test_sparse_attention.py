"""Reference sparse kernel vs a dense oracle (full [L, L_kv + P] scores with explicit boolean masks).

The oracle builds the masks straight from the attention rules:
window: same document id > 0, k <= q, q - k < W (linear rows), key not padding;
compressed: q_doc > 0, window id == q_doc, window position < (q_pos_doc + 1) // r, and for CSA the key is in the
query's top-k list. The sink is an extra logit column whose value slot is dropped.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.model.compressor import window_metadata
from dsv4.model.sparse_attention import sparse_attention

H, D = 2, 8


def dense_oracle(q, kv, sink, window, q_seq, q_pos, kv_seq, kv_pad, comp=None, comp_seq=None, comp_pos=None,
                 ratio=0, topk=None, offset=None):
    b, length = q.shape[:2]
    l_kv = kv.shape[1]
    offset = l_kv - length if offset is None else offset
    q_rows = offset + torch.arange(length)[:, None]
    k_rows = torch.arange(l_kv)[None, :]
    band = (k_rows <= q_rows) & (q_rows - k_rows < window)  # [L, L_kv]
    same_doc = (q_seq[:, :, None] == kv_seq[:, None, :]) & (q_seq[:, :, None] > 0)
    allowed = band[None] & same_doc & ~kv_pad[:, None, :]
    keys = kv
    if comp is not None:
        p = comp.shape[1]
        limit = torch.div(q_pos + 1, ratio, rounding_mode="floor")
        rule = (q_seq[:, :, None] > 0) & (comp_seq[:, None, :] == q_seq[:, :, None]) & (comp_pos[:, None, :] < limit[:, :, None])
        if topk is not None:
            picked = torch.zeros(b, length, p, dtype=torch.bool)
            for bi in range(b):
                for qi in range(length):
                    for i in topk[bi, qi].tolist():
                        if i >= 0:
                            picked[bi, qi, i] = True
            rule = rule & picked
        allowed = torch.cat((allowed, rule), dim=-1)
        keys = torch.cat((kv, comp), dim=1)
    scores = torch.einsum("blhd,bkd->blhk", q, keys) * D**-0.5
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    scores = torch.cat((scores, sink.view(1, 1, -1, 1).expand(b, length, -1, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]
    return torch.einsum("blhk,bkd->blhd", probs, keys)


def packed_meta(lengths, pad_tail):
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(pad_tail, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad_tail, dtype=torch.long)])
    return seq, pos


def make_case(length, packed, ratio, csa, seed=0, batch=2, k=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, H, D, generator=g)
    kv = torch.randn(batch, length, D, generator=g)
    sink = torch.randn(H, generator=g)
    if packed:
        seq, pos = packed_meta([8, 3 * 8, length - 8 - 24 - 4], 4)  # docs, then 4 pack-padding tokens
        seq, pos = seq.expand(batch, -1).clone(), pos.expand(batch, -1).clone()
    else:
        seq = torch.ones(batch, length, dtype=torch.long)
        pos = torch.arange(length).expand(batch, -1).clone()
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[-1, -5:] = True  # padded keys at the end of the last row
    pad[0, min(12, length - 1)] = True
    case = dict(q=q, kv=kv, sink=sink, q_seq=seq, q_pos=pos, kv_seq=seq, kv_pad=pad)
    if ratio:
        comp_seq, comp_pos = window_metadata(seq, pos, ratio)
        p = comp_seq.shape[1]
        case.update(comp=torch.randn(batch, p, D, generator=g), comp_seq=comp_seq, comp_pos=comp_pos, ratio=ratio)
        if csa:
            topk = torch.stack([torch.stack([torch.randperm(p, generator=g)[:k] for _ in range(length)]) for _ in range(batch)])
            drop = torch.rand(batch, length, topk.shape[-1], generator=g) < 0.3
            case["topk"] = topk.masked_fill(drop, -1)  # includes non-causal picks the kernel must reject
    return case


def run_kernel(case, window, chunk, checkpoint=None):
    return sparse_attention(
        case["q"], case["kv"], case["sink"], window=window, query_seq_ids=case["q_seq"], query_positions=case["q_pos"],
        kv_seq_ids=case["kv_seq"], kv_padding=case["kv_pad"], compressed=case.get("comp"),
        compressed_seq_ids=case.get("comp_seq"), compressed_positions=case.get("comp_pos"), ratio=case.get("ratio", 0),
        topk_indices=case.get("topk"), chunk_size=chunk, checkpoint=checkpoint,
    )


def run_oracle(case, window):
    return dense_oracle(case["q"], case["kv"], case["sink"], window, case["q_seq"], case["q_pos"], case["kv_seq"],
                        case["kv_pad"], case.get("comp"), case.get("comp_seq"), case.get("comp_pos"),
                        case.get("ratio", 0), case.get("topk"))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "kind, ratio, csa", [("swa", 0, False), ("csa", 4, True), ("hca", 8, False), ("hca16", 16, False)]
)
@pytest.mark.parametrize("chunk", [7, 64])
def test_matches_dense_oracle(kind, ratio, csa, packed, chunk):
    case = make_case(45, packed, ratio, csa)
    window = 6
    out = run_kernel(case, window, chunk)
    ref = run_oracle(case, window)
    assert torch.allclose(out, ref, atol=1e-5)


def test_gradients_match_dense_oracle_with_and_without_checkpoint():
    for ratio, csa in ((4, True), (8, False)):
        base = make_case(40, True, ratio, csa, seed=3)
        grads = []
        for fn in ("kernel", "kernel_nockpt", "oracle"):
            case = {k: (v.clone().requires_grad_(True) if k in ("q", "kv", "sink", "comp") else v) for k, v in base.items()}
            if fn == "oracle":
                out = run_oracle(case, 5)
            else:
                out = run_kernel(case, 5, 6, checkpoint=(fn == "kernel"))
            weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
            (out * weight).sum().backward()
            grads.append([case[k].grad for k in ("q", "kv", "sink", "comp")])
        for g_kernel in grads[:2]:
            for a, b in zip(g_kernel, grads[2]):
                assert torch.allclose(a, b, atol=1e-5)


def test_short_sequence_narrower_than_window():
    case = make_case(5, False, 0, False, batch=1)
    case["kv_pad"][:] = False
    assert torch.allclose(run_kernel(case, 16, 2), run_oracle(case, 16), atol=1e-5)


def test_halo_rows_with_query_offset_equal_slice_of_whole():
    """A later CP rank prepends the previous rank's last rows (halo) to kv and passes query_offset."""
    for ratio, csa in ((0, False), (4, True), (8, False)):
        case = make_case(48, True, ratio, csa, seed=4)
        whole = run_kernel(case, 6, 7)
        start, halo = 24, 5
        sub = sparse_attention(
            case["q"][:, start:], case["kv"][:, start - halo :], case["sink"], window=6,
            query_seq_ids=case["q_seq"][:, start:], query_positions=case["q_pos"][:, start:],
            kv_seq_ids=case["kv_seq"][:, start - halo :], kv_padding=case["kv_pad"][:, start - halo :],
            query_offset=halo, compressed=case.get("comp"), compressed_seq_ids=case.get("comp_seq"),
            compressed_positions=case.get("comp_pos"), ratio=ratio,
            topk_indices=None if not csa else case["topk"][:, start:], chunk_size=7,
        )
        assert torch.allclose(sub, whole[:, start:], atol=1e-6)


def test_sink_minus_inf_is_plain_softmax_and_large_sink_shrinks():
    case = make_case(30, False, 8, False, batch=1)
    case["kv_pad"][:] = False  # every query sees at least itself
    case["sink"] = torch.full((H,), float("-inf"))
    plain = run_kernel(case, 6, 8)
    # plain softmax over the allowed keys, written out for one query by hand
    q, kv, comp = case["q"][0], case["kv"][0], case["comp"][0]
    qi = 20  # window rows 15..20, compressed windows p < 21 // 8 = 2
    keys = torch.cat((kv[15:21], comp[:2]))
    logits = torch.einsum("hd,kd->hk", q[qi], keys) * D**-0.5
    expected = torch.softmax(logits, dim=-1) @ keys
    assert torch.allclose(plain[0, qi], expected, atol=1e-5)
    norms = []
    for s in (0.0, 2.0, 5.0, 50.0):
        case["sink"] = torch.full((H,), s)
        norms.append(run_kernel(case, 6, 8).norm(dim=-1))
    assert (norms[0] < plain.norm(dim=-1)).all()
    assert (norms[1] < norms[0]).all() and (norms[2] < norms[1]).all()
    assert norms[3].max() < 1e-12


def test_query_without_allowed_key_is_zero_with_finite_grads():
    for ratio, csa in ((0, False), (4, True), (8, False)):
        case = make_case(40, True, ratio, csa, batch=1, seed=5)
        for k in ("q", "kv", "sink", "comp"):
            if k in case:
                case[k].requires_grad_(True)
        out = run_kernel(case, 6, 16)
        pad_q = case["q_seq"][0] == 0
        assert pad_q.any() and torch.equal(out[0, pad_q], torch.zeros_like(out[0, pad_q]))
        out.sum().backward()
        for k in ("q", "kv", "sink", "comp"):
            if k in case:
                assert torch.isfinite(case[k].grad).all()


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_quadratic_intermediate():
    length, chunk, window = 512, 32, 16
    for ratio, csa in ((4, True), (128, False), (8, False)):
        case = make_case(length, False, ratio, csa, batch=1, k=8)
        with _LargestTensor() as probe:
            run_kernel(case, window, chunk)
        p = length // ratio
        bound = max(length * H * D, chunk * window * D, chunk * H * (window + (8 if csa else p)), chunk * p)
        assert probe.largest <= bound < length * length // 4, (ratio, probe.largest)


def test_window_and_document_rule_equals_seed_dense_mask():
    """SWA keys: the seed's packed dense mask (dsv4.cp masks, the reference's own rule) is the oracle.

    Packed row of three documents (one with per-document pad slots) plus pack padding; window 4. Attention with
    the seed's additive mask + the sink column must equal the gathered-band kernel for every real query.
    """
    from dsv4.cp import build_dsv4_cp_packed_causal_padding_mask

    g = torch.Generator().manual_seed(5)
    seq = torch.tensor([[1] * 8 + [2] * 8 + [3] * 4 + [0] * 4])
    pos = torch.tensor([list(range(8)) * 2 + list(range(4)) + [0] * 4])
    pad = torch.zeros_like(seq, dtype=torch.bool)
    pad[0, 13:16] = True  # document 2 has 5 real tokens and 3 pad slots
    pad[0, 20:] = True
    b, length, h, d, window = 1, seq.shape[1], 2, 8, 4
    q = torch.randn(b, length, h, d, generator=g)  # fp32: the kernel computes in fp32
    kv = torch.randn(b, length, d, generator=g)
    sink = torch.randn(h, generator=g)
    mask = build_dsv4_cp_packed_causal_padding_mask(
        position_ids=pos, packed_seq_ids=seq, dtype=torch.float64, device="cpu", cp_group=None,
        padding_mask=pad, sliding_window=window,
    )  # [B, 1, S, S]
    q64, kv64, sink64 = q.double(), kv.double(), sink.double()  # the oracle runs in fp64
    scores = torch.einsum("bshd,btd->bhst", q64, kv64) * d**-0.5 + mask
    scores = torch.cat([scores, sink64.view(1, h, 1, 1).expand(b, h, length, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]
    dense = torch.einsum("bhst,btd->bshd", probs, kv64).float()
    out = sparse_attention(q, kv, sink, window=window, query_seq_ids=seq, query_positions=pos, kv_seq_ids=seq,
                           kv_padding=pad, chunk_size=5)
    real = seq[0] > 0  # pack-padding queries have no key at all (the dense mask gives them only the sink too)
    torch.testing.assert_close(out[:, real], dense[:, real], atol=1e-6, rtol=1e-5)
    assert torch.equal(out[:, ~real], torch.zeros_like(out[:, ~real]))


def _every_row_then_local_rows(base, chunk):
    """``[output, grad q, grad kv, grad sink, grad comp]`` of ``base`` (window 5; its CSA selection if it has one)
    with ``compressed_local_rows`` None (every compressed row), then with all of them marked local."""
    results = []
    for local in (None, base["comp"].shape[1]):
        case = {k: (v.clone().requires_grad_(True) if k in ("q", "kv", "sink", "comp") else v) for k, v in base.items()}
        out = sparse_attention(
            case["q"], case["kv"], case["sink"], window=5, query_seq_ids=case["q_seq"], query_positions=case["q_pos"],
            kv_seq_ids=case["kv_seq"], kv_padding=case["kv_pad"], compressed=case["comp"],
            compressed_seq_ids=case["comp_seq"], compressed_positions=case["comp_pos"], ratio=case["ratio"],
            chunk_size=chunk, topk_indices=case.get("topk"), compressed_local_rows=local,
        )
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append([out.detach()] + [case[k].grad for k in ("q", "kv", "sink", "comp")])
    return results


@pytest.mark.parametrize("ratio, packed", [(8, True), (16, False)])  # documents start on multiples of r
def test_hca_causal_prefix_equals_every_row(ratio, packed):
    """``compressed_local_rows``: an HCA chunk scores only the compressed rows before its last query; same output
    and gradients as scoring every row."""
    results = _every_row_then_local_rows(make_case(45, packed, ratio, False, seed=4), chunk=7)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_stable_topk_is_the_head_of_a_stable_sort():
    from dsv4.model.sparse_attention import stable_topk

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (5, 7, 40), generator=g).float()  # many ties
    scores[scores == -3] = float("-inf")
    scores[0, 0] = float("-inf")  # a query with nothing to select
    for k in (1, 5, 40, 64):
        values, order = scores.sort(dim=-1, descending=True, stable=True)
        expected = order[..., :k].masked_fill(torch.isneginf(values[..., :k]), -1)
        assert torch.equal(stable_topk(scores, k), expected), k


def test_chunk_document_floors_by_hand():
    from dsv4.model.sparse_attention import NO_DOCUMENT, chunk_document_starts, document_floors

    # ratio 4, 2 earlier rows (the block starts inside a document), then 8 local windows over 32 local rows:
    # local docs: rows 0-7 continue the earlier document, rows 8-15 doc 2, rows 16-23 padding, rows 24-31 doc 3
    seq = torch.tensor([[1] * 8 + [2] * 8 + [0] * 8 + [3] * 8])
    pos = torch.tensor([list(range(40, 48)) + list(range(8)) + [0] * 8 + list(range(8))])
    starts = chunk_document_starts(seq, pos, chunk_size=8).tolist()
    assert starts == [[-40, 8, NO_DOCUMENT, 24]]
    # chunk 0: the earlier document -> 0; chunk 1: doc 2 starts at row 8 -> 2 + 8 // 4 = 4; chunk 2: only
    # padding -> 10 (nothing); chunk 3: doc 3 at row 24 -> 2 + 6 = 8
    assert document_floors(starts, rows=10, local_rows=8, ratio=4) == [[0, 4, 10, 8]]
    assert document_floors(chunk_document_starts(seq, pos, 16).tolist(), rows=10, local_rows=8, ratio=4) == [[0, 8]]
    assert document_floors(starts, rows=10, local_rows=None, ratio=4) == [[0, 0, 0, 0]]
    # only 1 of the 2 earlier rows is this row's (the first is left padding): the continuing chunk starts at row 1
    assert document_floors(starts, rows=10, local_rows=8, ratio=4, earlier=[1]) == [[1, 4, 10, 8]]
    # two batch rows: each row its own floors (the second row is one document from row 0 on)
    seq2 = torch.cat([seq, torch.tensor([[5] * 32])])
    pos2 = torch.cat([pos, torch.arange(32)[None]])
    assert chunk_document_starts(seq2, pos2, 8).tolist() == [[-40, 8, NO_DOCUMENT, 24], [0, 0, 0, 0]]
    assert document_floors(chunk_document_starts(seq2, pos2, 8).tolist(), 10, 8, 4) == [[0, 4, 10, 8], [2, 2, 2, 2]]


def test_rows_are_scored_apart_only_when_batching_would_waste_keys():
    from dsv4.model.sparse_attention import floor_groups

    # two rows needing keys [0, 100) and [90, 100): batched they would score 200 keys for 110 -> apart
    assert floor_groups([0, 90], 100) == [(0, [0]), (90, [1])]
    # [0, 100) and [20, 100): 200 keys for 180 -> one batched call from the lower floor
    assert floor_groups([0, 20], 100) == [(0, None)]
    assert floor_groups([7, 7, 7], 100) == [(7, None)] and floor_groups([], 5) == [(0, None)]
    # rows of padding only (floor = end) cost nothing on their own
    assert floor_groups([0, 100, 100], 100) == [(0, [0]), (100, [1, 2])]


@pytest.mark.parametrize("packed", [True, False])
def test_csa_takes_only_its_chunk_rows_same_results(packed):
    """``compressed_local_rows`` with a CSA selection: each chunk gathers from the rows of its documents up to its
    causal prefix (selections outside them, which the random picks include, are rows no query may see); same output
    and gradients as gathering from every row."""
    base = make_case(45, packed, 4, True, seed=6)
    results = _every_row_then_local_rows(base, chunk=3)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][0], run_oracle(base, 5), rtol=1e-5, atol=1e-5)


class _ShapeCounter(TorchDispatchMode):
    """Counts the aten ops whose output has ``shape``."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape and func.__name__.startswith("new_zeros"):
            self.count += 1
        return out


def test_csa_backward_allocates_one_gradient_of_the_compressed_rows():
    """A packed row of 8 documents, 16 query chunks: every chunk's gather of selected rows used to zero-fill a
    gradient of ALL compressed rows in backward (O(P) per chunk); bounded, the chunks' gradients go into one."""
    length, chunk = 256, 16
    seq, pos = packed_meta([32] * 8, 0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, length, H, D, generator=g, requires_grad=True)
    kv = torch.randn(1, length, D, generator=g, requires_grad=True)
    comp_seq, comp_pos = window_metadata(seq[None], pos[None], 4)
    comp = torch.randn(1, comp_seq.shape[1], D, generator=g, requires_grad=True)
    topk = torch.randint(0, comp_seq.shape[1], (1, length, 4), generator=g)
    counts = {}
    for local in (None, comp_seq.shape[1]):
        out = sparse_attention(q, kv, torch.zeros(H), window=8, query_seq_ids=seq[None], query_positions=pos[None],
                               kv_seq_ids=seq[None], compressed=comp, compressed_seq_ids=comp_seq,
                               compressed_positions=comp_pos, ratio=4, topk_indices=topk, chunk_size=chunk,
                               compressed_local_rows=local)
        with _ShapeCounter(comp.shape) as counter:
            (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        counts[local] = counter.count
    assert counts[None] == length // chunk and counts[comp_seq.shape[1]] == 1, counts

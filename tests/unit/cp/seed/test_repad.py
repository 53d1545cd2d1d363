"""Packed DSV4 repad + contiguous CP shard of the seed API, single process with a pretend mesh."""

import copy
import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cp import (
    ContextParallelSharder,
    _repad_dsv4_packed_batch,
    build_packed_seq_ids,
    contiguous_local_indices,
    make_dsv4_contiguous_shard_cp_batch_and_ctx,
)
from tests.conftest import FakeMesh

PAD = -1000


def _seed_repad_oracle(input_ids, labels, seq_lens, seq_lens_padded, cp_size, m, pad_id=0):
    """Seed algorithm 2.7 as the plain per-row, per-document loop (test oracle)."""
    rows_ids, rows_lab, rows_pos, rows_pad, rows_seq, new_real, new_padded = [], [], [], [], [], [], []
    in_pos = torch.full(input_ids.shape, -1, dtype=torch.long)
    for b in range(input_ids.shape[0]):
        real = [max(v, 0) for v in seq_lens[b].tolist() if v != PAD]
        padded = [max(v, 0) for v in seq_lens_padded[b].tolist() if v != PAD]
        padded += real[len(padded) :]
        ids, lab, pos, pad, seq = [], [], [], [], []
        old, new = 0, 0
        for k, n in enumerate(real):
            stride = max(padded[k], n)
            new_len = n + (-n) % m
            ids += input_ids[b, old : old + n].tolist() + [pad_id] * (new_len - n)
            lab += labels[b, old : old + n].tolist() + [-100] * (new_len - n)
            pos += list(range(new_len))
            pad += [False] * n + [True] * (new_len - n)
            seq += [k + 1] * new_len
            in_pos[b, old : old + n] = torch.arange(new, new + n)
            old += stride
            new += new_len
        rows_ids.append(ids), rows_lab.append(lab), rows_pos.append(pos), rows_pad.append(pad), rows_seq.append(seq)
        new_real.append(real), new_padded.append([n + (-n) % m for n in real])
    width = max(max(len(r) for r in rows_ids), 1)
    total = width + (-width) % (cp_size * m)

    def stack(rows, fill):
        return torch.tensor([r + [fill] * (total - len(r)) for r in rows])

    d_max = max(len(r) for r in new_real)
    return {
        "input_ids": stack(rows_ids, pad_id),
        "labels": stack(rows_lab, -100),
        "position_ids": stack(rows_pos, 0),
        "padding_mask": stack(rows_pad, True),
        "packed_seq_ids": stack(rows_seq, 0),
        "seq_lens": torch.tensor([r + [PAD] * (d_max - len(r)) for r in new_real]),
        "seq_lens_padded": torch.tensor([r + [PAD] * (d_max - len(r)) for r in new_padded]),
    }, in_pos


def _packed_batch(doc_rows, width, *, spans_extra=None, seed=0):
    """Rows of documents laid end to end with optional old per-document padding; labels = ids + 1000 (-100 on pads)."""
    g = torch.Generator().manual_seed(seed)
    b = len(doc_rows)
    input_ids = torch.randint(1, 50, (b, width), generator=g)
    labels = torch.full((b, width), -100)
    d = max(len(r) for r in doc_rows)
    seq_lens = torch.full((b, d), PAD)
    seq_lens_padded = torch.full((b, d), PAD)
    for i, docs in enumerate(doc_rows):
        off = 0
        for k, n in enumerate(docs):
            extra = spans_extra[i][k] if spans_extra else 0
            labels[i, off : off + n] = input_ids[i, off : off + n] + 1000
            seq_lens[i, k], seq_lens_padded[i, k] = n, n + extra
            off += n + extra
        assert off <= width
    return {"input_ids": input_ids, "labels": labels, "seq_lens": seq_lens, "seq_lens_padded": seq_lens_padded}


def _shard_all_ranks(batch, cp_size, pad_multiple):
    outs, layouts = [], []
    for r in range(cp_size):
        _, out, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(
            FakeMesh(cp_size, r), None, copy.deepcopy(batch), pad_multiple=pad_multiple
        )
        outs.append(out)
        layouts.append(layout)
    return outs, layouts


def test_worked_case_two_ranks():
    # docs of 3 and 5 real tokens with old per-document padding to 4 and 8; multiple 4; CP 2
    batch = {
        "input_ids": torch.arange(1, 13).view(1, 12),
        "labels": torch.tensor([[101, 102, 103, -100, 105, 106, 107, 108, 109, -100, -100, -100]]),
        "seq_lens": torch.tensor([[3, 5]]),
        "seq_lens_padded": torch.tensor([[4, 8]]),
        "attention_mask": torch.ones(1, 12, dtype=torch.long),
    }
    outs, layouts = _shard_all_ranks(batch, 2, 4)
    full = {k: torch.cat([o[k] for o in outs], dim=1) for k in ("input_ids", "labels", "position_ids", "padding_mask", "packed_seq_ids")}
    assert full["input_ids"].tolist() == [[1, 2, 3, 0, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0]]
    assert full["labels"].tolist() == [[101, 102, 103, -100, 105, 106, 107, 108, 109] + [-100] * 7]
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0]]
    assert full["padding_mask"].int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]]
    assert full["packed_seq_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0]]
    for out in outs:
        assert out["seq_lens"].tolist() == [[3, 5]]  # global metadata, not sharded
        assert out["seq_lens_padded"].tolist() == [[4, 8]]
        assert out["qkv_format"] == "thd"
        assert "attention_mask" not in out
        assert out["_dsv4_cp_group"] is None  # a pretend mesh has no process group
        assert out["input_ids"].shape == (1, 8)
    assert layouts[0].padded_seq_len == 16 and layouts[0].original_seq_len is None
    assert layouts[0].input_token_stream_positions.tolist() == [[0, 1, 2, -1, 4, 5, 6, 7, 8, -1, -1, -1]]


def test_matches_seed_loop_oracle_on_random_batches():
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        b = int(torch.randint(1, 4, (1,), generator=g))
        rows, extras = [], []
        for _ in range(b):
            d = int(torch.randint(1, 5, (1,), generator=g))
            rows.append(torch.randint(0, 9, (d,), generator=g).tolist())
            extras.append(torch.randint(0, 3, (d,), generator=g).tolist())
        width = max(sum(r) + sum(e) for r, e in zip(rows, extras)) + int(torch.randint(0, 3, (1,), generator=g))
        batch = _packed_batch(rows, width, spans_extra=extras, seed=trial)
        cp_size, m = [(1, 2), (2, 2), (2, 4), (4, 3)][trial % 4]
        expected, exp_pos = _seed_repad_oracle(
            batch["input_ids"], batch["labels"], batch["seq_lens"], batch["seq_lens_padded"], cp_size, m
        )
        out, _, in_pos = _repad_dsv4_packed_batch(
            copy.deepcopy(batch), cp_size=cp_size, pad_multiple=m, padding_token_id=0
        )
        for key, value in expected.items():
            assert torch.equal(out[key].long(), value.long()), (trial, key)
        assert torch.equal(in_pos, exp_pos)


def test_sentinel_and_zero_length_documents_keep_ids():
    batch = _packed_batch([[3, 0, 2]], 8)
    batch["seq_lens"] = torch.tensor([[3, 0, PAD, 2]])
    batch["seq_lens_padded"] = torch.tensor([[3, 0, PAD, 2]])
    out, _, _ = _repad_dsv4_packed_batch(batch, cp_size=1, pad_multiple=4, padding_token_id=0)
    assert out["packed_seq_ids"].tolist() == [[1, 1, 1, 1, 3, 3, 3, 3]]  # zero-length doc 2 uses an id
    assert out["seq_lens"].tolist() == [[3, 0, 2]]
    assert out["seq_lens_padded"].tolist() == [[4, 0, 4]]


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=5), min_size=1, max_size=3),
    cp_size=st.sampled_from([1, 2, 4]),
    pad_multiple=st.sampled_from([1, 8, 128]),
    slack=st.integers(0, 5),
)
def test_shard_then_restore_returns_caller_tensors(docs, cp_size, pad_multiple, slack):
    width = max(sum(r) for r in docs) + slack
    if width == 0:
        width = 1
    batch = _packed_batch(docs, width)
    caller = copy.deepcopy(batch)
    m = max(pad_multiple, 2)
    if cp_size == 1:
        _, out, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(FakeMesh(1, 0), None, batch, pad_multiple=pad_multiple)
        assert layout is None and out["qkv_format"] == "thd"
        assert torch.equal(out["input_ids"], caller["input_ids"])  # native THD route: unchanged
        return
    outs, layouts = _shard_all_ranks(batch, cp_size, pad_multiple)
    layout = layouts[0]
    total = layout.padded_seq_len
    assert total % (cp_size * m) == 0
    local = total // cp_size
    assert all(o["input_ids"].shape[1] == local and local % m == 0 for o in outs)
    full = {k: torch.cat([o[k] for o in outs], dim=1) for k in ("input_ids", "labels", "packed_seq_ids", "position_ids")}
    # restore to caller coordinates: every covered column comes back, the rest is the fill
    pos = layout.input_token_stream_positions
    for key, fill in (("input_ids", -7), ("labels", -100)):
        restored = layout.restore(full[key], fill=fill)
        covered = pos >= 0
        assert torch.equal(restored[covered], caller[key][covered])
        assert bool((restored[~covered] == fill).all())
    # no labelled token lost, none invented
    assert int((full["labels"] != -100).sum()) == int((caller["labels"] != -100).sum())
    # ids agree with the rebuilt metadata; documents start on multiples of m; positions are document-local
    assert torch.equal(build_packed_seq_ids(outs[0]["seq_lens_padded"], seq_len=total), full["packed_seq_ids"])
    ids, positions = full["packed_seq_ids"], full["position_ids"]
    starts = (ids > 0) & (positions == 0)
    assert bool((starts.nonzero()[:, 1] % m == 0).all())
    # the sharder verbs: shard a caller tensor on every rank, then restore
    values = torch.randn(caller["input_ids"].shape + (3,))
    shards = []
    for r in range(cp_size):
        sharder = ContextParallelSharder(
            shard_batch=functools.partial(make_dsv4_contiguous_shard_cp_batch_and_ctx, pad_multiple=pad_multiple),
            device_mesh=FakeMesh(cp_size, r),
            local_token_global_indices=contiguous_local_indices,
        )
        sharder.shard(copy.deepcopy(caller))
        shards.append(sharder.shard_token_tensor(values, fill=0.0))
    back = layout.restore(torch.cat(shards, dim=1), fill=0.0)
    assert torch.equal(back, torch.where((pos >= 0).unsqueeze(-1), values, torch.zeros_like(values)))


def _count_host_syncs(fn):
    """Number of tensor -> Python scalar reads (``aten._local_scalar_dense``: .item(), int(), bool())."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Counter.count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.count


def test_host_syncs_do_not_grow_with_document_count():
    """The repad + shard hot path reads a constant number of scalars, whatever the number of documents."""

    def run(docs_per_row):
        lengths = [[5] * docs_per_row for _ in range(3)]
        batch = _packed_batch(lengths, 5 * docs_per_row + 3)
        return _count_host_syncs(
            lambda: make_dsv4_contiguous_shard_cp_batch_and_ctx(FakeMesh(4, 1), None, batch, pad_multiple=8)
        )

    few, many = run(2), run(64)
    assert few == many
    assert many <= 8

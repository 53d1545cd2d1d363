"""CP collectives and the sharder on real gloo groups (2 and 4 ranks), checked against single-process oracles.

Every rank builds all ranks' inputs from the same seed, so it can compute the oracle locally.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed


def _inputs(world_size, length=5, k=3):
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(2, length, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]
    ws = [torch.randn(2, length * world_size, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]
    hs = [torch.randn(2, k, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]
    vs = [torch.randn(2, length, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]
    return xs, ws, hs, vs


def _collectives_body(rank, world_size):
    from dsv4.cp import CPContext, dsv4_cp_all_gather, dsv4_cp_all_gather_metadata, dsv4_cp_rank, dsv4_cp_size

    group = dist.new_group(list(range(world_size)))
    k, length = 3, 5
    xs, ws, hs, vs = _inputs(world_size, length, k)
    out = {"rank": dsv4_cp_rank(group), "size": dsv4_cp_size(group)}

    # differentiable all-gather: rank r's loss is sum(gathered**2 * w_r)
    x = xs[rank].clone().requires_grad_(True)
    gathered = dsv4_cp_all_gather(x, dim=1, cp_group=group)
    (gathered.pow(2) * ws[rank]).sum().backward()
    out["gathered"] = gathered.detach()
    out["gather_grad"] = x.grad.clone()

    # seed statement: the same replicated loss on every rank gives C * w[own slice]
    x2 = xs[rank].clone().requires_grad_(True)
    (dsv4_cp_all_gather(x2, dim=1, cp_group=group) * ws[0]).sum().backward()
    out["replicated_grad"] = x2.grad.clone()

    # halo exchange through CPContext: loss_r = sum(halo * h_r) + sum(x * v_r)
    ctx = CPContext(group)
    x3 = xs[rank].clone().requires_grad_(True)
    halo = ctx.halo_exchange(x3, k, dim=1)
    ((halo * hs[rank]).sum() + (x3 * vs[rank]).sum()).backward()
    out["halo"] = halo.detach()
    out["halo_grad"] = x3.grad.clone()
    out["traffic"] = ctx.traffic.as_dict()

    # metadata gather keeps dtype (bool travels as uint8) and rank order
    meta = torch.tensor([[rank, rank + 10]], dtype=torch.long)
    out["meta"] = dsv4_cp_all_gather_metadata(meta, dim=1, cp_group=group)
    out["meta_bool"] = dsv4_cp_all_gather_metadata(torch.tensor([[rank % 2 == 0]]), dim=1, cp_group=group)

    # causal gather: rank r asks for global rows [starts[r], r*n); loss_r = sum(received * u_r)
    starts = _preceding_starts(world_size, length)
    x4 = xs[rank].clone().requires_grad_(True)
    from dsv4.parallel.cp.collectives import row_plan
    from dsv4.parallel.cp.routes import preceding_transfers

    rows = x4.shape[0]
    transfers, out_len = preceding_transfers([list(starts)] * rows, [[r] for r in range(world_size)],
                                             [(r, 0) for r in range(world_size)], length)
    got = ctx.exchange_rows(x4, row_plan(transfers, rank, rows, out_len[rank]), dim=1, kind="preceding")
    (got * _preceding_weights(world_size, length, rank, got.shape[1])).sum().backward()
    out["preceding"] = got.detach()
    out["preceding_grad"] = x4.grad.clone()
    out["traffic_after"] = ctx.traffic.as_dict()
    return out


def _preceding_starts(world_size, length):
    # rank 0: nothing; rank 1: its predecessor's last 2 rows; rank 2: from global row 3; rank 3: nothing earlier
    return [0, length - 2, 3, 3 * length][:world_size]


def _preceding_weights(world_size, length, rank, rows):
    g = torch.Generator().manual_seed(99 + rank)
    return torch.randn(2, rows, 4, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_and_halo_match_single_process_oracle(world_size):
    results = run_on_ranks(_collectives_body, world_size)
    k, length = 3, 5
    xs, ws, hs, vs = _inputs(world_size, length, k)
    full = torch.cat(xs, dim=1)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["size"] == world_size
        torch.testing.assert_close(res["gathered"], full, rtol=0, atol=0)
        own = slice(rank * length, (rank + 1) * length)
        expected = sum(2 * xs[rank] * w[:, own] for w in ws)
        torch.testing.assert_close(res["gather_grad"], expected)
        torch.testing.assert_close(res["replicated_grad"], world_size * ws[0][:, own])
        # halo: the previous rank's last k rows, zeros on rank 0
        expected_halo = torch.zeros(2, k, 4, dtype=torch.float64) if rank == 0 else xs[rank - 1][:, -k:]
        torch.testing.assert_close(res["halo"], expected_halo, rtol=0, atol=0)
        expected_grad = vs[rank].clone()
        if rank + 1 < world_size:
            expected_grad[:, -k:] += hs[rank + 1]
        torch.testing.assert_close(res["halo_grad"], expected_grad)
        nbytes = 2 * k * 4 * 8
        traffic = res["traffic"]
        assert traffic["halo"] == {
            "calls": 1,
            "bytes_sent": nbytes if rank + 1 < world_size else 0,
            "bytes_received": nbytes if rank > 0 else 0,
        }
        assert traffic["halo.backward"]["bytes_sent"] == (nbytes if rank > 0 else 0)
        assert res["meta"].tolist() == [sum(([r, r + 10] for r in range(world_size)), [])]
        assert res["meta_bool"].dtype == torch.bool
        assert res["meta_bool"].tolist() == [[r % 2 == 0 for r in range(world_size)]]
        # causal gather values: exactly the requested global rows, own rows last
        starts = _preceding_starts(world_size, length)
        torch.testing.assert_close(res["preceding"], full[:, starts[rank] : (rank + 1) * length], rtol=0, atol=0)
        # gradient: every rank whose request covers my rows sends its weights back
        expected = torch.zeros(2, length, 4, dtype=torch.float64)
        for j in range(rank, world_size):
            u = _preceding_weights(world_size, length, j, (j + 1) * length - starts[j])
            lo = max(starts[j], rank * length)
            if lo < (rank + 1) * length:
                expected[:, lo - rank * length :] += u[:, lo - starts[j] : (rank + 1) * length - starts[j]]
        torch.testing.assert_close(res["preceding_grad"], expected)
        received = (rank * length - starts[rank]) * 2 * 4 * 8
        assert res["traffic_after"]["preceding"]["bytes_received"] == received


def _packed_batch(world_size):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 100, (2, 40), generator=g)
    labels = ids.clone()
    seq_lens = torch.tensor([[5, 9, 13, -1000], [1, 17, 3, 8]])
    for b, row in enumerate(seq_lens.tolist()):
        used = sum(v for v in row if v > 0)
        labels[b, used:] = -100
    return {"input_ids": ids, "labels": labels, "seq_lens": seq_lens}


def _sharder_body(rank, world_size, pad_multiple):
    from dsv4.cp import (
        build_dsv4_cp_packed_causal_padding_mask,
        dsv4_cp_sharder,
    )

    group = dist.new_group(list(range(world_size)))
    config = type("C", (), {"compress_ratios": [pad_multiple]})()
    sharder = dsv4_cp_sharder(config, group)
    _, local = sharder.shard(_packed_batch(world_size))
    assert local["_dsv4_cp_group"] is group
    mask = build_dsv4_cp_packed_causal_padding_mask(
        position_ids=local["position_ids"], packed_seq_ids=local["packed_seq_ids"], dtype=torch.float32,
        device="cpu", cp_group=group, padding_mask=local["padding_mask"], sliding_window=6,
    )
    # gather per-token values back to caller coordinates; the replicated loss gradient is C x
    values = (local["input_ids"].double() * 0.5).requires_grad_(True)
    restored = sharder.gather_token_tensor(values, trim=True, fill=-1.0)
    (restored * torch.arange(40, dtype=torch.float64)).sum().backward()
    return {
        "local": {k: v for k, v in local.items() if isinstance(v, torch.Tensor)},
        "mask": mask,
        "restored": restored.detach(),
        "grad": values.grad,
        "layout_positions": sharder.shard_layout.input_token_stream_positions,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_mask_metadata_gather_and_token_gather(world_size):
    from dsv4.cp import build_dsv4_cp_packed_causal_padding_mask, make_dsv4_contiguous_shard_cp_batch_and_ctx
    from tests.conftest import FakeMesh

    pad_multiple = 8 if world_size == 2 else 2  # multiple 8, and 2 (so documents span rank boundaries)
    results = run_on_ranks(_sharder_body, world_size, args=(pad_multiple,))
    # single-process oracle: the full repadded row (from a pretend-mesh shard of every rank, concatenated)
    shards = [
        make_dsv4_contiguous_shard_cp_batch_and_ctx(
            FakeMesh(world_size, r), None, copy.deepcopy(_packed_batch(world_size)), pad_multiple=pad_multiple
        )[1]
        for r in range(world_size)
    ]
    full = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("position_ids", "packed_seq_ids", "padding_mask", "input_ids")}
    oracle = build_dsv4_cp_packed_causal_padding_mask(
        position_ids=full["position_ids"], packed_seq_ids=full["packed_seq_ids"], dtype=torch.float32,
        device="cpu", cp_group=None, padding_mask=full["padding_mask"], sliding_window=6,
    )
    local_len = full["input_ids"].shape[1] // world_size
    batch = _packed_batch(world_size)
    positions = results[0]["layout_positions"]
    for rank, res in enumerate(results):
        rows = slice(rank * local_len, (rank + 1) * local_len)
        torch.testing.assert_close(res["mask"], oracle[:, :, rows], rtol=0, atol=0)
        torch.testing.assert_close(res["local"]["input_ids"], full["input_ids"][:, rows])
        expected = torch.where(positions >= 0, batch["input_ids"].double() * 0.5, torch.full((2, 40), -1.0, dtype=torch.float64))
        torch.testing.assert_close(res["restored"], expected)
        # grad of column j's value = C * weight of its caller column (0 for slots no caller column maps to)
        weight_padded = torch.zeros(2, full["input_ids"].shape[1], dtype=torch.float64)
        weight_padded.scatter_(1, positions.clamp_min(0), torch.where(positions >= 0, torch.arange(40.0, dtype=torch.float64).expand(2, 40), 0.0))
        torch.testing.assert_close(res["grad"], world_size * weight_padded[:, rows])


def _sync_body(rank, world_size):
    from dsv4.cp import make_dsv4_contiguous_shard_cp_batch_and_ctx

    group = dist.new_group(list(range(world_size)))
    lengths = [[3], [3, 9, 17]][rank % 2]  # rank 1 needs a longer row
    width = 40
    batch = {
        "input_ids": torch.ones(1, width, dtype=torch.long),
        "labels": torch.full((1, width), -100),
        "seq_lens": torch.tensor([lengths]),
    }
    plain = make_dsv4_contiguous_shard_cp_batch_and_ctx(group, None, copy.deepcopy(batch), pad_multiple=8)[2]
    synced = make_dsv4_contiguous_shard_cp_batch_and_ctx(
        group, None, copy.deepcopy(batch), pad_multiple=8, sync_packed_length=True
    )[2]
    return plain.padded_seq_len, synced.padded_seq_len


@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_packed_length_max_reduce(world_size):
    results = run_on_ranks(_sync_body, world_size)
    plain = [p for p, _ in results]
    synced = {s for _, s in results}
    # rank 0: 8 -> multiple of C*8; rank 1: 8+16+24 = 48 -> multiple of C*8
    assert plain[0] == world_size * 8 and plain[1] == 48 + (-48) % (world_size * 8)
    assert synced == {max(plain)}


def _chunk_case(world_size):
    """Whole rows G [2, 2C * 3, 4] and, per (row b, chunk v), the first global row the chunk needs and whether its
    halo (2 rows) arrives; every rank builds the same."""
    g = torch.Generator().manual_seed(77)
    n, chunks = 3, 2 * world_size
    whole = torch.randn(2, chunks * n, 4, generator=g, dtype=torch.float64)
    starts = [[max(0, v * n - 4) for v in range(chunks)], [0 if v % 2 else v * n for v in range(chunks)]]
    halo_to = [(b, v) for v in range(1, chunks) for b in range(2) if (b + v) % 2 == 0]
    return whole, starts, halo_to, n


def _weights(rank, rows, length):
    return torch.randn(rows, length, 4, generator=torch.Generator().manual_seed(500 + rank), dtype=torch.float64)


def _started_body(rank, world_size):
    from dsv4.cp import CPContext
    from dsv4.parallel.cp.collectives import HaloRoute, row_plan
    from dsv4.parallel.cp.routes import preceding_transfers
    from dsv4.parallel.cp.layout import CPLayout

    layout = CPLayout(world_size, "full")
    ctx = CPContext(dist.new_group(list(range(world_size))), balance="full")
    whole, starts, halo_to, n = _chunk_case(world_size)
    owners = [layout.owner(v) for v in range(layout.num_chunks)]
    transfers, out_len = preceding_transfers(starts, [layout.chunks(r) for r in range(world_size)], owners, n)
    plan = row_plan(transfers, rank, 4, out_len[rank])
    route = HaloRoute(tuple((owners[v - 1][0], owners[v - 1][1] * 2 + b, owners[v][0], owners[v][1] * 2 + b)
                            for b, v in halo_to))
    x = layout.cut(whole, rank).requires_grad_(True)
    # both in flight at once, between the same pairs of ranks, waited for in the reverse order
    gather = ctx.start_exchange_rows(x, plan, dim=1, kind="preceding")
    halo = ctx.start_halo_exchange(x, 2, dim=1, kind="halo", route=route)
    got_halo, got = halo.wait(), gather.wait()
    ((got * _weights(rank, 4, got.shape[1])).sum() + (got_halo * _weights(100 + rank, 4, 2)).sum()).backward()
    return {"gather": got.detach(), "halo": got_halo.detach(), "grad": x.grad, "wait": ctx.traffic.wait_seconds()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_started_row_exchanges_in_the_balanced_layout_match_the_oracle(world_size):
    """Row exchanges between head-tail chunks (per-row needs, left-padded results, halos between any two chunks,
    local copies on one rank), started together and waited for out of order, equal the single-process oracle;
    gradients return to every source row."""
    from dsv4.parallel.cp.layout import CPLayout

    results = run_on_ranks(_started_body, world_size)
    layout = CPLayout(world_size, "full")
    whole, starts, halo_to, n = _chunk_case(world_size)
    grad = torch.zeros_like(whole)
    for rank, res in enumerate(results):
        rows = layout.local_rows(rank, 2)
        width = res["gather"].shape[1]
        assert width == n + max(v * n - starts[b][v] for b, v in rows)
        w, w_halo = _weights(rank, 4, width), _weights(100 + rank, 4, 2)
        for i, (b, v) in enumerate(rows):
            need = (v + 1) * n - starts[b][v]
            expected = torch.zeros(width, 4, dtype=torch.float64)
            expected[width - need:] = whole[b, starts[b][v]:(v + 1) * n]
            torch.testing.assert_close(res["gather"][i], expected, rtol=0, atol=0)
            grad[b, starts[b][v]:(v + 1) * n] += w[i, width - need:]
            fed = (b, v) in halo_to
            expected_halo = whole[b, v * n - 2:v * n] if fed else torch.zeros(2, 4, dtype=torch.float64)
            torch.testing.assert_close(res["halo"][i], expected_halo, rtol=0, atol=0)
            if fed:
                grad[b, v * n - 2:v * n] += w_halo[i]
        assert res["wait"] >= 0
    got = layout.assemble(torch.stack([res["grad"] for res in results]))
    torch.testing.assert_close(got, grad)

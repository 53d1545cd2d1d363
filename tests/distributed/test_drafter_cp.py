"""The DSpark drafter under context parallelism (dsv4/parallel/dspark_cp.py) on 2 and 4 gloo ranks.

Two whole rows of 64 positions (v41_tiny's drafter, window 8, blocks of 5): documents that cross chunk boundaries,
one beginning 3 tokens before a boundary, unsupervised stretches, and fixed anchors right after boundaries (their
windows reach back), a few before them (their teachers lie beyond), one in a document begun just before a boundary
and an unused slot. The same random target features feed every layout. Asserted: the loss numerator and weight summed
over the ranks and every drafter gradient summed over the ranks equal one process (1e-5); the bytes each rank
receives of the drafter's two exchanges (the context K = V each stage reads before its chunk, and its gradients back;
the teachers after it) equal a count made here from the blocks alone: the distinct rows outside the chunk that some
block of it reads, times the row's bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

LENGTH = 64
WINDOW = 8
ANCHORS = [[16, 17, 30, 33, 40, 47, 58, -1], [12, 15, 16, 29, 31, 32, 45, 49]]


def _config():
    from dsv4.config import DSV4Config

    return DSV4Config.preset("v41_tiny", engram_layer_ids=[], engram_num_embeddings=[], sliding_window=WINDOW)


def _rows():
    gen = torch.Generator().manual_seed(2)
    seq = torch.tensor([[1] * 20 + [2] * 25 + [3] * 19,            # documents cross 16 / 32 / 48
                        [1] * 13 + [2] * 20 + [3] * 31])           # document 2 begins 3 before 16
    ids = torch.randint(0, 300, (2, LENGTH), generator=gen)
    positions = torch.cat([torch.arange(n) for row in seq.tolist() for n in torch.unique_consecutive(
        torch.tensor(row), return_counts=True)[1].tolist()]).view(2, LENGTH)
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[0, 50:53] = False
    mask[1, 34:36] = False
    mask[:, 0] = False
    config = _config()
    features = torch.randn(2, LENGTH, 3 * config.hidden_size, generator=gen)
    last = torch.randn(2, LENGTH, config.hidden_size, generator=gen)
    return ids, seq, positions, mask, torch.tensor(ANCHORS), features, last


def _drafter():
    from dsv4.model.v41.drafter import DSparkDrafter

    torch.manual_seed(0)
    return DSparkDrafter(_config())


def _terms(drafter, ids, anchors, last, mask, seq, out):
    from dsv4.speculative import dspark_loss

    terms = dspark_loss(out, ids, anchors, last, mask, gamma=4.0, packed_seq_ids=seq, group=None)
    terms["numerator"].backward()
    return terms


def _body(rank: int, world_size: int) -> dict:
    from dsv4.parallel.cp import CPContext
    from dsv4.parallel.dspark_cp import draft_chunk

    cp = CPContext(dist.new_group(list(range(world_size))))
    ids, seq, positions, mask, anchors, features, last = _rows()
    local = slice(rank * LENGTH // world_size, (rank + 1) * LENGTH // world_size)
    drafter = _drafter()
    chunk = draft_chunk(ids, seq, positions, mask, anchors, features[:, local], last[:, local], cp, WINDOW,
                        drafter.block_size)
    out = drafter(chunk.input_ids, chunk.features, chunk.anchors, position_ids=chunk.positions,
                  packed_seq_ids=chunk.seq_ids, context_halo=chunk.halo)
    terms = _terms(drafter, chunk.input_ids, chunk.anchors, chunk.last_hidden, chunk.loss_mask, chunk.seq_ids, out)
    return {"numerator": terms["numerator"].detach(), "weight": terms["weight"],
            "grads": {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None},
            "traffic": cp.traffic.as_dict()}


def _bound(world_size: int) -> dict[int, dict[str, int]]:
    """Per rank: the context rows (before its chunk) and teacher rows (after it) its blocks read, counted from the
    blocks: distinct positions per whole row."""
    from dsv4.model.v41.draft_blocks import DraftBlocks

    ids, seq, positions, mask, anchors, _, _ = _rows()
    chunk = LENGTH // world_size
    supervised = DraftBlocks.from_anchors(anchors, 5, LENGTH).eval_mask(mask, seq)
    rows = {r: {"before": 0, "after": 0} for r in range(world_size)}
    for b in range(2):
        reads: dict[tuple[int, str], set[int]] = {}
        for n, a in enumerate(ANCHORS[b]):
            if a < 0:
                continue
            r = a // chunk
            for j in range(max(0, a - WINDOW), a):
                if seq[b, j] == seq[b, a] and j < r * chunk:
                    reads.setdefault((r, "before"), set()).add(j)
            for k in range(5):
                if supervised[b, n, k] and a + k >= (r + 1) * chunk:
                    reads.setdefault((r, "after"), set()).add(a + k)
        for (r, side), js in reads.items():
            rows[r][side] += len(js)
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_drafter_under_cp_equals_one_process_and_moves_only_what_its_blocks_read(world_size):
    from dsv4.parallel.cp import CPContext  # noqa: F401  (the same import path as the ranks)

    results = run_on_ranks(_body, world_size)
    ids, seq, positions, mask, anchors, features, last = _rows()
    drafter = _drafter()
    out = drafter(ids, features, anchors, position_ids=positions, packed_seq_ids=seq)
    ref = _terms(drafter, ids, anchors, last, mask, seq, out)
    numerator = sum(r["numerator"] for r in results)
    weight = sum(r["weight"] for r in results)
    assert abs(weight - ref["weight"]) <= 1e-6 * ref["weight"] and ref["weight"] > 10  # fp32 sums of decay weights
    assert abs(numerator - ref["numerator"]) <= 1e-5 * abs(ref["numerator"]), (numerator, ref["numerator"])
    grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    for name, expected in grads.items():
        got = sum(r["grads"][name] for r in results)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), name
    config = _config()
    bound = _bound(world_size)
    assert sum(b["before"] for b in bound.values()) >= 3 and sum(b["after"] for b in bound.values()) >= 2
    kv_row = config.head_dim * 4  # one fp32 K = V row
    teacher_row = config.hidden_size * 4
    stages = config.num_nextn_predict_layers
    for rank, r in enumerate(results):
        traffic = {kind: counts["bytes_received"] for kind, counts in r["traffic"].items()}
        sent_to_next = bound[rank + 1]["before"] if rank + 1 < world_size else 0
        assert traffic.get("dspark_context", 0) == bound[rank]["before"] * kv_row * stages, (rank, traffic, bound)
        assert traffic.get("dspark_context.backward", 0) == sent_to_next * kv_row * stages, (rank, traffic, bound)
        assert traffic.get("dspark_teacher", 0) == bound[rank]["after"] * teacher_row, (rank, traffic, bound)
        assert set(traffic) <= {"dspark_context", "dspark_context.backward", "dspark_teacher"}, traffic

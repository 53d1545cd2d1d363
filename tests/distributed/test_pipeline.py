"""Pipeline parallelism (dsv4.parallel.pipeline through torch.distributed.pipelining) on 2 gloo ranks equals one
process taking the same global batch: V4 tiny (4 blocks, MTP depth, hash layers) and V4.1 tiny (12 blocks, Full /
Reindex / Reuse layers, Engram at 1 and 4, single-pass hyper-connections), fp32, 4 packed rows of 256 tokens as 4
microbatches, 3 AdamW steps. Schedules: 1F1B and GPipe (2 stages, split by the FLOP model) and interleaved 1F1B (4
stages, two per rank; V4.1's stages start only where no layer reads an earlier stage's shared state). Each step's loss (the token mean over the step:
the microbatches' loss sums over the step's label count) within 1e-6 relative of the one-process loss, and every
gradient after the first step within 1e-5 of the largest of its tensor, each on the rank holding it; the embedding
(held by the first and the last stage for the MTP depth) gets the sum of both stages' gradients."""

from __future__ import annotations


import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

WORLD, ROWS, LENGTH, STEPS = 2, 4, 256, 3


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, 256, (ROWS, LENGTH), generator=g)
    docs = [[128, 128], [256], [128, 128], [256]]  # documents start on multiples of 128 (tiny's shard multiple)
    seq = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    pos = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    labels = torch.full((ROWS, LENGTH), -100)
    for b, lengths in enumerate(docs):
        off = 0
        for k, n in enumerate(lengths):
            seq[b, off:off + n], pos[b, off:off + n] = k + 1, torch.arange(n)
            labels[b, off:off + n - 1] = ids[b, off + 1:off + n]
            off += n
    labels[2, :40] = -100  # microbatches of unequal label counts (the loss is the step's token mean)
    return ids, pos, seq, torch.zeros(ROWS, LENGTH, dtype=torch.bool), labels


def _model(preset: str):
    from dsv4.config import DSV4Config
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    config = DSV4Config.preset(preset)
    return build_causal_lm(config, tokenizer=ByteTokenizer()) if preset == "v41_tiny" else build_causal_lm(config)


def _reference(preset: str):
    """One process: every microbatch's loss sum over the step's label count, backward, AdamW."""
    model = _model(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads = [], None
    for step in range(STEPS):
        ids, pos, seq, pad, labels = _batch(step)
        count = int((labels != -100).sum())
        total = 0.0
        for b in range(ROWS):
            out = model(ids[b:b + 1], position_ids=pos[b:b + 1], packed_seq_ids=seq[b:b + 1], labels=labels[b:b + 1],
                        return_logits=False)
            (out.loss_sum / count).backward()
            total += float(out.loss_sum.detach()) / count
        losses.append(total)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, first_grads


def _body(rank: int, world: int, preset: str, schedule: str, cp: int = 1):
    """Rank ``rank`` of ``pp x cp`` (``pp = world / cp``; CP groups are consecutive ranks, a pipeline joins the ranks
    of one CP index): its stages on its chunk of each row; after the backward the stage's gradients summed over its
    CP group (what FSDP's reduction over ``dp x cp`` does in the recipes' layout), the MTP embedding's over its pair."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from dsv4.parallel.cp.context import CPContext
    from dsv4.parallel.pipeline import (DSV4PipelineStage, build_schedule, embedding_pair, pipeline_loss,
                                        reduce_embedding_grads, stage_indices, stage_io, stage_layers)

    torch.set_num_threads(1)
    pp, (stage_rank, cp_rank) = world // cp, divmod(rank, cp)
    cp_groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(pp)]
    pp_groups = [dist.new_group(list(range(c, world, cp))) for c in range(cp)]
    cp_group, pp_group = cp_groups[stage_rank], pp_groups[cp_rank]
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    model = _model(preset)
    count = pp * virtual
    spans = stage_layers(model.config, LENGTH, count)
    context = CPContext(cp_group) if cp > 1 else None
    mine = [DSV4PipelineStage(model, spans[i], cp=context) for i in stage_indices(stage_rank, pp, virtual)]
    local = LENGTH // cp
    stages = []
    for m in mine:
        inputs, outputs = stage_io(m, 1, local, torch.float32)
        stages.append(PipelineStage(m, m.span.index, count, torch.device("cpu"), input_args=inputs,
                                    output_args=outputs, group=pp_group))
    pair = embedding_pair(model, count, pp)
    pair_groups = [dist.new_group([p * cp + c for p in pair]) for c in range(cp)] if pair else None
    params = list({id(p): p for m in mine for p in m.parameters()}.values())
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses, first_grads = [], None
    for step in range(STEPS):
        ids, pos, seq, pad, labels = (t[:, cp_rank * local:(cp_rank + 1) * local] for t in _batch(step))
        sched = build_schedule(stages, ROWS, schedule, pipeline_loss(int((_batch(step)[4] != -100).sum())))
        micro = []
        if stage_rank == 0:
            sched.step(ids, pos, seq, pad, labels, losses=micro)
        else:  # the last stage's: the loss reads the labels that travel with the streams, not a target
            sched.step(target=torch.zeros(ROWS), losses=micro)
        if cp > 1:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
        if pair and stage_rank in pair:
            reduce_embedding_grads(model, pair_groups[cp_rank])
        loss = torch.tensor(float(sum(m.detach() for m in micro)) if micro else 0.0, dtype=torch.float64)
        if cp > 1:
            dist.all_reduce(loss, group=cp_group)
        losses.append(float(loss) if micro else None)
        if first_grads is None:
            first_grads = {names[id(p)]: p.grad.clone() for p in params if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": first_grads, "spans": [(s.start, s.stop) for s in spans],
            "cp_bytes": 0 if context is None else sum(v["bytes_received"] for v in context.traffic.as_dict().values())}


SPANS = {  # by the FLOP model; V4.1's stages start where no Reuse / Reindex layer reads an earlier stage's state
    ("tiny", 2): [(0, 3), (3, 4)], ("tiny", 4): [(0, 1), (1, 2), (2, 3), (3, 4)],
    ("v41_tiny", 2): [(0, 6), (6, 12)], ("v41_tiny", 4): [(0, 2), (2, 4), (4, 6), (6, 12)],
}


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize(("preset", "schedule", "cp"), [
    ("tiny", "1f1b", 1), ("tiny", "gpipe", 1), ("tiny", "interleaved_1f1b", 1), ("v41_tiny", "1f1b", 1),
    ("v41_tiny", "interleaved_1f1b", 1), ("tiny", "1f1b", 2), ("v41_tiny", "1f1b", 2),
])
def test_pp2_equals_one_process(preset, schedule, cp, references):
    if preset not in references:
        references[preset] = _reference(preset)
    ref_losses, ref_grads = references[preset]
    ranks = run_on_ranks(_body, WORLD * cp, (preset, schedule, cp))
    assert ranks[0]["spans"] == SPANS[preset, 4 if schedule == "interleaved_1f1b" else 2]
    for last in ranks[cp:]:  # the last stage's ranks (stage 1 of 2, stage 3 of 4): the step's loss over CP
        for got, want in zip(last["losses"], ref_losses, strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (schedule, cp, last["losses"], ref_losses)
    if cp > 1:  # the CP exchanges ran in both stages
        assert all(res["cp_bytes"] > 0 for res in ranks[1::cp]), [res["cp_bytes"] for res in ranks]
    seen = set()
    for rank, res in enumerate(ranks):
        for name, grad in res["grads"].items():
            want = ref_grads[name]
            scale = want.abs().max().clamp_min(1e-12)
            assert ((grad - want).abs().max() / scale) <= 1e-5, (schedule, cp, rank, name)
            seen.add(name)
    assert seen == set(ref_grads), sorted(set(ref_grads) - seen)
    if preset == "tiny":  # the MTP depth's embedding: both stages' gradients summed
        assert "model.embed_tokens.weight" in ranks[0]["grads"] and "model.embed_tokens.weight" in ranks[-1]["grads"]

"""Pipeline parallelism (dsv4.parallel.pipeline through torch.distributed.pipelining) on 2 gloo ranks equals one
process taking the same global batch: V4 tiny (4 blocks, MTP depth, hash layers) and V4.1 tiny (12 blocks, Full /
Reindex / Reuse layers, Engram at 1 and 4, single-pass hyper-connections), fp32, 4 packed rows of 256 tokens as 4
microbatches, 3 AdamW steps. Schedules: 1F1B and GPipe (2 stages, split by the FLOP model), interleaved 1F1B and
(V4) interleaved zero bubble (4 stages, two per rank; V4.1's stages start only where no layer reads an earlier
stage's shared state). With CP (``pp=2 cp=2``, 4 ranks) the oracle is one process too; with EP (``pp=2 ep=2``) it
is ``pp=1`` at the same ``ep`` (the model's own forward with its experts sharded, ``_ep_body``). Each step's loss (the token mean over the step:
the microbatches' loss sums over the step's label count) within 1e-6 relative of the one-process loss, and every
gradient after the first step within 1e-5 of the largest of its tensor, each on the rank holding it; the embedding
(held by the first and the last stage for the MTP depth) gets the sum of both stages' gradients; the global
gradient norm over the stages (clip_pipeline_grad_norm_) equals torch's one-process norm within 1e-5 on every rank,
EP included. The runs do not clip: V4.1 tiny trains with model.fake_quant on, whose FP8 / FP4 rounding of the
weights turns parameter differences of float rounding into a third loss 1e-4 relative away (the order of EP's
expert sums does it, and so does clipping both runs to norm 0.3; with fake_quant off EP equals one process to 2e-8
at step 3), which a 3-step trajectory cannot tell from a bug; clipping's scale is checked against torch's in
tests/unit/parallel/test_pipeline_split.py. With FSDP2 inside the stages (``pp=2 dp=2``, 1F1B and interleaved 1F1B) the
oracle is one process again, and each rank's FSDP bytes of a step are the plan's (dsv4.plan.stages); every layout's
microbatches in flight after each compute action, and its ``pp sends`` bytes, are the plan's too. Variants of V4
tiny at ``pp=2``: ``tiny+block`` (block recompute inside the stages, against the one-process run without it: recompute
changes no number) and ``tiny+lora`` (LoRA r=4 on every target, the
adapters at random values; the embedding, frozen, takes no gradient on either stage)."""

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


LORA = {"rank": 4, "alpha": 8.0}  # the "+lora" variant: adapters on every target, the base frozen


def _config(preset: str, **overrides):
    """``(config, LoRA config or None)`` of a preset name with an optional variant: ``tiny+block`` (block
    recompute), ``tiny+lora`` (LoRA adapters)."""
    from dsv4.config import DSV4Config
    from dsv4.peft import LoRAConfig

    name, _, variant = preset.partition("+")
    if variant == "block":
        overrides["activation_checkpointing"] = "block"
    return DSV4Config.preset(name, **overrides), LoRAConfig(**LORA) if variant == "lora" else None


def _model(preset: str, **overrides):
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm
    from dsv4.peft import apply_lora

    torch.manual_seed(0)
    config, lora = _config(preset, **overrides)
    model = build_causal_lm(config, tokenizer=ByteTokenizer()) if preset == "v41_tiny" else build_causal_lm(config)
    if lora is not None:
        apply_lora(model, lora)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B starts at zero: every adapter takes part from the first step
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _accumulate(model, rows, count: int) -> float:
    """One process: each row of ``rows`` (``ids, positions, seq ids, padding, labels``) a microbatch through the
    model's own forward, its loss sum over the step's ``count`` labels backpropagated; returns their sum."""
    ids, pos, seq, _, labels = rows
    total = 0.0
    for b in range(ids.shape[0]):
        out = model(ids[b:b + 1], position_ids=pos[b:b + 1], packed_seq_ids=seq[b:b + 1], labels=labels[b:b + 1],
                    return_logits=False)
        (out.loss_sum / count).backward()
        total += float(out.loss_sum.detach()) / count
    return total


def _reference(preset: str):
    """One process: every microbatch's loss sum over the step's label count, backward, AdamW."""
    model = _model(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads, first_norm = [], None, None
    for step in range(STEPS):
        batch = _batch(step)
        losses.append(_accumulate(model, batch, int((batch[4] != -100).sum())))
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        first_norm = float(norm) if first_norm is None else first_norm
        opt.step()
        opt.zero_grad()
    return losses, first_grads, first_norm


def _count_sends(group) -> dict[str, int]:
    """Count the bytes of the point-to-point sends and receives this process posts on ``group`` (the pipeline's: the
    stages build ``P2POp(dist.isend / dist.irecv, ...)`` from ``torch.distributed``'s names, patched here with
    counting wrappers; CP's exchanges run on their own group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    moved = {"sent": 0, "received": 0}
    originals = {"isend": c10d.isend, "irecv": c10d.irecv}

    def counting(name, key):
        def op(tensor, *args, **kwargs):
            if kwargs.get("group", args[1] if len(args) > 1 else None) is group:
                moved[key] += tensor.numel() * tensor.element_size()
            return originals[name](tensor, *args, **kwargs)
        return op

    for name, key in (("isend", "sent"), ("irecv", "received")):
        wrapper = counting(name, key)
        setattr(dist, name, wrapper)
        setattr(c10d, name, wrapper)
    return moved


def _record_in_flight(stages) -> list[dict[int, int]]:
    """After each forward, full backward and weight-gradient computation the engine runs on this rank's stages: per
    stage index, the microbatches whose saved activations the stage still holds (its forward cache, and under zero
    bubble the state its input gradient leaves for the weight gradient)."""
    timeline: list[dict[int, int]] = []

    def record() -> None:
        timeline.append({s.stage_index: len(s.fwd_cache) + len(s.backward_state) for s in stages})

    for stage in stages:
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(*args, _run=forward, **kwargs):
            out = _run(*args, **kwargs)
            record()
            return out

        def backward_one_chunk(*args, _run=backward, **kwargs):
            out = _run(*args, **kwargs)
            if kwargs.get("full_backward", True):  # an input gradient alone frees nothing (zero bubble)
                record()
            return out

        def backward_weight_one_chunk(*args, _run=weight, **kwargs):
            out = _run(*args, **kwargs)
            record()
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
    return timeline


def _body(rank: int, world: int, preset: str, schedule: str, cp: int = 1, ep: int = 1):
    """Rank ``rank`` of ``pp x cp`` or ``pp x ep`` (``pp = world / (cp ep)``; a stage's CP or EP group is consecutive
    ranks, a pipeline joins the ranks of one CP / EP index). CP: each rank of a stage runs its chunk of every row,
    and the stage's gradients are summed over its CP group after the backward (what FSDP's reduction over ``dp x cp``
    does in the recipes' layout). EP: each rank of a stage runs its own rows (``ROWS / ep`` microbatches), its routed
    experts sharded over the EP group (the recipes' ``apply_expert_parallel``, alltoall), the other gradients summed
    over the group (FSDP's over ``dp``). The MTP embedding's gradients are summed over the first and last stage."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from dsv4.model.moe import GroupedExperts
    from dsv4.parallel.cp.context import CPContext
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.parallel.pipeline import (DSV4PipelineStage, build_schedule, check_pipeline,
                                        clip_pipeline_grad_norm_, embedding_pair, pipeline_loss,
                                        reduce_embedding_grads, stage_indices, stage_io, stage_layers, stage_traffic)

    torch.set_num_threads(1)
    inner = cp * ep
    pp, (stage_rank, inner_rank) = world // inner, divmod(rank, inner)
    inner_groups = [dist.new_group(list(range(i * inner, (i + 1) * inner))) for i in range(pp)]
    pp_groups = [dist.new_group(list(range(c, world, inner))) for c in range(inner)]
    inner_group, pp_group = inner_groups[stage_rank], pp_groups[inner_rank]
    virtual = 2 if schedule.startswith("interleaved") else 1
    model = _model(preset)
    check_pipeline(model.config, pp)
    if ep > 1:
        apply_expert_parallel(model, "alltoall", inner_group, "cpu")
    # the routed experts' tensors an EP rank holds a slice of (their gradients are that slice's, not reduced)
    experts = {id(p): m for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()} \
        if ep > 1 else {}
    count = pp * virtual
    spans = stage_layers(model.config, LENGTH, count)
    context = CPContext(inner_group) if cp > 1 else None
    mine = [DSV4PipelineStage(model, spans[i], cp=context) for i in stage_indices(stage_rank, pp, virtual)]
    local, rows = LENGTH // cp, ROWS // ep
    stages = []
    for m in mine:
        inputs, outputs = stage_io(m, 1, local, torch.float32)
        stages.append(PipelineStage(m, m.span.index, count, torch.device("cpu"), input_args=inputs,
                                    output_args=outputs, group=pp_group))
    pair = embedding_pair(model, count, pp)
    pair_groups = [dist.new_group([p * inner + c for p in pair]) for c in range(inner)] if pair else None
    params = list({id(p): p for m in mine for p in m.parameters()}.values())
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(params, lr=1e-3)
    moved = _count_sends(pp_group)
    timeline = _record_in_flight(stages)
    losses, first_grads, norms = [], None, []
    for step in range(STEPS):
        if step == 1:  # after the schedule's first-step set-up messages
            moved.update(sent=0, received=0)
        timeline.clear()
        batch = _batch(step)
        mine_rows = slice(inner_rank * rows, (inner_rank + 1) * rows) if ep > 1 else slice(None)
        tokens = slice(inner_rank * local, (inner_rank + 1) * local) if cp > 1 else slice(None)
        ids, pos, seq, pad, labels = (t[mine_rows, tokens] for t in batch)
        sched = build_schedule(stages, rows, schedule, pipeline_loss(int((batch[4] != -100).sum())))
        micro = []
        args = (ids, pos, seq, pad, labels) if any(m.span.first for m in mine) else ()
        # the last stage's target: the loss reads the labels that travel with the streams, not a target
        target = {"target": torch.zeros(rows)} if any(m.span.last for m in mine) else {}
        sched.step(*args, **target, losses=micro)
        if inner > 1:
            for p in params:
                if p.grad is not None and id(p) not in experts:
                    dist.all_reduce(p.grad, group=inner_group)
        if pair and stage_rank in pair:
            reduce_embedding_grads(model, pair_groups[inner_rank])
        loss = torch.tensor(float(sum(m.detach() for m in micro)) if micro else 0.0, dtype=torch.float64)
        if inner > 1:
            dist.all_reduce(loss, group=inner_group)
        losses.append(float(loss) if micro else None)
        if first_grads is None:
            first_grads = {names[id(p)]: (p.grad.clone(), experts[id(p)].expert_offset if id(p) in experts else None)
                           for p in params if p.grad is not None}
        # the global gradient norm over the stages (not clipped: see the module docstring)
        norms.append(float(clip_pipeline_grad_norm_(mine, None, pp_group, inner_group if ep > 1 else None)))
        opt.step()
        opt.zero_grad()
    expected = [stage_traffic(m, 1, local, rows, torch.float32) for m in mine]
    traffic = {"measured": dict(moved), "expected": {k: (STEPS - 1) * sum(e[k] for e in expected)
                                                     for k in ("sent", "received")}}
    return {"losses": losses, "grads": first_grads, "norms": norms, "spans": [(s.start, s.stop) for s in spans],
            "traffic": traffic, "in_flight": list(timeline),
            "cp_bytes": 0 if context is None else sum(v["bytes_received"] for v in context.traffic.as_dict().values())}


SPANS = {  # by the FLOP model; V4.1's stages start where no Reuse / Reindex layer reads an earlier stage's state
    ("tiny", 2): [(0, 3), (3, 4)], ("tiny", 4): [(0, 1), (1, 2), (2, 3), (3, 4)],
    ("v41_tiny", 2): [(0, 6), (6, 12)], ("v41_tiny", 4): [(0, 2), (2, 4), (4, 6), (6, 12)],
}


def _ep_body(rank: int, world: int, preset: str):
    """``pp = 1``, ``ep = world``: the model's own forward on this rank's rows with its routed experts sharded over
    the ranks (``apply_expert_parallel``, alltoall), the step's token mean, the other gradients summed over the
    ranks; the oracle of ``pp=2 ep=2``. (Against one process, EP alone gives V4.1 tiny's first two losses equal
    and its third 1.3e-4 relative away, with or without pipeline stages: the experts' sums run in another order, and
    fake quantisation's FP8 / FP4 rounding turns the rounding difference of the update into that; with
    ``model.fake_quant=false`` the third loss agrees to 2e-8.)"""
    import torch.distributed as dist

    from dsv4.model.moe import GroupedExperts
    from dsv4.parallel.expert_shard import apply_expert_parallel

    torch.set_num_threads(1)
    model = _model(preset)
    apply_expert_parallel(model, "alltoall", None, "cpu")
    experts = {id(p): m for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows, losses, first_grads = ROWS // world, [], None
    for step in range(STEPS):
        batch = _batch(step)
        mine = tuple(t[rank * rows:(rank + 1) * rows] for t in batch)
        total = torch.tensor(_accumulate(model, mine, int((batch[4] != -100).sum())), dtype=torch.float64)
        for p in model.parameters():
            if p.grad is not None and id(p) not in experts:
                dist.all_reduce(p.grad)
        dist.all_reduce(total)
        losses.append(float(total))
        if first_grads is None:
            first_grads = {n: (p.grad.clone(), experts[id(p)].expert_offset if id(p) in experts else None)
                           for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": first_grads}


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize(("preset", "schedule", "cp", "ep"), [
    ("tiny", "1f1b", 1, 1), ("tiny", "gpipe", 1, 1), ("tiny", "interleaved_1f1b", 1, 1),
    ("tiny", "interleaved_zero_bubble", 1, 1), ("v41_tiny", "1f1b", 1, 1),
    ("v41_tiny", "interleaved_1f1b", 1, 1), ("tiny", "1f1b", 2, 1), ("v41_tiny", "1f1b", 2, 1),
    ("tiny", "1f1b", 1, 2), ("v41_tiny", "1f1b", 1, 2), ("tiny+block", "1f1b", 1, 1), ("tiny+lora", "1f1b", 1, 1),
])
def test_pp2_equals_one_process(preset, schedule, cp, ep, references):
    oracle = preset.removesuffix("+block")  # recompute changes no number: the oracle runs without it
    if (oracle, 1) not in references:
        references[oracle, 1] = _reference(oracle)
    one_process_norm = references[oracle, 1][2]
    if (oracle, ep) not in references:
        if ep > 1:  # pp = 1 at the same ep: each EP rank's experts' gradients, the others' (equal on every rank)
            ep_ranks = run_on_ranks(_ep_body, ep, (preset,))
            grads = {n: g for res in ep_ranks for n, (g, off) in res["grads"].items() if off is None}
            for res in ep_ranks:
                grads.update({(n, off): g for n, (g, off) in res["grads"].items() if off is not None})
            references[oracle, ep] = ep_ranks[0]["losses"], grads, None
    ref_losses, ref_grads, _ = references[oracle, ep]
    inner = cp * ep
    ranks = run_on_ranks(_body, WORLD * inner, (preset, schedule, cp, ep))
    assert ranks[0]["spans"] == SPANS[preset.partition("+")[0], 4 if schedule.startswith("interleaved") else 2]
    for last in ranks[inner:]:  # the last stage's ranks (stage 1 of 2, stage 3 of 4): the step's loss
        for got, want in zip(last["losses"], ref_losses, strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (schedule, cp, ep, last["losses"], ref_losses)
    if cp > 1:  # the CP exchanges ran in both stages
        assert all(res["cp_bytes"] > 0 for res in ranks[1::cp]), [res["cp_bytes"] for res in ranks]
    for rank, res in enumerate(ranks):  # the first step's global gradient norm, over every stage, as torch's
        assert abs(res["norms"][0] - one_process_norm) <= 1e-5 * one_process_norm, (rank, res["norms"], one_process_norm)
    for rank, res in enumerate(ranks):  # the pipeline's sends per step: counted as stage_traffic states them
        assert res["traffic"]["measured"] == res["traffic"]["expected"], (rank, res["traffic"])
    _check_plan(preset, schedule, cp, ep, ranks)
    seen = set()
    for rank, res in enumerate(ranks):
        for name, (grad, offset) in res["grads"].items():
            key = name if offset is None else (name, offset)  # an EP rank's experts: that rank's slice
            want = ref_grads[key]
            scale = want.abs().max().clamp_min(1e-12)
            assert ((grad - want).abs().max() / scale) <= 1e-5, (schedule, cp, ep, rank, name)
            seen.add(key)
    assert seen == set(ref_grads), sorted(set(ref_grads) - seen)
    if preset == "tiny":  # the MTP depth's embedding: both stages' gradients summed
        assert "model.embed_tokens.weight" in ranks[0]["grads"] and "model.embed_tokens.weight" in ranks[-1]["grads"]


_TRACES: dict = {}  # activation_key -> the traced step (dsv4.plan.suggest)


def _check_plan(preset: str, schedule: str, cp: int, ep: int, ranks: list[dict]) -> None:
    """The memory plan of the same layout (dsv4.plan.stages): every rank's microbatches in flight after each compute
    action are the engine's, and its ``pp sends`` row is the bytes the rank's pipeline sends and receives per step."""
    from dsv4.plan.plan import PlanSetup, memory_plan
    from dsv4.plan.stages import in_flight_timeline
    from dsv4.plan.suggest import activation_key

    virtual = 2 if schedule.startswith("interleaved") else 1
    microbatches = ROWS // ep
    config, lora = _config(preset)
    setup = PlanSetup(config, seq_len=LENGTH, cp=cp, dp=ep, ep=ep, pp=WORLD, pp_schedule=schedule,
                      pp_virtual=virtual, microbatches=microbatches, dispatcher="alltoall", lora=lora)
    key = activation_key(setup)  # the layouts of one model, cp and ep share the step's trace
    plan = memory_plan(setup, _TRACES.get(key))
    _TRACES[key] = plan.traced
    by_rank = {p.stages.rank: p.comm.by_kind()["pp sends"] for p in plan.ranks}
    inner = cp * ep
    for rank, res in enumerate(ranks):
        stage_rank = rank // inner
        assert res["in_flight"] == in_flight_timeline(schedule, WORLD, virtual, microbatches, stage_rank), \
            (rank, res["in_flight"])
        row = by_rank[stage_rank]
        measured = {k: v // (STEPS - 1) for k, v in res["traffic"]["measured"].items()}
        assert (row.sent, row.received) == (measured["sent"], measured["received"]), (rank, row, measured)


def _fsdp_body(rank: int, world: int, schedule: str):
    """``pp=2 dp=2`` (4 ranks) with FSDP2 inside the stages (``shard_stages``): each data-parallel rank runs its two
    rows as two microbatches, FSDP sums the gradients over the stage's two ranks; the bytes FSDP moves in the third
    step, counted by the collective tap of ``benchmarks/comm_plan.py``."""
    import sys
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.pipeline import (DSV4PipelineStage, build_schedule, clip_pipeline_grad_norm_, embedding_pair,
                                        pipeline_loss, reduce_embedding_grads, shard_stages, stage_indices, stage_io,
                                        stage_layers)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from comm_plan import CollectiveTap

    torch.set_num_threads(1)
    dp, pp = 2, world // 2
    meshes = build_meshes(ParallelDims(world_size=world, dp=dp, pp=pp), "cpu")
    stage_rank, dp_rank = divmod(rank, dp)
    virtual = 2 if schedule.startswith("interleaved") else 1
    model = _model("tiny")
    spans = stage_layers(model.config, LENGTH, pp * virtual)
    mine = [DSV4PipelineStage(model, spans[i]) for i in stage_indices(stage_rank, pp, virtual)]
    shard_stages(model, mine, meshes)
    names = {id(p): n for n, p in model.named_parameters()}  # (FSDP's sharded parameters)
    stages = [PipelineStage(m, m.span.index, pp * virtual, torch.device("cpu"), *stage_io(m, 1, LENGTH, torch.float32),
                            group=meshes.pp.get_group()) for m in mine]
    pair = embedding_pair(model, pp * virtual, pp)
    pair_groups = [dist.new_group([p * dp + d for p in pair]) for d in range(dp)]
    params = list({id(p): p for m in mine for p in m.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-3)
    rows = ROWS // dp
    losses, first_grads, norms, fsdp = [], None, [], {}
    for step in range(STEPS):
        batch = _batch(step)
        ids, pos, seq, pad, labels = (t[dp_rank * rows:(dp_rank + 1) * rows] for t in batch)
        sched = build_schedule(stages, rows, schedule, pipeline_loss(int((batch[4] != -100).sum())))
        micro = []
        args = (ids, pos, seq, pad, labels) if any(m.span.first for m in mine) else ()
        target = {"target": torch.zeros(rows)} if any(m.span.last for m in mine) else {}
        with CollectiveTap() as tap:
            sched.step(*args, **target, losses=micro)
        if step == STEPS - 1:
            fsdp = {k: v for k, v in tap.records.items() if k.startswith("fsdp")}
        if stage_rank in pair:
            reduce_embedding_grads(model, pair_groups[dp_rank])
        loss = torch.tensor(float(sum(m.detach() for m in micro)) if micro else 0.0, dtype=torch.float64)
        dist.all_reduce(loss, group=meshes.dp_cp.get_group())
        losses.append(float(loss) if micro else None)
        if first_grads is None:
            first_grads = {names[id(p)]: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                           for p in params if p.grad is not None}
        norms.append(float(clip_pipeline_grad_norm_(mine, None, meshes.pp.get_group(),
                                                    stage_group=meshes.dp_cp.get_group())))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": first_grads, "norms": norms, "fsdp": fsdp, "stage_rank": stage_rank}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_fsdp_inside_stages_equals_one_process_and_moves_what_the_plan_says(schedule, references):
    """``pp=2 dp=2`` with FSDP2 inside the stages: the one-process losses (1e-6), first-step gradients (1e-5 of each
    tensor's largest, the embedding summed over its two stages) and gradient norm; and each rank's FSDP all-gather and
    reduce-scatter bytes of a step equal the plan's for that pipeline rank (units gathered once a step, reduced
    after the last microbatch)."""
    from dsv4.config import DSV4Config
    from dsv4.plan.plan import PlanSetup, memory_plan

    if ("tiny", 1) not in references:
        references["tiny", 1] = _reference("tiny")
    ref_losses, ref_grads, ref_norm = references["tiny", 1]
    ranks = run_on_ranks(_fsdp_body, 4, (schedule,))
    for res in ranks[2:]:  # the last stage's ranks: the step's loss, summed over the data-parallel ranks
        for got, want in zip(res["losses"], ref_losses, strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (schedule, res["losses"], ref_losses)
    for rank, res in enumerate(ranks):
        assert abs(res["norms"][0] - ref_norm) <= 1e-5 * ref_norm, (rank, res["norms"], ref_norm)
        for name, grad in res["grads"].items():
            want = ref_grads[name]
            assert ((grad - want).abs().max() / want.abs().max().clamp_min(1e-12)) <= 1e-5, (schedule, rank, name)
    assert set(ref_grads) == {n for res in ranks for n in res["grads"]}
    virtual = 2 if schedule.startswith("interleaved") else 1
    plan = memory_plan(PlanSetup(DSV4Config.preset("tiny"), seq_len=LENGTH, dp=2, pp=2, pp_schedule=schedule,
                                 pp_virtual=virtual, microbatches=ROWS // 2))
    planned = {p.stages.rank: p.comm.by_kind() for p in plan.ranks}
    for rank, res in enumerate(ranks):
        rows = planned[res["stage_rank"]]
        for kind in ("fsdp all-gather", "fsdp reduce-scatter"):
            want = (rows[kind].sent + rows[f"{kind}, experts"].sent, rows[kind].calls + rows[f"{kind}, experts"].calls)
            calls, sent, received = res["fsdp"][kind]
            assert sent == received and (sent, calls) == want and sent > 0, (rank, kind, res["fsdp"][kind], want)

"""The drafter-training memory plan (``dsv4.plan.dspark``) against a measured step, and V4.1-Flash's plan on 80 GiB
GPUs.

``--measure``: for each ``--world`` size, gloo ranks (``dsv4.launch``, ``dp = world``, ``ep = world``: the drafter's
and the target's routed experts expert-parallel, the drafter FSDP2-sharded by the recipe's ``apply_fsdp``) run the
drafter recipe's step on the tiny V4.1 target: the frozen target's features of one packed row of ``--seq-len`` tokens
(``target_features``), the drafter's terms on ``--anchors`` blocks (``drafter_terms``, the recipe's loss), backward,
AdamW, ``zero_grad``. A first step allocates the optimizer state, then the measured one:
``dspark_plan.measured_tensors`` is every tensor storage alive at the step's peak (the target's and the drafter's
state summed from the real objects, plus the peak of what the step allocates by
:class:`dsv4.plan.trace.AllocationTracer` on the real run; views of parameters are not new storage), the max over
ranks; ``dspark_plan.predicted`` the plan's total for the same setup (it judges a GPU: on one CPU memory the host is
the device, so the plan's every phase is compared); ``dspark_plan.tensors_over_predicted`` their ratio.

``--flash``: V4.1-Flash drafter training at ``--flash-seq-len`` tokens per row on ``--flash-gpus`` GPUs of 80 GiB
(``dp = ep = GPUs``), the target as the release stores it (FP8 / FP4 weights kept, Engram tables in FP8), bf16
compute, for each setting of the Engram tables' place (``trainer.engram_tables``) and the optimizer's moments
(``optim.state_dtype``): ``dspark_plan.flash_total`` (GiB per rank, with ``fits`` against 80 GiB less the 4 GiB
reserve) and ``dspark_plan.flash_host`` (the Engram rows in host memory per rank).

    python benchmarks/dspark_plan.py --measure --world 1 2 --seq-len 512
    python benchmarks/dspark_plan.py --flash --flash-gpus 8 16
"""

from __future__ import annotations

import argparse
from functools import partial

from common import emit
from dsv4.launch import run_on_ranks

GIB = 2**30


def _adamw(state_dtype: str = "float32"):
    from dsv4.training.optimizer import adamw

    return partial(adamw, lr=1e-4, betas=[0.9, 0.999], weight_decay=0.01, state_dtype=state_dtype)


def _config():
    from dsv4.config import DSV4Config

    return DSV4Config.preset("v41_tiny")


def predicted(world: int, seq_len: int, anchors: int) -> int:
    """The drafter plan's total for the measured setup (its CPU counterpart: fp32, no reserve)."""
    from dsv4.plan.dspark import DSparkPlanSetup, dspark_memory_plan
    from dsv4.plan.plan import PlanSetup
    from dsv4.plan.states import optimizer_profile

    base = PlanSetup(_config(), seq_len=seq_len, dp=world, ep=world, optimizer=optimizer_profile(_adamw()),
                     dispatcher="alltoall")
    return dspark_memory_plan(DSparkPlanSetup(base, num_anchors=anchors, evaluates=False)).total


def _row(config, seq_len: int, seed: int):
    """One packed row of three documents, assistant-style labels (the first tokens of each unsupervised)."""
    import torch

    from dsv4.batch import TokenBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = [seq_len // 2, seq_len // 4, seq_len - seq_len // 2 - seq_len // 4]
    ids = torch.randint(0, 256, (1, seq_len), generator=gen)  # byte tokens (Engram hashes through them)
    seq = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.where(pos < 8, -100, ids)
    return TokenBatch(ids, labels, seq, pos)


def _rank_body(rank: int, world: int, seq_len: int, anchors: int) -> float:
    """Tensor bytes (MiB) alive at this rank's measured step peak (module docstring)."""
    import torch
    from torch.distributed.tensor import DTensor

    from dsv4.model.v41.drafter import DSparkDrafter
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp
    from dsv4.plan.trace import AllocationTracer
    from dsv4.speculative.dspark_step import LossOptions, drafter_terms, target_features
    from dsv4.speculative.target import build_frozen_target

    config = _config()
    meshes = build_meshes(ParallelDims(world_size=world, ep=world), "cpu")
    ep = meshes.ep.get_group() if world > 1 else None
    target = build_frozen_target(config, seed=0)
    if world > 1:  # the recipe's target: its routed experts over the EP ranks
        apply_expert_parallel(target, "alltoall", ep, "cpu")
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    drafter.copy_target_embeddings(target)
    if world > 1:
        apply_expert_parallel(drafter, "alltoall", ep, "cpu")
    apply_fsdp(drafter, meshes)
    optimizer = _adamw()([p for p in drafter.parameters() if p.requires_grad])
    options = LossOptions(anchors, None, 0.1, 0.9, 1.0)

    def step(batch) -> None:
        features, last = target_features(target, batch, config.dspark_target_layer_ids)
        terms = drafter_terms(drafter, batch, features, last, options, seed=0, step=0)
        terms["numerator"].backward()
        del terms, features, last
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(_row(config, seq_len, rank))  # allocates the optimizer state
    batch = _row(config, seq_len, 100 + rank)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    weights = [local(t) for m in (target, drafter) for t in [*m.parameters(), *m.buffers()]]
    with AllocationTracer(untracked=weights) as tracer:
        step(batch)
    storages: dict[int, int] = {}
    for t in weights + [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]:
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return (sum(storages.values()) + tracer.peak) / 2**20


def measure(worlds: list[int], seq_len: int, anchors: int) -> None:
    for world in worlds:
        plan = predicted(world, seq_len, anchors) / 2**20
        tensors = max(run_on_ranks(_rank_body, world, args=(seq_len, anchors), timeout=3600))
        shape = {"model": "v41_tiny", "seq_len": seq_len, "world": world, "dp": world, "ep": world,
                 "anchors": anchors, "step": "target forward + drafter forward+backward+AdamW", "dtype": "float32"}
        emit("dspark_plan.predicted", shape, round(plan, 2), "MiB")
        emit("dspark_plan.measured_tensors", shape, round(tensors, 2), "MiB")
        emit("dspark_plan.tensors_over_predicted", shape, round(tensors / plan, 3), "ratio")


def flash(gpus: list[int], seq_len: int) -> None:
    import torch

    from dsv4.config import DSV4Config
    from dsv4.plan.dspark import DSparkPlanSetup, dspark_memory_plan
    from dsv4.plan.plan import PlanSetup
    from dsv4.plan.states import optimizer_profile

    config = DSV4Config.preset("v41_flash")
    traces = None
    for n in gpus:
        for host in (False, True):
            for state in ("float32", "bfloat16", "8bit"):
                base = PlanSetup(config, seq_len=seq_len, dp=n, ep=n, compute_dtype=torch.bfloat16,
                                 optimizer=optimizer_profile(_adamw(state)), engram_fp8=True, engram_on_host=host,
                                 reserve_bytes=4 * GIB, dispatcher="alltoall")
                plan = dspark_memory_plan(DSparkPlanSetup(base, target_kept=True), traces)
                traces = plan.traces
                shape = {"model": "v41_flash", "seq_len": seq_len, "gpus": n, "dp": n, "ep": n,
                         "engram_tables": "host" if host else "device", "optim_state_dtype": state,
                         "device_gib": 80, "reserve_gib": 4, "fits": plan.fits, "peak_phase": plan.peak_phase}
                emit("dspark_plan.flash_total", shape, round(plan.total / GIB, 2), "GiB")
                emit("dspark_plan.flash_host", shape, round(plan.host_bytes / GIB, 2), "GiB")
        traces = None  # another world: another EP split of the traced MoE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--world", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--flash", action="store_true")
    parser.add_argument("--flash-gpus", type=int, nargs="*", default=[8])
    parser.add_argument("--flash-seq-len", type=int, default=4096)
    args = parser.parse_args()
    if not (args.measure or args.flash):
        parser.error("choose --measure and / or --flash")
    if args.measure:
        measure(args.world, args.seq_len, args.anchors)
    if args.flash:
        flash(args.flash_gpus, args.flash_seq_len)


if __name__ == "__main__":
    main()

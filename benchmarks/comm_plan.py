"""The plan's communication (``dsv4.plan.comm``) against the bytes a real training step moves, per kind and layout.

Each layout runs on two gloo ranks (processes started by ``dsv4.launch``): the tiny model built, expert-sharded and
wrapped as the recipe's strategy does it (``apply_expert_parallel``, ``apply_fsdp`` with the layout's compute dtype
and host offload; LoRA applied first for ``lora``), AdamW, and one document of ``--seq-len`` tokens per data-parallel
replica cut for its CP rank (``TokenBatch.cut``). One warm-up step, then the measured step, as the training module
runs it: the model call of :func:`dsv4.training.step.forward_outputs`, the loss reduced over the dp x cp ranks
(``reduce_token_loss``), backward, the gradient norm clipped over every mesh (``clip_grad_norm_``), AdamW, and the
routers' load update reduced over the world (``update_load_balancing_bias``).

What moved is counted where it moves, not by the framework's counters:

* :class:`CollectiveTap`, a ``TorchDispatchMode``, sees every collective torch runs (``c10d`` ops: FSDP's
  all-gathers and reduce-scatters, the point-to-point sends and receives of the CP exchanges, all-reduces, plain
  all-to-alls; ``_c10d_functional`` ops: the differentiable all-to-alls and gathers of the EP dispatchers, in
  forward and in backward) and counts the bytes this rank sends and receives in each, by the same convention as
  the plan (a collective over ``m`` ranks: the other ranks' share of its output / input; a point-to-point op: its
  tensors). Each is attributed by the code that called it (a frame of ``torch.distributed.fsdp``,
  ``dsv4/parallel/dispatch.py``, ``dsv4/parallel/cp``); a collective run by autograd's engine in backward (the EP
  all-to-alls' gradients) by its process group, whose kind its forward calls named.
* :class:`OffloadTap`: the host <-> device copies FSDP asks for under host offload (``Tensor.to`` called by FSDP2's
  ``all_gather_inputs`` and ``foreach_reduce``; on a CPU the copy is a no-op, so its bytes are counted at the call).

Per layout and kind, for the rank the plan plans (EP: the mean over the ranks, the plan assumes uniform routing;
CP: the last CP rank, which the plan plans; the others are the same on every rank): the measured bytes sent and
received, the plan's, and their ratio; the step's small all-reduces (loss, label count, gradient norm, router loads),
which the plan leaves out, and their share of all the bytes measured. The CP ``TrafficCounter`` of the run is
printed beside the tap's CP bytes.

Layouts (world 2, the tiny model, block recompute unless named):

* ``dp2``: dp 2, fp32 (FSDP over both ranks, experts on the edp mesh of 2);
* ``ep2``: dp 2, ep 2, bf16 mixed precision (fp32 units of their own, experts on a one-rank edp mesh), alltoall;
* ``ep2_allgather``: ``ep2`` with the allgather dispatcher, fp32;
* ``cp2``: cp 2, fp32;
* ``cp2_ep2``: cp 2 and ep 2, bf16, no recompute;
* ``offload``: dp 2, fp32, ``trainer.offload=optimizer``;
* ``lora``: dp 2, LoRA r=4 (every target) in bf16: the frozen base gathered, never reduced.

    python benchmarks/comm_plan.py                          # every layout, S = 256
    python benchmarks/comm_plan.py --layouts cp2 --seq-len 1024
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import defaultdict

import torch

from common import emit
from dsv4.launch import run_on_ranks

# name -> cp, ep (dp = world / cp), compute dtype, recompute, dispatcher, host offload, LoRA
LAYOUTS: dict[str, dict] = {
    "dp2": dict(cp=1, ep=1, dtype="float32", recompute="block", dispatcher="alltoall"),
    "ep2": dict(cp=1, ep=2, dtype="bfloat16", recompute="block", dispatcher="alltoall"),
    "ep2_allgather": dict(cp=1, ep=2, dtype="float32", recompute="block", dispatcher="allgather"),
    "cp2": dict(cp=2, ep=1, dtype="float32", recompute="block", dispatcher="alltoall"),
    "cp2_ep2": dict(cp=2, ep=2, dtype="bfloat16", recompute="none", dispatcher="alltoall"),
    "offload": dict(cp=1, ep=1, dtype="float32", recompute="block", dispatcher="alltoall", offload=True),
    "lora": dict(cp=1, ep=1, dtype="bfloat16", recompute="block", dispatcher="alltoall", lora=True),
}
WORLD = 2
# the measured kinds, and the plan's kinds each is compared with
COMPARED = {"fsdp all-gather": ("fsdp all-gather", "fsdp all-gather, experts"),
            "fsdp reduce-scatter": ("fsdp reduce-scatter", "fsdp reduce-scatter, experts"),
            "ep": ("ep dispatch + combine",), "cp": ("cp exchanges",),
            "host -> device": ("host -> device",), "device -> host": ("device -> host",)}
SMALL = "small all-reduces"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(obj):
    """The ``ProcessGroup`` of a c10d op's argument (a boxed ``ScriptObject``) or a functional op's group name."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(obj) if isinstance(obj, str) else dist.ProcessGroup.unbox(obj)


def _origin() -> str | None:
    """Which part of the code called the collective running now: ``fsdp``, ``ep``, ``cp``, ``engram`` or None (e.g.
    autograd's engine running a backward collective)."""
    for frame in traceback.extract_stack():
        name = frame.filename.replace("\\", "/")
        if "/torch/distributed/fsdp/" in name:
            return "fsdp"
        if name.endswith("dsv4/parallel/dispatch.py"):
            return "ep"
        if "/dsv4/parallel/cp/" in name:
            return "cp"
        if name.endswith("dsv4/parallel/engram_table.py"):
            return "engram"
    return None


class CollectiveTap:
    """Bytes this rank sends and receives in every collective while active, by kind (module docstring):
    ``records[kind] = [calls, sent, received]``."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tap = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
                    return NotImplemented  # a tensor subclass (DTensor) runs its local ops, which come back here
                tap._see(func, args)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self.records: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self._group_kind: dict[str, str] = {}  # group name -> the kind its forward collectives were

    def __enter__(self) -> "CollectiveTap":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _see(self, func, args) -> None:
        namespace, _, op = func.name().partition("::")
        if namespace not in ("c10d", "_c10d_functional") or op in ("wait_tensor", "_wrap_tensor_autograd", "barrier"):
            return
        group, sent, received = self._bytes(namespace, op, args)
        kind = _origin()
        if op.startswith("allreduce") or op == "all_reduce":
            kind = SMALL
        elif kind is None:  # a backward collective run by autograd's engine: the kind of its group's forward calls
            kind = self._group_kind.get(group.group_name, f"unattributed {op}")
        elif namespace == "_c10d_functional":
            self._group_kind.setdefault(group.group_name, kind)
        if kind == "fsdp":
            kind = "fsdp all-gather" if "gather" in op else "fsdp reduce-scatter"
        record = self.records[kind]
        record[0] += 1
        record[1] += sent
        record[2] += received

    @staticmethod
    def _bytes(namespace: str, op: str, a) -> tuple:
        """``(group, sent, received)`` of one collective call on this rank."""
        if namespace == "c10d":
            if op == "_allgather_base_":
                g = _group(a[2])
                return g, _nbytes(a[1]) * (g.size() - 1), _nbytes(a[0]) - _nbytes(a[1])
            if op == "_reduce_scatter_base_":
                g = _group(a[2])
                n = _nbytes(a[1]) - _nbytes(a[0])
                return g, n, n
            if op == "allreduce_":
                g = _group(a[1])
                n = 2 * (g.size() - 1) * sum(_nbytes(t) for t in a[0]) // g.size()
                return g, n, n
            if op == "alltoall_base_":
                g = _group(a[2])
                return (g, *_all_to_all(a[1], a[0], list(a[4]), list(a[3]), g))
            if op == "send":
                return _group(a[1]), sum(_nbytes(t) for t in a[0]), 0
            if op == "recv_":
                return _group(a[1]), 0, sum(_nbytes(t) for t in a[0])
            if op == "allgather_":
                g = _group(a[2])
                n = sum(_nbytes(t) for t in a[1]) * (g.size() - 1)
                return g, n, n
        else:
            if op == "all_gather_into_tensor":
                g = _group(a[2])
                n = _nbytes(a[0]) * (g.size() - 1)
                return g, n, n
            if op == "reduce_scatter_tensor":
                g = _group(a[3])
                n = _nbytes(a[0]) // g.size() * (g.size() - 1)
                return g, n, n
            if op == "all_reduce":
                g = _group(a[2])
                n = 2 * (g.size() - 1) * _nbytes(a[0]) // g.size()
                return g, n, n
            if op == "all_to_all_single":
                g = _group(a[3])
                return (g, *_all_to_all(a[0], None, list(a[2]), list(a[1]), g))
        raise RuntimeError(f"comm_plan: no byte count for collective {namespace}::{op}; add it to CollectiveTap")


def _all_to_all(inp: torch.Tensor, out: torch.Tensor | None, in_splits: list, out_splits: list, group) -> tuple:
    """``(sent, received)`` of an all-to-all: the rows to and from the other ranks (its own slice stays)."""
    size, rank = group.size(), group.rank()
    row_in = _nbytes(inp) // max(inp.shape[0], 1)
    in_splits = in_splits or [inp.shape[0] // size] * size
    sent = (sum(in_splits) - in_splits[rank]) * row_in
    if out is None:
        received = (sum(out_splits) - out_splits[rank]) * row_in
    else:
        out_splits = out_splits or [out.shape[0] // size] * size
        received = (sum(out_splits) - out_splits[rank]) * (_nbytes(out) // max(out.shape[0], 1))
    return sent, received


class OffloadTap:
    """The host <-> device copies FSDP2 asks for under host offload (module docstring): ``Tensor.to`` called by
    ``FSDPParam.all_gather_inputs`` (a shard to the device before its all-gather) and by ``foreach_reduce`` (a
    gradient shard to the host)."""

    def __enter__(self) -> "OffloadTap":
        self.records: dict[str, list[int]] = {"host -> device": [0, 0, 0], "device -> host": [0, 0, 0]}
        self._to = torch.Tensor.to
        original = self._to
        records = self.records

        def to(t, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if "/fsdp/_fully_shard/" in caller.co_filename.replace("\\", "/"):
                if caller.co_name == "all_gather_inputs":
                    records["host -> device"][0] += 1
                    records["host -> device"][2] += _nbytes(t)  # the device receives
                elif caller.co_name == "foreach_reduce":
                    records["device -> host"][0] += 1
                    records["device -> host"][1] += _nbytes(t)  # the device sends
            return original(t, *args, **kwargs)

        torch.Tensor.to = to
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.to = self._to


def plan_setup(layout: str, seq_len: int):
    """The :class:`~dsv4.plan.plan.PlanSetup` of a layout (the same model, step and sharding as the run)."""
    from dsv4.config import DSV4Config
    from dsv4.peft import LoRAConfig
    from dsv4.plan.plan import PlanSetup

    spec = LAYOUTS[layout]
    config = DSV4Config.preset("tiny", activation_checkpointing=spec["recompute"])
    return PlanSetup(config, seq_len, cp=spec["cp"], dp=WORLD // spec["cp"], ep=spec["ep"],
                     compute_dtype=getattr(torch, spec["dtype"]), dispatcher=spec["dispatcher"],
                     offload="optimizer" if spec.get("offload") else "none",
                     lora=LoRAConfig(rank=4, alpha=8.0) if spec.get("lora") else None)


def _measure(rank: int, world_size: int, layout: str, seq_len: int) -> dict:
    """One layout on this rank: the tap's records of the measured step and the CP counter's (module docstring)."""
    from dsv4.data import pack_documents
    from dsv4.distributed import all_reduce_sum
    from dsv4.model import build_causal_lm
    from dsv4.model.moe import update_load_balancing_bias
    from dsv4.parallel.cp import CPContext
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp, clip_grad_norm_
    from dsv4.peft import apply_lora
    from dsv4.training.loss import reduce_token_loss
    from dsv4.training.step import forward_outputs

    setup = plan_setup(layout, seq_len)
    config = setup.config
    meshes = build_meshes(ParallelDims(world_size=world_size, cp=setup.cp, ep=setup.ep), "cpu")
    torch.manual_seed(0)
    model = build_causal_lm(config)
    if setup.lora is not None:
        apply_lora(model, setup.lora)
        with torch.no_grad():  # B starts at zero: every adapter takes part from the first step
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.05)
    if setup.ep > 1:
        apply_expert_parallel(model, setup.dispatcher, meshes.ep.get_group(), "cpu")
    apply_fsdp(model, meshes, compute_dtype=setup.compute_dtype, offload=setup.offload == "optimizer")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    cp = CPContext(meshes.cp.get_group()) if setup.cp > 1 else None
    cp_rank, dp_rank = meshes.cp.get_local_rank(), meshes.dp.get_local_rank()
    ids = torch.randint(0, config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(1 + dp_rank))
    batch = pack_documents([ids.tolist()], seq_len, config.shard_multiple)[0].cut(cp_rank, setup.cp,
                                                                                    config.shard_multiple)
    model.train()

    def step() -> None:
        out = forward_outputs(model, batch, cp)
        reduce_token_loss(out.loss_sum, out.label_count, meshes.dp_cp.get_group()).loss.backward()
        del out
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        update_load_balancing_bias(model, 1e-3, reduce=all_reduce_sum)

    step()  # the first step creates the optimizer state
    if cp is not None:
        cp.traffic.reset()
    with CollectiveTap() as tap, OffloadTap() as copies:
        step()
    records = {k: list(v) for k, v in tap.records.items()}
    if setup.offload == "optimizer":
        records.update(copies.records)
    return {"records": records, "counter": cp.traffic.as_dict() if cp is not None else {}, "cp_rank": cp_rank}


def _rank_body(rank: int, world_size: int, layouts: list[str], seq_len: int) -> dict:
    torch.set_num_threads(1)
    return {layout: _measure(rank, world_size, layout, seq_len) for layout in layouts}


def measure(layouts: list[str], seq_len: int) -> list[dict]:
    """Every layout's measured step on :data:`WORLD` gloo ranks (one start of the ranks for all of them)."""
    return run_on_ranks(_rank_body, WORLD, args=(list(layouts), seq_len))


def compare(layout: str, seq_len: int, per_rank: list[dict]) -> dict:
    """The plan's and the measured bytes of ``layout`` per compared kind: ``{kind: {"planned": (sent, received),
    "measured": (sent, received), "ratio": (sent, received)}}`` (measured / planned; 1.0 where both are 0), plus
    ``small`` (the small all-reduces' bytes sent) and ``total`` (every byte measured sent) and anything measured
    that no kind claims (``unattributed``)."""
    from dsv4.plan.plan import memory_plan

    plan = memory_plan(plan_setup(layout, seq_len))
    planned = plan.comm.by_kind()
    results = [r[layout] for r in per_rank]
    last = max(range(len(results)), key=lambda r: results[r]["cp_rank"])  # the last CP rank: the one planned

    def measured(kind: str) -> tuple[float, float]:
        if kind == "ep":  # uniform routing is planned: the mean over the ranks
            rows = [r["records"].get("ep", [0, 0, 0]) for r in results]
            return sum(r[1] for r in rows) / len(rows), sum(r[2] for r in rows) / len(rows)
        row = results[last]["records"].get(kind, [0, 0, 0])
        return row[1], row[2]

    out: dict = {}
    for kind, plan_kinds in COMPARED.items():
        want = (sum(planned[k].sent for k in plan_kinds), sum(planned[k].received for k in plan_kinds))
        got = measured(kind)
        out[kind] = {"planned": want, "measured": got,
                     "ratio": tuple(round(g / w, 4) if w else (1.0 if not g else None) for g, w in zip(got, want))}
    mine = results[last]["records"]
    out["small"] = mine.get(SMALL, [0, 0, 0])[1]
    out["total"] = sum(v[1] for v in mine.values())
    out["unattributed"] = {k: v for k, v in mine.items() if k.startswith("unattributed")}
    out["cp_counter"] = (sum(v["bytes_sent"] for v in results[last]["counter"].values()),
                         sum(v["bytes_received"] for v in results[last]["counter"].values()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    per_rank = measure(args.layouts, args.seq_len)
    for layout in args.layouts:
        result = compare(layout, args.seq_len, per_rank)
        shape = {"layout": layout, **LAYOUTS[layout], "world": WORLD, "seq_len": args.seq_len, "model": "tiny"}
        for kind in COMPARED:
            r = result[kind]
            for i, side in enumerate(("sent", "received")):
                emit(f"comm_plan.{side}.planned", {**shape, "kind": kind}, r["planned"][i], "bytes")
                emit(f"comm_plan.{side}.measured", {**shape, "kind": kind}, r["measured"][i], "bytes")
                emit(f"comm_plan.{side}.measured_over_planned", {**shape, "kind": kind}, r["ratio"][i], "x")
        emit("comm_plan.cp_counter", {**shape, "directions": "sent, received"}, list(result["cp_counter"]), "bytes")
        emit("comm_plan.small_all_reduces", shape, result["small"], "bytes")
        emit("comm_plan.small_all_reduces_share", shape, round(result["small"] / max(result["total"], 1), 6), "x")
        emit("comm_plan.unattributed", shape, result["unattributed"], "records")


if __name__ == "__main__":
    main()

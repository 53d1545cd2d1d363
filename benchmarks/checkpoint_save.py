"""Time training is blocked per checkpoint save: synchronous against asynchronous (``checkpoint.async_save``).

Two gloo ranks hold an FSDP2-sharded model (data parallel over both) and its AdamW state after one step. Each save
goes through :class:`dsv4.training.checkpoint_writer.CheckpointWriter` the way the strategy calls it: collect the
model and optimizer state dicts (offloaded to the host for a synchronous save; left to DCP's staging copy for an
asynchronous one), then ``save``. Measured per save, the median over ``--saves`` saves of the slower rank:

* ``checkpoint_save.blocked`` (``mode`` sync / async): seconds from the start of the save until the training step
  could continue (the synchronous save returns after the commit; the asynchronous one after staging);
* ``checkpoint_save.committed``: seconds until the checkpoint is complete on disk (the asynchronous write overlaps
  the training steps that follow it; here nothing runs beside it).

The shape names the model and the bytes each rank writes. No bound is asserted: the ratio depends on the disk and
on how much of the save is the host copy.

    python benchmarks/checkpoint_save.py                   # hidden 512, 32 experts (669 MB fp32 + AdamW)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402  (benchmarks/common.py)


def _rank(rank: int, world_size: int, args, root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp
    from dsv4.training.checkpoint_writer import CheckpointWriter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = DSV4Config.preset("tiny", hidden_size=args.hidden, moe_intermediate_size=args.hidden,
                               n_routed_experts=args.experts, q_lora_rank=args.hidden // 2,
                               o_lora_rank=args.hidden // 2)
    model = DSV4ForCausalLM(config)
    apply_fsdp(model, build_meshes(ParallelDims(world_size=world_size), "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    out = {}
    for mode in ("sync", "async"):
        asynchronous = mode == "async"
        group = dist.new_group(backend="gloo") if asynchronous else None
        writer = CheckpointWriter(rank, lambda name: dist.barrier(), async_save=asynchronous, process_group=group)
        options = StateDictOptions(cpu_offload=not asynchronous)
        blocked, committed, nbytes = [], [], 0
        for i in range(args.saves):
            dist.barrier()
            start = time.perf_counter()
            state = {"state_dict": get_model_state_dict(model, options=options),
                     "optimizer_0": get_optimizer_state_dict(model, optimizer, options=options)}
            writer.save(state, {"step": i}, Path(root) / mode / f"step{i}.ckpt")
            blocked.append(time.perf_counter() - start)
            writer.finish()
            committed.append(time.perf_counter() - start)
            nbytes = sum(f.stat().st_size for f in (Path(root) / mode / f"step{i}.ckpt").glob(f"__{rank}_*.distcp"))
        out[mode] = {"blocked": blocked, "committed": committed, "bytes": nbytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    from dsv4.launch import run_on_ranks

    with tempfile.TemporaryDirectory() as root:
        ranks = run_on_ranks(_rank, 2, (args, root))
    for mode in ("sync", "async"):
        shape = {"hidden": args.hidden, "experts": args.experts, "ranks": 2, "mode": mode,
                 "bytes_per_rank": max(r[mode]["bytes"] for r in ranks), "saves": args.saves}
        for name in ("blocked", "committed"):
            slowest = [max(r[mode][name][i] for r in ranks) for i in range(args.saves)]
            emit(f"checkpoint_save.{name}", shape, round(statistics.median(slowest), 4), "s")


if __name__ == "__main__":
    main()

"""Balanced CP: per-rank work of the contiguous split against the head-tail layout (``cp_balance=full``).

Two measurements, one JSON object each:

* ``cp_balance.flops_max_over_mean`` (and ``..._max_over_min``): from the FLOP model (:func:`dsv4.flops.
  cp_rank_training_flops`), the training FLOPs each CP rank does for one causal document of ``S`` tokens, for the
  whole step and for the position-dependent part alone (indexer scoring and compressed attention, whose per-query
  cost grows with the position). A first-principles count of the model's work, independent of the implementation.
* ``cp_balance.step_cpu_s``: measured, on ``--ranks`` gloo ranks of this machine: each rank's CPU time (process
  time, one thread per rank) of a tiny-model forward+backward on one document of ``--seq-len`` tokens, per layout,
  after a warm-up step; ``cp_balance.step_cpu_max_over_min`` is the straggler factor (the step waits for the
  slowest rank). CPU time, not wall time: the ranks share this machine's cores, and a rank waiting for another's
  exchange sleeps in gloo, so its CPU time is its own work.

    python benchmarks/cp_balance.py                       # FLOPs at CP 8 / S = 128K (flash, pro) + 4 ranks at 32K
    python benchmarks/cp_balance.py --seq-len 8192 --steps 1
"""

from __future__ import annotations

import argparse
import time

from common import cp_training_step, emit
from dsv4.launch import run_on_ranks


def _rank_body(rank: int, world_size: int, seq_len: int, balance: str, steps: int) -> list[float]:
    import torch

    from dsv4.config import DSV4Config

    torch.set_num_threads(1)
    config = DSV4Config.preset("tiny")
    times = []
    for step in range(steps + 1):  # the first is a warm-up
        _, start = cp_training_step(config, seq_len, world_size, before_step=time.process_time, balance=balance)
        if step:
            times.append(time.process_time() - start)
    return times


def main() -> None:
    from dsv4.config import DSV4Config
    from dsv4.flops import POSITION_DEPENDENT_KEYS, cp_rank_training_flops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["flash", "pro"])
    parser.add_argument("--flops-seq-len", type=int, default=131072)
    parser.add_argument("--flops-cp", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    for name in args.models:
        config = DSV4Config.preset(name)
        for cp in args.flops_cp:
            for balance in ("none", "full"):
                for part, keys in (("step", None), ("position_dependent", POSITION_DEPENDENT_KEYS)):
                    flops = cp_rank_training_flops(config, args.flops_seq_len, cp, balance, keys)
                    shape = {"model": name, "seq_len": args.flops_seq_len, "cp": cp, "cp_balance": balance,
                             "work": part}
                    emit("cp_balance.flops_max_over_mean", shape, round(max(flops) * len(flops) / sum(flops), 4),
                         "ratio")
                    emit("cp_balance.flops_max_over_min", shape, round(max(flops) / min(flops), 4), "ratio")
    for balance in ("none", "full"):
        per_rank = run_on_ranks(_rank_body, args.ranks, args=(args.seq_len, balance, args.steps))
        shape = {"model": "tiny", "seq_len": args.seq_len, "cp": args.ranks, "cp_balance": balance,
                 "steps": args.steps, "threads_per_rank": 1}
        means = [sum(t) / len(t) for t in per_rank]
        for rank, value in enumerate(means):
            emit("cp_balance.step_cpu_s", {**shape, "rank": rank}, round(value, 3), "s")
        emit("cp_balance.step_cpu_max_over_min", shape, round(max(means) / min(means), 3), "ratio")
        flops = cp_rank_training_flops(DSV4Config.preset("tiny"), args.seq_len, args.ranks, balance)
        emit("cp_balance.flops_max_over_min", {**shape, "work": "step"}, round(max(flops) / min(flops), 4), "ratio")


if __name__ == "__main__":
    main()

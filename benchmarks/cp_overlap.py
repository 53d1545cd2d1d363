"""How much of the CP exchange time the model hides by starting its exchanges early (``CPContext.overlap``).

The attention layer starts the K/V halo and the compressor boundaries before the query projections and the
compressors, and the compressed-row gather before the index keys and the indexer, and waits where each result is
first needed. With ``overlap=False`` every exchange is waited for right where it starts. On ``--ranks`` gloo ranks
(tiny model, one document of ``--seq-len`` tokens, forward+backward, one thread per rank), per rank and overlap
setting: the forward time blocked waiting for the halo / boundary / preceding-row messages
(``cp_overlap.wait_s``, summed over the exchange kinds and ``--steps`` steps after a warm-up) and the step's wall
time. ``cp_overlap.hidden_fraction`` = 1 - blocked(overlap) / blocked(no overlap), over all ranks: the share of
the exchange time that the overlap took off the critical path. The backward exchanges run where autograd reaches
them and are not counted.

    python benchmarks/cp_overlap.py                       # 4 ranks, S = 16384, contiguous and balanced layouts
    python benchmarks/cp_overlap.py --ranks 2 --seq-len 4096 --steps 1
"""

from __future__ import annotations

import argparse
import time

from common import cp_training_step, emit
from dsv4.launch import run_on_ranks

KINDS = ("halo", "compressor_halo", "index_compressor_halo", "compressed_gather", "index_key_gather")


def _rank_body(rank: int, world_size: int, seq_len: int, balance: str, overlap: bool, steps: int) -> dict:
    import torch

    from dsv4.config import DSV4Config

    torch.set_num_threads(1)
    config = DSV4Config.preset("tiny")
    wait, wall = 0.0, 0.0
    for step in range(steps + 1):  # the first is a warm-up
        cp, start = cp_training_step(config, seq_len, world_size, before_step=time.perf_counter, balance=balance,
                                     overlap=overlap)
        if step:
            wall += time.perf_counter() - start
            wait += sum(cp.traffic.wait_seconds(kind) for kind in KINDS)
    return {"wait": wait / steps, "wall": wall / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--balance", nargs="*", default=["none", "full"])
    args = parser.parse_args()
    for balance in args.balance:
        blocked = {}
        for overlap in (False, True):
            per_rank = run_on_ranks(_rank_body, args.ranks, args=(args.seq_len, balance, overlap, args.steps))
            shape = {"model": "tiny", "seq_len": args.seq_len, "cp": args.ranks, "cp_balance": balance,
                     "overlap": overlap, "steps": args.steps, "kinds": list(KINDS)}
            for rank, res in enumerate(per_rank):
                emit("cp_overlap.wait_s", {**shape, "rank": rank}, round(res["wait"], 4), "s")
            emit("cp_overlap.wait_s.sum_over_ranks", shape, round(sum(r["wait"] for r in per_rank), 4), "s")
            emit("cp_overlap.step_wall_s.max_over_ranks", shape, round(max(r["wall"] for r in per_rank), 3), "s")
            blocked[overlap] = sum(r["wait"] for r in per_rank)
        shape = {"model": "tiny", "seq_len": args.seq_len, "cp": args.ranks, "cp_balance": balance}
        hidden = 1 - blocked[True] / blocked[False] if blocked[False] > 0 else 0.0
        emit("cp_overlap.hidden_fraction", shape, round(hidden, 3), "fraction")


if __name__ == "__main__":
    main()

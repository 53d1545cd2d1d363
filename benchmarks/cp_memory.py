"""Peak host memory per rank of a tiny-model training step at CP = 1, 2, 4 for the same global sequence.

Each CP size runs on its own set of gloo ranks (spawned processes): the model is built, the batch (one unpacked
document of ``--seq-len`` tokens) is sharded, then one forward+backward runs. Memory is the peak resident set size
of the step minus the resident size just before it (``ru_maxrss`` high-water mark minus ``/proc/self/statm``), so
model weights and the Python runtime are excluded and what remains is activations, gathered rows and gradients.
Prints one JSON object per CP size and rank (``cp_memory.peak_rss_delta``, MiB) plus the max over ranks.

    python benchmarks/cp_memory.py                   # S = 16384, CP = 1, 2, 4
    python benchmarks/cp_memory.py --seq-len 4096 --cp 1 2
"""

from __future__ import annotations

import argparse

import torch

from common import current_rss_kib, emit, peak_rss_kib
from dsv4.launch import run_on_ranks


def _rank_body(rank: int, world_size: int, seq_len: int) -> float:
    import torch.distributed as dist

    from dsv4.config import DSV4Config
    from dsv4.cp import CPContext, dsv4_cp_sharder
    from dsv4.model import DSV4ForCausalLM
    from dsv4.training.loss import reduce_token_loss

    torch.manual_seed(0)
    config = DSV4Config.preset("tiny")
    model = DSV4ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    group = dist.new_group(list(range(world_size)))
    _, local = dsv4_cp_sharder(config, group).shard({"input_ids": ids, "labels": labels})
    cp = CPContext(group) if world_size > 1 else None
    base = current_rss_kib()
    out = model(**local, cp=cp)
    reduce_token_loss(out.loss_sum, out.label_count, group).loss.backward()
    return max(peak_rss_kib() - base, 0) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    args = parser.parse_args()
    for cp in args.cp:
        peaks = run_on_ranks(_rank_body, cp, args=(args.seq_len,))
        shape = {"preset": "tiny", "seq_len": args.seq_len, "cp": cp, "local_len": args.seq_len // cp,
                 "step": "forward+backward", "dtype": "float32"}
        for rank, mib in enumerate(peaks):
            emit("cp_memory.peak_rss_delta", {**shape, "rank": rank}, round(mib, 1), "MiB")
        emit("cp_memory.peak_rss_delta.max_over_ranks", shape, round(max(peaks), 1), "MiB")


if __name__ == "__main__":
    main()

"""Batch preparation throughput: DSV4 packed repad + contiguous CP shard.

Prints one JSON object per measurement: the time to repad and shard ``rows x seq_len`` tokens with ``docs``
documents per row at ``pad_multiple`` and CP size ``cp`` (median of ``--repeats`` runs, single process, the rank
played by a :class:`~dsv4.cp.SimulatedMesh`; every rank does the same work), as tokens per second of input.

    python benchmarks/batch_prep.py                    # 8 x 16384 tokens, 64 docs/row, multiple 128, CP 4
    python benchmarks/batch_prep.py --rows 2 --seq-len 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import emit
from dsv4.cp import SimulatedMesh, make_dsv4_contiguous_shard_cp_batch_and_ctx


def make_batch(rows: int, seq_len: int, docs: int, seed: int = 0) -> dict:
    """Rows of ``docs`` documents of random lengths that fill ``seq_len`` exactly; labels on every token."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(seq_len - 1, generator=g)[: docs - 1] + 1).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq_len])])
    lengths = (bounds[1:] - bounds[:-1]).expand(rows, docs).contiguous()
    ids = torch.randint(0, 32000, (rows, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "seq_lens": lengths, "seq_lens_padded": lengths.clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--pad-multiple", type=int, default=128)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    batch = make_batch(args.rows, args.seq_len, args.docs)
    times = []
    for i in range(args.repeats + 1):
        fresh = {k: v.clone() for k, v in batch.items()}
        start = time.perf_counter()
        _, local, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(
            SimulatedMesh(args.cp, args.cp - 1), None, fresh, pad_multiple=args.pad_multiple
        )
        if i:  # the first run warms up allocator and kernels
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    shape = {"rows": args.rows, "seq_len": args.seq_len, "docs_per_row": args.docs,
             "pad_multiple": args.pad_multiple, "cp": args.cp, "padded_len": layout.padded_seq_len,
             "threads": torch.get_num_threads()}
    emit("batch_prep.repad_shard.throughput", shape, round(args.rows * args.seq_len / seconds, 1), "tokens/s")
    emit("batch_prep.repad_shard.latency", shape, round(seconds * 1e3, 3), "ms")


if __name__ == "__main__":
    main()

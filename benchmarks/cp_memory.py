"""Peak host memory per rank of a tiny-model training step at CP = 1, 2, 4 for the same global sequence.

Each CP size runs on its own set of gloo ranks (processes started by dsv4.launch): the model is built, the batch (one
document of ``--seq-len`` tokens) is cut for the rank, then one forward+backward runs. Memory is the peak resident set
size of the step minus the resident size just before it: the high-water mark is reset right before the step
(``/proc/self/clear_refs``), so model construction and start-up do not count, only activations, received rows and
gradients.
Prints one JSON object per CP size and rank (``cp_memory.peak_rss_delta``, MiB) plus the max over ranks.

    python benchmarks/cp_memory.py                   # S = 16384, CP = 1, 2, 4
    python benchmarks/cp_memory.py --seq-len 4096 --cp 1 2
"""

from __future__ import annotations

import argparse

from common import cp_training_step, current_rss_kib, emit, peak_rss_kib, reset_peak_rss
from dsv4.launch import run_on_ranks


def _rank_body(rank: int, world_size: int, seq_len: int) -> float:
    from dsv4.config import DSV4Config

    def before_step() -> int:
        reset_peak_rss()
        return current_rss_kib()

    _, base = cp_training_step(DSV4Config.preset("tiny"), seq_len, world_size, before_step=before_step)
    return max(peak_rss_kib() - base, 0) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    args = parser.parse_args()
    results = {}
    for cp in args.cp:
        peaks = run_on_ranks(_rank_body, cp, args=(args.seq_len,))
        shape = {"preset": "tiny", "seq_len": args.seq_len, "cp": cp, "local_len": args.seq_len // cp,
                 "step": "forward+backward", "dtype": "float32"}
        for rank, mib in enumerate(peaks):
            emit("cp_memory.peak_rss_delta", {**shape, "rank": rank}, round(mib, 1), "MiB")
        emit("cp_memory.peak_rss_delta.max_over_ranks", shape, round(max(peaks), 1), "MiB")
        results[cp] = max(peaks)
    if 1 in results:
        for cp in sorted(results):
            if cp > 1:
                emit("cp_memory.ratio_to_cp1", {"preset": "tiny", "seq_len": args.seq_len, "cp": cp},
                     round(results[cp] / results[1], 3), "ratio")


if __name__ == "__main__":
    main()

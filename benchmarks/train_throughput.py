"""Training throughput of the recipe at CP = 1, 2, 4 for the same global sequence, and the corpus padding.

* ``train_throughput.tokens_per_s``: steady-state real tokens per second of ``recipes/finetune.py`` (tiny model,
  bundled corpus, CSV logger) for each CP size at ``--seq-len``: the real tokens of every step after the first
  ``--warmup`` steps divided by the sum of those steps' own times. The throughput callback runs with
  ``warmup_steps=--warmup`` and ``window=1``, so it logs a step's own time and nothing of a warm-up step.
* ``train_throughput.padding_fraction`` (+ ``pack_padding_fraction`` / ``alignment_padding_fraction``): of the
  bundled corpus packed at seq_len 4096 and 16384 with the tiny model's alignment (128).

    python benchmarks/train_throughput.py                    # seq_len 4096, cp 1 2 4, 8 steps each
    python benchmarks/train_throughput.py --cp 1 2 --steps 5 --seq-len 2048
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit
from dsv4.config import DSV4Config
from dsv4.data import build_documents, pack_documents

REPO = Path(__file__).resolve().parents[1]


def recipe_tokens_per_s(cp: int, seq_len: int, steps: int, warmup: int, max_bytes: int) -> tuple[float, int]:
    """``(tokens/s over the measured steps, number of measured steps)`` of one recipe run."""
    if steps <= warmup:
        raise ValueError(f"--steps {steps} must exceed --warmup {warmup}")
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, str(REPO / "recipes/finetune.py"), f"cp={cp}", f"seq_len={seq_len}",
               f"trainer.max_steps={steps}", "logger=csv", "checkpoint.every_n_steps=0",
               f"data.max_bytes={max_bytes}", f"callbacks.throughput.warmup_steps={warmup}",
               "callbacks.throughput.window=1", f"hydra.run.dir={run_dir}"]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with open(Path(run_dir) / "csv" / "metrics.csv") as f:
            measured = [row for row in csv.DictReader(f) if row.get("perf/step_time_s")]
    tokens = sum(float(row["data/tokens_per_step"]) for row in measured)
    seconds = sum(float(row["perf/step_time_s"]) for row in measured)
    return tokens / seconds, len(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=3_000_000)
    parser.add_argument("--skip-training", action="store_true", help="only the padding measurements")
    parser.add_argument("--padding-seq-lens", type=int, nargs="*", default=[4096, 16384])
    args = parser.parse_args()

    multiple = DSV4Config.preset("tiny").shard_multiple
    documents = build_documents("stdlib", max_bytes=args.max_bytes)
    for seq_len in args.padding_seq_lens:
        stats = pack_documents(documents, seq_len, multiple).stats
        shape = {"corpus": "stdlib", "max_bytes": args.max_bytes, "documents": len(documents), "seq_len": seq_len,
                 "shard_multiple": multiple, "rows": stats.num_rows}
        emit("train_throughput.padding_fraction", shape, round(stats.padding_fraction, 5), "fraction")
        emit("train_throughput.pack_padding_fraction", shape, round(stats.pack_padding / stats.total_slots, 5),
             "fraction")
        emit("train_throughput.alignment_padding_fraction", shape,
             round(stats.alignment_padding / stats.total_slots, 5), "fraction")
    if args.skip_training:
        return
    for cp in args.cp:
        value, measured = recipe_tokens_per_s(cp, args.seq_len, args.steps, args.warmup, args.max_bytes)
        emit("train_throughput.tokens_per_s", {"preset": "tiny", "seq_len": args.seq_len, "cp": cp,
                                               "steps": args.steps, "warmup": args.warmup,
                                               "steps_measured": measured, "device": "cpu"},
             round(value, 1), "tokens/s")


if __name__ == "__main__":
    main()

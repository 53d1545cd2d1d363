"""Checkpoint load throughput and peak memory for a synthetic multi-shard release-format checkpoint.

The parent builds a small DSV4 model, exports it re-quantised (FP8 block + packed FP4, like the release) into
``--shards`` safetensors files, then loads it in a fresh child process (so the export's memory high-water mark
does not count): the child builds the model, records its resident size, loads the checkpoint with
:func:`dsv4.checkpoint.load_hf_checkpoint` and reports

* ``checkpoint_load.throughput``: GB/s of safetensors bytes read (files are warm in the page cache: this measures
  the loader, read + dequantise + copy, not the disk);
* ``checkpoint_load.peak_rss_delta_over_largest_shard``: (peak RSS during the load - RSS before it) / size of the
  largest shard. A loader that held a whole shard (or the whole checkpoint) would be >= 1 (or >= shards).

    python benchmarks/checkpoint_load.py                      # ~60 MB, 4 shards
    python benchmarks/checkpoint_load.py --hidden 512 --experts 32 --shards 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import current_rss_kib, emit, peak_rss_kib, reset_peak_rss  # noqa: E402  (benchmarks/common.py)


def _config(args):
    from dsv4.config import DSV4Config

    return DSV4Config.preset(
        "tiny",
        hidden_size=args.hidden,
        moe_intermediate_size=args.hidden,
        n_routed_experts=args.experts,
        vocab_size=4096,
        q_lora_rank=args.hidden // 2,
        o_lora_rank=args.hidden // 2,
        num_nextn_predict_layers=0,
        compress_ratios=[0, 4, 128, 4],
    )


def _child(args) -> None:
    import gc

    import torch

    from dsv4.checkpoint import load_hf_checkpoint
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(1)
    model = DSV4ForCausalLM(_config(args))
    gc.collect()
    base = current_rss_kib()
    reset_peak_rss()
    report = load_hf_checkpoint(model, args.dir)
    peak = peak_rss_kib()
    print(json.dumps({"bytes": report.bytes_read, "seconds": report.seconds, "keys": len(report.keys_read),
                      "peak_delta_kib": max(peak - base, 0)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # small tensors: intra-op threads only add contention on a shared CPU
    if args.child:
        _child(args)
        return

    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.checkpoint.export import convert_for_export, iter_hf_tensors
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    model = DSV4ForCausalLM(_config(args))
    total = sum(t.numel() * t.element_size() for k, v in iter_hf_tensors(model) for _, t in convert_for_export(k, v, "quantized"))
    with tempfile.TemporaryDirectory() as tmp:
        report = export_hf_checkpoint(model, tmp, dtype="quantized", max_shard_bytes=-(-total // args.shards))
        del model
        largest = max(os.path.getsize(os.path.join(tmp, f)) for f in report.files)
        cmd = [sys.executable, __file__, "--child", "--dir", tmp, "--hidden", str(args.hidden),
               "--experts", str(args.experts), "--shards", str(args.shards)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        res = json.loads(out)
    shape = {"hidden": args.hidden, "experts": args.experts, "shards": len(report.files), "total_bytes": report.total_size,
             "largest_shard_bytes": largest, "tensors": report.num_tensors, "format": "fp8+fp4 (release)"}
    emit("checkpoint_load.throughput", shape, round(res["bytes"] / 1e9 / res["seconds"], 4), "GB/s")
    emit("checkpoint_load.peak_rss_delta_over_largest_shard", shape,
         round(res["peak_delta_kib"] * 1024 / largest, 4), "ratio")


if __name__ == "__main__":
    main()

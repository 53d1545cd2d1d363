"""Peak extra memory of the HF export (one process, and per rank of a 2-rank EP export) and of the DCP converter.

Each measurement resets the RSS high-water mark just before the export and reports (peak RSS - RSS before it)
divided by the largest tensor of the model in fp32, the unit of the bound stated in ``docs/checkpoints.md`` (one
gathered tensor, its fp32 temporaries and its converted form); the model's total size is printed beside it, so an
export that held a shard or the model would show a ratio near ``total / largest``.

* ``checkpoint_export.one_process``: ``export_hf_checkpoint`` of the whole model (bfloat16);
* ``checkpoint_export.ep2_rank{0,1}``: each rank of a 2-rank gloo run (``ep=2``, experts sharded) exporting together;
* ``checkpoint_export.convert``: ``python -m dsv4.checkpoint export`` on a DCP checkpoint of the same weights, in a
  fresh process (the model is never built: meta device); the second of two conversions there is measured, so the
  one-time start-up (lazy imports, first-call initialisation: about 100 MB whatever the model) is not counted.

    python benchmarks/checkpoint_export.py                    # hidden 512, 32 experts, vocab 32768
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


def _config(hidden: int, experts: int, vocab: int):
    from dsv4.config import DSV4Config

    return DSV4Config.preset("tiny", hidden_size=hidden, moe_intermediate_size=hidden, n_routed_experts=experts,
                             vocab_size=vocab, q_lora_rank=hidden // 2, o_lora_rank=hidden // 2)


def _model(args):
    import torch

    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(_config(args.hidden, args.experts, args.vocab))


def _measured_export(model, out: str) -> int:
    import gc

    from dsv4.checkpoint import export_hf_checkpoint

    gc.collect()
    base = current_rss_kib()
    reset_peak_rss()
    export_hf_checkpoint(model, out, dtype="bfloat16", max_shard_bytes=64 * 2**20)
    return max(peak_rss_kib() - base, 0) * 1024


def _ep_rank(rank, world_size, args, out):
    import torch

    torch.set_num_threads(1)
    from dsv4.parallel.expert_shard import shard_experts

    model = _model(args)
    shard_experts(model)
    return _measured_export(model, out)


def _convert_child(ckpt: str, out: str) -> None:
    import gc

    from dsv4.checkpoint.convert import export_run

    # a first conversion pays the one-time start-up (lazy imports, first-call initialisation: about 100 MB, whatever
    # the model); the second, measured, shows what the conversion itself holds
    export_run(ckpt, out + "-warm-up", dtype="bfloat16", max_shard_bytes=64 * 2**20)
    gc.collect()
    base = current_rss_kib()
    reset_peak_rss()
    export_run(ckpt, out, dtype="bfloat16", max_shard_bytes=64 * 2**20)
    print(json.dumps({"peak_delta": max(peak_rss_kib() - base, 0) * 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--convert-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.convert_child:
        _convert_child(*args.convert_child)
        return
    import torch.distributed.checkpoint as dcp

    from dsv4.launch import run_on_ranks

    model = _model(args)
    state = model.state_dict()
    largest = max(t.numel() * 4 for t in state.values())
    total = sum(t.numel() * t.element_size() for t in state.values())
    shape = {"hidden": args.hidden, "experts": args.experts, "vocab": args.vocab, "model_bytes": total,
             "largest_tensor_fp32_bytes": largest}
    with tempfile.TemporaryDirectory() as tmp:
        one = _measured_export(model, f"{tmp}/one")
        ckpt = f"{tmp}/run/checkpoints/last.ckpt"
        dcp.save({"state_dict": {f"model.{k}": v for k, v in state.items()}}, checkpoint_id=ckpt, no_dist=True)
        torch.save({"dsv4": {"config": model.config.to_dict()}}, f"{ckpt}/meta.pt")
        del model, state
        ranks = run_on_ranks(_ep_rank, 2, (args, f"{tmp}/ep"))
        cmd = [sys.executable, __file__, "--convert-child", ckpt, f"{tmp}/converted"]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        for name in sorted(os.listdir(f"{tmp}/one")):  # the same files all three ways
            data = Path(f"{tmp}/one/{name}").read_bytes()
            assert Path(f"{tmp}/ep/{name}").read_bytes() == data == Path(f"{tmp}/converted/{name}").read_bytes(), name
    emit("checkpoint_export.one_process", shape, round(one / largest, 3), "x largest tensor (fp32)")
    for rank, value in enumerate(ranks):
        emit(f"checkpoint_export.ep2_rank{rank}", shape, round(value / largest, 3), "x largest tensor (fp32)")
    emit("checkpoint_export.convert", shape, round(res["peak_delta"] / largest, 3), "x largest tensor (fp32)")


if __name__ == "__main__":
    main()

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
* ``checkpoint_export.convert_merge``: ``... export --merge`` of a LoRA run's checkpoint (rank 8, every target,
  base kept in FP8 / FP4 from a quantized ``model.checkpoint``; 16 layers and a 4096 vocabulary, so one block is a
  small part of the model), measured the same way, against the merged export of the same LoRA model in one
  process (same files). Its unit is the stated bound: the largest transformer block of the base in its kept format
  plus, for the largest tensor, three fp32 copies (the dequantised base, the scaled low-rank update, their sum) and
  its bf16 form (``merge_bound_bytes``);
  ``kept_model_bytes`` is the whole kept model, what a merge that held the model would need.

    python benchmarks/checkpoint_export.py                    # hidden 512, 32 experts, vocab 32768
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import current_rss_kib, emit, peak_rss_kib, reset_peak_rss  # noqa: E402  (benchmarks/common.py)


def _config(hidden: int, experts: int, vocab: int, layers: int = 4):
    from dsv4.config import DSV4Config

    ratios = list(DSV4Config.preset("tiny").compress_ratios)
    return DSV4Config.preset("tiny", hidden_size=hidden, moe_intermediate_size=hidden, n_routed_experts=experts,
                             vocab_size=vocab, q_lora_rank=hidden // 2, o_lora_rank=hidden // 2,
                             num_hidden_layers=layers, compress_ratios=(ratios * layers)[:layers])


def _model(args, layers: int = 4, vocab: int | None = None):
    import torch

    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(_config(args.hidden, args.experts, vocab or args.vocab, layers))


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


def _convert_child(ckpt: str, out: str, merge: bool) -> None:
    import gc

    from dsv4.checkpoint.convert import export_run

    # a first conversion pays the one-time start-up (lazy imports, first-call initialisation: about 100 MB, whatever
    # the model); the second, measured, shows what the conversion itself holds
    export_run(ckpt, out + "-warm-up", dtype="bfloat16", max_shard_bytes=64 * 2**20, merge=merge)
    gc.collect()
    base = current_rss_kib()
    reset_peak_rss()
    export_run(ckpt, out, dtype="bfloat16", max_shard_bytes=64 * 2**20, merge=merge)
    print(json.dumps({"peak_delta": max(peak_rss_kib() - base, 0) * 1024}))


def _convert(ckpt: str, out: str, merge: bool = False) -> int:
    cmd = [sys.executable, __file__, "--convert-child", ckpt, out] + (["--merge"] if merge else [])
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    return res["peak_delta"]


LORA = dict(name="lora", rank=8, alpha=16.0, dropout=0.0,
            targets=["attention", "shared_experts", "routed_experts"], base_dtype="fp8")


MERGE_LAYERS, MERGE_VOCAB = 16, 4096  # many blocks, a small embedding: one block is a small part of the model


def _lora_run(args, tmp: str) -> tuple[str, int, int]:
    """A LoRA run's directory as a run leaves it (adapters-only DCP checkpoint, ``meta.pt``, ``resolved_config.yaml``)
    over a quantized base at ``tmp/base`` (``MERGE_LAYERS`` layers, vocab ``MERGE_VOCAB``), and the one-process merged
    export at ``tmp/merged-one``. Returns the run directory, the merge bound (largest kept block + 3.5 x largest
    fp32 tensor) and the whole kept model, in bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from dsv4.checkpoint import export_hf_checkpoint, load_hf_checkpoint
    from dsv4.checkpoint.convert import model_blocks
    from dsv4.peft import LoRAConfig, adapter_state, apply_lora
    from dsv4.peft.apply import merged_sources

    model = _model(args, layers=MERGE_LAYERS, vocab=MERGE_VOCAB)
    export_hf_checkpoint(model, f"{tmp}/base", dtype="quantized", max_shard_bytes=64 * 2**20)
    config = {k: v for k, v in LORA.items() if k != "name"}
    apply_lora(model, LoRAConfig(**config))
    load_hf_checkpoint(model, f"{tmp}/base")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    export_hf_checkpoint(model, f"{tmp}/merged-one", dtype="bfloat16", sources=merged_sources(model),
                         max_shard_bytes=64 * 2**20)
    ckpt = f"{tmp}/lora/checkpoints/last.ckpt"
    dcp.save({"state_dict": {f"model.{k}": v for k, v in adapter_state(model).items()}}, checkpoint_id=ckpt,
             no_dist=True)
    torch.save({"dsv4": {"config": model.config.to_dict()}}, f"{ckpt}/meta.pt")
    OmegaConf.save(OmegaConf.create({"peft": LORA, "model": {"checkpoint": f"{tmp}/base"}}),
                   f"{tmp}/lora/resolved_config.yaml")
    state = model.state_dict()
    blocks = {block: sum(state[n].numel() * state[n].element_size() for n in names)
              for block, names in model_blocks(model).items()}  # the blocks --merge loads one at a time
    largest = max(math.prod(s.shape) * 4 for s in merged_sources(model))
    return f"{tmp}/lora", max(blocks.values()) + int(3.5 * largest), sum(blocks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--convert-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--merge", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.convert_child:
        _convert_child(*args.convert_child, merge=args.merge)
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
        converted = _convert(ckpt, f"{tmp}/converted")
        for name in sorted(os.listdir(f"{tmp}/one")):  # the same files all three ways
            data = Path(f"{tmp}/one/{name}").read_bytes()
            assert Path(f"{tmp}/ep/{name}").read_bytes() == data == Path(f"{tmp}/converted/{name}").read_bytes(), name
        run, merge_bound, kept_model = _lora_run(args, tmp)
        merged = _convert(run, f"{tmp}/merged", merge=True)
        names = sorted(os.listdir(f"{tmp}/merged-one"))
        assert sorted(os.listdir(f"{tmp}/merged")) == names
        for name in names:
            assert Path(f"{tmp}/merged/{name}").read_bytes() == Path(f"{tmp}/merged-one/{name}").read_bytes(), name
    emit("checkpoint_export.one_process", shape, round(one / largest, 3), "x largest tensor (fp32)")
    for rank, value in enumerate(ranks):
        emit(f"checkpoint_export.ep2_rank{rank}", shape, round(value / largest, 3), "x largest tensor (fp32)")
    emit("checkpoint_export.convert", shape, round(converted / largest, 3), "x largest tensor (fp32)")
    merge_shape = {"hidden": args.hidden, "experts": args.experts, "vocab": MERGE_VOCAB, "layers": MERGE_LAYERS,
                   "kept_model_bytes": kept_model, "merge_bound_bytes": merge_bound}
    emit("checkpoint_export.convert_merge", merge_shape, round(merged / merge_bound, 3),
         "x (largest kept block + 3.5 x largest fp32 tensor)")


if __name__ == "__main__":
    main()

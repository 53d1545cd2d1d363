"""``python -m dsv4.checkpoint inspect DIR [--json]``: what a checkpoint directory holds, from the headers only.
``python -m dsv4.checkpoint export RUN_DIR [--step N] --out DIR [--dtype ...] [--adapter | --merge] [--overwrite]``: a run's DCP checkpoint -> the HF
files ``export.hf_dir`` writes (:mod:`dsv4.checkpoint.convert`).

Prints the layout (``release`` or ``transformers``, :mod:`dsv4.checkpoint.layouts`), the ``config.json`` summary and
whether :func:`~dsv4.checkpoint.hf_config.config_from_hf` accepts it (else the refusal, naming the field), the
tensor count, a per-dtype census (tensors and bytes), the shard count and the total size. No tensor data is read. A bad directory or file
(missing, unreadable, a refused header or index, see :mod:`dsv4.checkpoint.safetensors_io`) prints one
``error: ...`` line naming it on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from dsv4.checkpoint.hf_config import config_from_hf, read_hf_config_dict
from dsv4.checkpoint.layouts import detect_layout
from dsv4.checkpoint.safetensors_io import CheckpointDir


def inspect(path: str) -> dict:
    ckpt = CheckpointDir.open(path)
    count: Counter = Counter()
    size: Counter = Counter()
    for info in ckpt.tensors.values():
        count[info.dtype] += 1
        size[info.dtype] += info.nbytes
    out: dict = {
        "path": path,
        "num_tensors": len(ckpt.tensors),
        "num_shards": len(ckpt.files),
        "has_index": ckpt.has_index,
        "layout": detect_layout(ckpt.tensors),
        "has_mtp": any(k.startswith("mtp.") for k in ckpt.tensors),
        "total_bytes": sum(size.values()),
        "dtypes": {k: {"tensors": count[k], "bytes": size[k]} for k in sorted(count)},
    }
    try:
        raw = read_hf_config_dict(path)
    except FileNotFoundError as e:
        out["config"] = None
        out["config_error"] = str(e)
        return out
    out["config"] = raw
    try:
        cfg = config_from_hf(raw)
        out["config_valid"] = True
        out["dsv4_config"] = {k: getattr(cfg, k) for k in _READ_AS}
    except (ValueError, TypeError, KeyError) as e:
        out["config_valid"] = False
        out["config_error"] = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return out


_SUMMARY_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "vocab_size", "num_attention_heads", "head_dim",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "num_hash_layers", "compress_ratios",
    "torch_dtype", "dtype", "quantization_config", "expert_dtype", "layer_types", "compress_rates", "mlp_layer_types",
    "rope_scaling", "rope_parameters",
)


# what a transformers config is translated into (dsv4.checkpoint.hf_config), printed beside the file's fields
_READ_AS = ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_theta", "compress_rope_theta",
            "rope_scaling", "topk_method")


def _print_text(info: dict) -> None:
    print(f"checkpoint: {info['path']} ({info['layout']} layout, " + ("with" if info["has_mtp"] else "no")
          + " MTP weights)")
    cfg = info.get("config")
    if cfg is None:
        print(f"config: missing ({info.get('config_error')})")
    else:
        print("config:")
        for k in _SUMMARY_FIELDS:
            if k in cfg:
                print(f"  {k}: {json.dumps(cfg[k])}")
        print(f"  valid DSV4Config: {info['config_valid']}" + ("" if info["config_valid"] else f" ({info['config_error']})"))
        if info["config_valid"]:
            print("read by dsv4 as: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in info["dsv4_config"].items()))
    print(f"tensors: {info['num_tensors']} in {info['num_shards']} shard(s) (index file: {info['has_index']})")
    print("dtypes:")
    for k, v in info["dtypes"].items():
        print(f"  {k:8s} {v['tensors']:8d} tensors {v['bytes'] / 1e9:12.6f} GB")
    print(f"total size: {info['total_bytes']} bytes ({info['total_bytes'] / 1e9:.6f} GB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="config, tensor count, dtypes and size, without loading weights")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    e = sub.add_parser("export", help="a run's distributed checkpoint -> HF safetensors (one CPU process)")
    e.add_argument("run_dir", help="the run directory (or one of its *.ckpt directories)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: last.ckpt)")
    e.add_argument("--out", required=True, help="the output directory")
    e.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "quantized"))
    e.add_argument("--adapter", action="store_true", help="a LoRA run: write its PEFT adapter (export.adapter_dir)")
    e.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the merged model (export.merge), the base read from its model.checkpoint")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out and remove every file there the export does not write")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "export":
        return _export(args)
    try:
        info = inspect(args.dir)
    except (OSError, ValueError, KeyError) as e:  # a bad file or directory: one line naming it, no traceback
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print("error: " + " ".join(str(msg).split()), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        _print_text(info)
    return 0


def _export(args) -> int:
    from dsv4.checkpoint.convert import export_run

    try:
        report = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype, progress=not args.no_progress,
                            adapter=args.adapter, merge=args.merge, overwrite=args.overwrite)
    except (OSError, ValueError, KeyError) as e:  # a bad checkpoint: one line naming the file, no traceback
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print("error: " + " ".join(str(msg).split()), file=sys.stderr)
        return 2
    print(f"wrote {report.num_tensors} tensors ({report.total_size} bytes) in {len(report.files)} file(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

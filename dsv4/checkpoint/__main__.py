"""``python -m dsv4.checkpoint inspect DIR [--json]``: what a checkpoint directory holds, from the headers only.
``python -m dsv4.checkpoint export RUN_DIR [--step N] --out DIR [--dtype ...] [--adapter | --merge] [--overwrite]``: a run's DCP checkpoint -> the HF
files ``export.hf_dir`` writes (:mod:`dsv4.checkpoint.convert`).

Prints the layout (``release`` or ``transformers``, :mod:`dsv4.checkpoint.layouts`), the family (``deepseek_v4`` or
``deepseek_v41``, from ``model_type``), the ``config.json`` summary and whether
:func:`~dsv4.checkpoint.hf_config.config_from_hf` accepts it (else the refusal, naming the field), the weight
formats (``quantization_config``), the tensor count, a per-dtype census (tensors and bytes), the shard count and the
total size. For a V4.1 directory also: each backbone layer's attention role (window / full / reindex / reuse, its
compress ratio, the candidate source, Engram), the Engram tables (rows x head_dim, dtype, bytes with their scales)
and what a load would skip (the groups :func:`dsv4.checkpoint.keys.skip_reason` names, with their tensor counts). No
tensor data is read. A bad directory or file
(missing, unreadable, a refused header or index, see :mod:`dsv4.checkpoint.safetensors_io`) prints one
``error: ...`` line naming it on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.hf_config import (
    checkpoint_family,
    config_from_hf,
    quant_scheme_of,
    read_hf_config_dict,
)
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
        family = checkpoint_family(raw)
    except ValueError:
        family = None
    out["family"] = family
    cfg = None
    try:
        cfg = config_from_hf(raw)
        out["config_valid"] = True
        out["config_class"] = type(cfg).__name__
        out["dsv4_config"] = {k: getattr(cfg, k) for k in _READ_AS}
    except (ValueError, TypeError, KeyError) as e:
        out["config_valid"] = False
        out["config_error"] = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if family is not None:
        out["weights"] = _formats(raw, family)
    if family == K.V41:
        out["v41"] = _v41_summary(ckpt, cfg)
    return out


def _formats(raw: dict, family: str) -> str:
    """The weight formats ``quantization_config`` announces, in words."""
    if raw.get("quantization_config") is None:
        return "unquantised (no quantization_config)"
    try:
        scheme = quant_scheme_of(raw, family)
    except ValueError as e:
        return f"not readable by dsv4 ({e})"
    rows, cols = scheme.fp8_block
    experts = raw["quantization_config"].get("expert_dtype", raw.get("expert_dtype", "fp4"))
    text = (f"FP8 E4M3, {rows}x{cols} ue8m0 tiles; routed experts "
            + ("FP4 E2M1 packed two per byte, one ue8m0 scale per row and 32 columns" if experts == "fp4"
               else f"FP8 E4M3 in {rows}x{cols} tiles"))
    if family == K.V41:
        text += "; Engram tables FP8 E4M3, one ue8m0 scale per row and 32 columns"
    return text


def _v41_summary(ckpt: CheckpointDir, cfg) -> dict:
    """Roles per layer (from the config, when it reads), Engram tables and the skipped groups (from the headers)."""
    out: dict = {}
    if cfg is not None:
        layers = []
        for i in range(cfg.num_hidden_layers):
            layers.append({"layer": i, "role": cfg.attention_role(i), "ratio": cfg.ratio_for_layer(i),
                           "candidate_source": i == cfg.candidate_source_layer_id,
                           "engram": i in cfg.engram_layer_ids})
        out["layers"] = layers
        out["roles"] = [entry["role"] for entry in layers]
    tables = {}
    for key, info in ckpt.tensors.items():
        parts = key.split(".")
        if len(parts) == 5 and parts[0] == "layers" and parts[2:] == ["engram", "embed", "weight"]:
            scale = ckpt.tensors.get(key[: -len("weight")] + "scale")
            tables[parts[1]] = {"rows": info.shape[0], "head_dim": info.shape[1], "dtype": info.dtype,
                                "bytes": info.nbytes, "scale_bytes": 0 if scale is None else scale.nbytes}
    out["engram_tables"] = dict(sorted(tables.items(), key=lambda kv: int(kv[0])))
    skipped: dict[str, int] = {}
    for key in ckpt.tensors:
        reason = K.skip_reason(key, K.V41)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
    out["skipped"] = dict(sorted(skipped.items()))
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


def _print_v41(v41: dict) -> None:
    if "layers" in v41:
        print("layers (attention role, compress ratio):")
        for entry in v41["layers"]:
            notes = ([f"ratio {entry['ratio']}"] if entry["ratio"] else []) + (
                ["candidate source"] if entry["candidate_source"] else [])
            role = entry["role"] + (f" ({', '.join(notes)})" if notes else "")
            print(f"  layer {entry['layer']}: {role}" + (", engram" if entry["engram"] else ""))
    tables = v41["engram_tables"]
    if tables:
        total = sum(t["bytes"] + t["scale_bytes"] for t in tables.values())
        print("engram tables: " + ", ".join(
            f"layer {i}: {t['rows']} x {t['head_dim']} ({t['dtype']}, {t['bytes']} bytes + {t['scale_bytes']} of "
            "scales)" for i, t in tables.items()) + f"; {total} bytes ({total / 1e9:.6f} GB) in all")
    else:
        print("engram tables: none")
    skipped = v41["skipped"]
    if skipped:
        print(f"would skip {sum(skipped.values())} tensors (text-only training; not part of the text backbone): "
              + ", ".join(f"{g}: {n}" for g, n in skipped.items()))


def _print_text(info: dict) -> None:
    drafter = "DSpark drafter" if info.get("family") == K.V41 else "MTP"
    print(f"checkpoint: {info['path']} ({info['layout']} layout, " + ("with" if info["has_mtp"] else "no")
          + f" {drafter} weights)")
    if info.get("family") is not None:
        print(f"family: {info['family']}")
    cfg = info.get("config")
    if cfg is None:
        print(f"config: missing ({info.get('config_error')})")
    else:
        print("config:")
        text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else {}  # V4.1: nested
        for k in _SUMMARY_FIELDS + ("image_token_id",):
            where = cfg if k in cfg else text
            if k in where:
                print(f"  {k}: {json.dumps(where[k])}")
        print(f"  valid {info.get('config_class', 'DSV4Config')}: {info['config_valid']}"
              + ("" if info["config_valid"] else f" ({info['config_error']})"))
        if info["config_valid"]:
            print("read by dsv4 as: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in info["dsv4_config"].items()))
    if "weights" in info:
        print(f"weights: {info['weights']}")
    if "v41" in info:
        _print_v41(info["v41"])
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

"""Load an HF-format DSV4 checkpoint directory into a ``DSV4ForCausalLM`` (or any module with its state dict).

    report = load_hf_checkpoint(model, "/ckpt")                       # every key the model holds
    report = load_hf_checkpoint(model, "/ckpt", ep_rank=r, ep_size=n)  # full model, but read only rank r's experts

Order of work (nothing is read before every check passed):

1. Plan from the shard headers only (:class:`~dsv4.checkpoint.safetensors_io.CheckpointDir`): map every on-disk
   key through :mod:`dsv4.checkpoint.keys`; check that every key the model needs is there (``KeyError`` naming
   the missing keys), that no key is unknown to the model (``KeyError``: unexpected key, also a routed expert
   index >= ``n_routed_experts``), that no two keys fill one model tensor (``ValueError``), and each tensor's dtype
   tag and shape against the model (``ValueError`` naming the key, expected and actual shape/dtype). MTP keys of
   depths the config does not build (``num_nextn_predict_layers``) are skipped, as are scales of skipped keys.
2. Stream shard by shard (files in name order, keys in file order): read one weight (and its ``.scale``, which
   may live in another shard), dequantise (FP8 block / FP4 packed, :mod:`dsv4.checkpoint.quant`) or cast to the
   target's dtype, copy into the parameter or buffer, drop it. A weight stored in more than
   :data:`LOAD_CHUNK_BYTES` (V4.1's Engram tables) goes by row chunks of about that size, each with its scale rows.
   Peak extra memory is about one tensor, or one chunk.

Families (:data:`dsv4.checkpoint.keys.FAMILIES`): the model's config class names its family (``DSV4Config``: V4,
``DSV41Config``: V4.1), and the directory's ``config.json`` must be of the same family, with a
``quantization_config`` the family's formats read (``ValueError`` naming the field otherwise, before anything is
read). A V4 checkpoint's FP8 tiles are 128 x 128; V4.1's are 32 x 32, its Engram tables FP8 with one scale per row
and 32 columns (:mod:`dsv4.checkpoint.quant`). V4.1 keys outside the text backbone (``mtp.*``: the DSpark drafter,
``vision.*``, ``aligner.*``, ``image_*``; :func:`dsv4.checkpoint.keys.skip_reason`) are skipped, never read, and
named in one INFO line per load (with their counts) and in ``report.skipped``.

Both layouts of :mod:`dsv4.checkpoint.layouts` load: the release's, and what transformers' ``save_pretrained``
writes (read through :func:`~dsv4.checkpoint.layouts.release_view`; errors name the file's own keys). An MTP depth
the model builds but the checkpoint holds no ``mtp.{k}.*`` key of (every transformers directory holds none) is
refused before anything is read (``ValueError`` naming the depths, the checkpoint and the two ways out:
``num_nextn_predict_layers`` = the depths it holds, or ``init_missing_mtp``); with ``init_missing_mtp=True`` those
depths keep their initialisation, one INFO line names them and ``report.fresh`` lists their tensors. A depth with
some of its keys must have them all (``KeyError``, as for any missing key). A model whose
config computes differently from the directory's ``config.json`` in what no shape shows (RoPE, YaRN, routing, norms,
window, compress ratios) is refused after the key checks, naming each field (:func:`check_model_config`).

Kept quantized targets (a LoRA model with ``peft.base_dtype=fp8``, :mod:`dsv4.peft`): a model tensor of dtype
``float8_e4m3fn`` (FP8 block) or ``int8`` (packed FP4) receives the checkpoint's bytes as they are and its scale
goes to the model's kept scale (``<module>.scale``, or ``w1_scale`` beside stacked experts): nothing is
dequantised. The kept form is in the checkpoint family's tiles (V4.1: 32 x 32, :func:`dsv4.peft.apply_lora`), so
the release's e4m3 bytes and e8m0 scales go in as they are; a model whose kept scale has another shape (another
family's tiles) is refused before anything is read. A checkpoint that stores such a tensor unquantised (bf16 / fp32)
is quantised on the way in, in the family's tiles; one stored in the other format is an error. Adapter parameters
(``*lora_A`` / ``*lora_B``) are not checkpoint keys and keep their values.

Engram tables (V4.1, :class:`~dsv4.model.v41.engram_table.LocalEngramTable`): a table holding rows ``[start,
stop)`` (one rank's slice of a row-sharded table, :mod:`dsv4.parallel.engram_table`; all rows for a whole table)
reads only those rows, in row chunks of about :data:`LOAD_CHUNK_BYTES`, each with its scale rows; the key's shape is
checked against the whole table. A table kept in the release's FP8 form (frozen, :func:`keep_engram_tables_as_stored`
switches it before the load) receives the stored e4m3 bytes and row scales as they are; a float table receives
them dequantised.

Routed experts: a ``GroupedExperts`` holding experts ``[offset, offset + local)`` (after ``shard_experts``) reads
only those experts' keys. With ``ep_rank``/``ep_size`` on a model that still holds all experts, only the rank's
range ``[r*E/n, (r+1)*E/n)`` is read (the other rows are left as they are; ``shard_experts`` drops them next).
That is the order the recipe uses: build the full model, load this rank's keys, then EP-shard and FSDP-wrap.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.hf_config import (
    CONFIG_FILE,
    INDEX_FILE,
    SCHEMES,
    checkpoint_family,
    config_family,
    model_family,
    quant_scheme_of,
    read_hf_config_dict,
)
from dsv4.checkpoint.quant import (
    V4_SCHEME,
    QuantScheme,
    dequantize,
    kept_format,
    logical_shape,
    quantize,
    quantize_kept,
    scale_shape,
)
from dsv4.checkpoint.layouts import release_view
from dsv4.checkpoint.safetensors_io import DTYPES, CheckpointDir, TensorInfo, TensorReader
from dsv4.model.v41.engram_table import LocalEngramTable

log = logging.getLogger("dsv4")

_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")
_INT_TAGS = ("I64", "I32")
_SCALE_TAGS = ("F8_E8M0", "U8", "F32")
_ADAPTER_SUFFIXES = ("lora_A", "lora_B")
_OURS_MTP = re.compile(r"^mtp\.layers\.(\d+)\.")


def missing_mtp_depths(keys: Iterable[str], depths: int) -> list[int]:
    """The MTP depths ``0 .. depths-1`` of which no key in ``keys`` (release names: ``mtp.{k}.*``) is."""
    present = {K.mtp_depth(k) for k in keys}
    return [d for d in range(depths) if d not in present]


def missing_mtp_error(path: str, layout: str, missing: list[int], depths: int) -> ValueError:
    """The refusal of a checkpoint that lacks MTP depths the model builds: the depths, the checkpoint and the two
    ways out."""
    return ValueError(
        f"{path} ({layout} layout) holds no weights for MTP depth(s) {missing} of the {depths} the model builds "
        f"(model.num_nextn_predict_layers={depths}; no key {', '.join(f'mtp.{d}.*' for d in missing)}): set "
        f"model.num_nextn_predict_layers={missing[0]} to build only the depths it holds, or "
        "model.init_missing_mtp=true to train the missing depths from a random initialisation "
        "(load_hf_checkpoint(..., init_missing_mtp=True) from Python)")


def holds_weights(path: str) -> bool:
    """``path`` has an index file or a ``*.safetensors`` file (what :class:`CheckpointDir` reads)."""
    return os.path.isfile(os.path.join(path, INDEX_FILE)) or any(n.endswith(".safetensors") for n in os.listdir(path))


def built_mtp_depths(config) -> int:
    """The MTP depths a model of ``config`` builds: ``num_nextn_predict_layers`` for V4, none for V4.1 (whose
    ``num_nextn_predict_layers`` counts the DSpark drafter's layers, a separate model)."""
    return 0 if config_family(config) == K.V41 else int(config.num_nextn_predict_layers)


def check_mtp_weights(path: str, depths: int, init_missing: bool = False) -> list[int]:
    """The MTP depths of ``0 .. depths-1`` that the checkpoint directory ``path`` holds no key of, from the shard
    headers alone (either layout); :func:`missing_mtp_error` when there are any and not ``init_missing``."""
    if depths < 1:
        return []
    ckpt, layout = release_view(CheckpointDir.open(path))
    missing = missing_mtp_depths(ckpt.tensors, depths)
    if missing and not init_missing:
        raise missing_mtp_error(path, layout, missing, depths)
    return missing


def kept_scale_name(name: str) -> str:
    """The model's scale tensor beside a kept weight: ``<module>.scale``, or ``w1_scale`` beside stacked experts."""
    return f"{name}_scale" if K.is_stacked_expert(name) else name[: -len("weight")] + "scale"


@dataclass
class LoadReport:
    """What a load did: the on-disk keys it read (weights and scales), bytes, shards visited, keys skipped
    (other ranks' experts, MTP depths the config does not build), the model keys filled, seconds."""

    keys_read: list[str] = field(default_factory=list)
    bytes_read: int = 0
    shards: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    seconds: float = 0.0
    layout: str = "release"  # dsv4.checkpoint.layouts: "release" or "transformers"
    fresh: list[str] = field(default_factory=list)  # model tensors the checkpoint has no keys for (absent MTP)


@dataclass
class _Item:
    hf_key: str
    target: str  # our state-dict name
    expert_row: int | None  # row of a stacked expert tensor
    fmt: str  # "fp8" | "fp8_rows" | "fp4" | "plain"
    scale_key: str | None
    keep: str | None = None  # the target's kept format ("fp8" | "fp8_rows" | "fp4"), None for a float target
    scheme: QuantScheme = V4_SCHEME  # the checkpoint family's formats
    rows: tuple[int, int] | None = None  # an Engram table's rows [start, stop) this model holds


def _expert_ranges(
    model: nn.Module, targets: dict[str, torch.Tensor], ep_rank, ep_size
) -> dict[str, tuple[int, int, int, int]]:
    """``name -> (first global expert, count, offset of row 0, n_routed_experts)`` for every stacked expert
    tensor."""
    if (ep_rank is None) != (ep_size is None):
        raise ValueError("give both ep_rank and ep_size, or neither")
    out = {}
    for name in targets:
        if not K.is_stacked_expert(name):
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        offset, local, total = module.expert_offset, module.num_local_experts, module.num_experts
        first, count = offset, local
        if ep_size is not None and ep_size > 1 and local == total:
            if total % ep_size:
                raise ValueError(f"n_routed_experts={total} is not divisible by ep_size={ep_size}")
            count = total // ep_size
            first = ep_rank * count
        out[name] = (first, count, offset, total)
    return out


def _table_rows(model: nn.Module, targets: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """``name -> (start, stop)``: the rows of each Engram table target that ``model`` holds."""
    out = {}
    for name in targets:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if isinstance(module, LocalEngramTable) and leaf == "weight":
            out[name] = (module.row_start, module.row_start + module.local_rows)
    return out


def _check_and_plan(
    ckpt: CheckpointDir, targets: dict[str, torch.Tensor], ranges: dict[str, tuple[int, int, int, int]], mtp_depths: int,
    left_out: set[str] = frozenset(), family: str = K.V4, scheme: QuantScheme = V4_SCHEME,
    not_built: dict[str, int] | None = None, tables: dict[str, tuple[int, int]] | None = None,
) -> tuple[list[_Item], list[str]]:
    """The load plan (see the module docstring); ``not_built`` collects the counts of the keys
    :func:`~dsv4.checkpoint.keys.skip_reason` names, by group; ``tables``: :func:`_table_rows`."""
    tables = tables or {}
    items: list[_Item] = []
    skipped: list[str] = []
    not_built = {} if not_built is None else not_built
    seen_targets: dict[tuple[str, int | None], str] = {}  # (target, expert) -> the on-disk key that fills it
    unexpected: list[str] = []
    beyond: dict[str, int] = {}  # routed-expert key with an expert index >= n_routed_experts -> n_routed_experts
    scales = {k for k in ckpt.tensors if K.is_scale_key(k)}
    for key, info in ckpt.tensors.items():
        reason = K.skip_reason(key, family)
        if key in scales:
            if reason is not None:  # counted with its group; skipped with its weight
                not_built[reason] = not_built.get(reason, 0) + 1
            continue
        if reason is not None:
            not_built[reason] = not_built.get(reason, 0) + 1
            skipped.append(key)
            continue
        depth = K.mtp_depth(key, family)
        if depth is not None and depth >= mtp_depths:
            skipped.append(key)
            continue
        mapped = K.hf_to_ours(key, family)
        if mapped is not None and mapped.name in left_out:
            skipped.append(key)
            continue
        if mapped is None or mapped.name not in targets:
            unexpected.append(key)
            continue
        target = targets[mapped.name]
        row = None
        if (mapped.name, mapped.expert) in seen_targets:  # e.g. attn.attn_sink and attn.sink.logits
            raise ValueError(
                f"{key}: fills {mapped.name}" + ("" if mapped.expert is None else f"[expert {mapped.expert}]")
                + f" like {seen_targets[(mapped.name, mapped.expert)]} (two keys in {ckpt.path} for one model tensor)"
            )
        if mapped.expert is not None:
            first, count, offset, total = ranges[mapped.name]
            if mapped.expert >= total:
                unexpected.append(key)
                beyond[key] = total
                continue
            if not first <= mapped.expert < first + count:
                skipped.append(key)
                continue
            row = mapped.expert - offset
            expected_shape = logical_shape(target)[1:]
        elif mapped.name in ranges:
            unexpected.append(key)
            continue
        else:
            expected_shape = logical_shape(target)
        scale_key = K.scale_key_of_weight(key)
        has_scale = scale_key in scales
        keep = kept_format(target)
        if keep == "fp8" and mapped.name in tables:  # an Engram table keeps the release's row scales
            keep = "fp8_rows"
        fmt = _validate(info, ckpt.tensors.get(scale_key) if has_scale else None, expected_shape,
                        torch.float32 if keep else target.dtype, scheme, K.on_disk_format(key, family))
        if keep and fmt not in ("plain", keep):
            raise ValueError(f"{key}: stored as {fmt} but the model keeps this tensor as {keep} "
                             f"(peft.base_dtype=fp8 keeps the release's formats)")
        items.append(_Item(key, mapped.name, row, fmt, scale_key if has_scale else None, keep, scheme,
                           tables.get(mapped.name)))
        seen_targets[(mapped.name, mapped.expert)] = key
    for s in sorted(scales):
        w = K.weight_key_of_scale(s)
        if w not in ckpt.tensors:
            unexpected.append(s)
    if unexpected:
        raise KeyError(
            f"unexpected key(s) in {ckpt.path} that the model does not hold: {sorted(unexpected)[:10]}"
            + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else "")
            + "".join(f"; {k}: expert index >= n_routed_experts ({n})" for k, n in sorted(beyond.items())[:10])
        )
    missing = []
    for name in targets:
        if name in ranges:
            first, count, _, _ = ranges[name]
            missing += [K.ours_to_hf(name, e, family) for e in range(first, first + count)
                        if (name, e) not in seen_targets]
        elif (name, None) not in seen_targets:
            missing.append(K.ours_to_hf(name, family=family) or name)
    if missing:
        raise KeyError(
            f"missing key(s) in {ckpt.path}: {missing[:10]}" + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        )
    return items, skipped


def _validate(info: TensorInfo, scale: TensorInfo | None, expected: tuple[int, ...], target_dtype: torch.dtype,
              scheme: QuantScheme = V4_SCHEME, release_fmt: str = "bf16") -> str:
    """Check dtype tag and shape from the header; returns the item format (an FP8 weight whose release format is
    ``fp8_rows``, a V4.1 Engram table, is read with row scales; any other with the scheme's tiles)."""
    if info.dtype not in DTYPES:
        raise ValueError(f"{info.key}: unknown dtype {info.dtype!r} (known safetensors dtypes: {sorted(DTYPES)})")
    if scale is not None:
        if scale.dtype not in _SCALE_TAGS:
            raise ValueError(f"{scale.key}: scale dtype {scale.dtype} is not one of {_SCALE_TAGS}")
        if len(expected) != 2:
            raise ValueError(f"{info.key}: has a scale but the model tensor has shape {expected} (expected 2-D)")
        if info.dtype == "F8_E4M3":
            fmt, logical = ("fp8_rows" if release_fmt == "fp8_rows" else "fp8"), info.shape
        elif info.dtype in ("I8", "U8"):
            logical = (info.shape[0], info.shape[1] * 2) if len(info.shape) == 2 else info.shape
            fmt = "fp4"
        else:
            raise ValueError(
                f"{info.key}: a weight with a .scale must be F8_E4M3 (FP8 block) or I8 (packed FP4), got {info.dtype}"
            )
        if tuple(logical) != expected:
            raise ValueError(
                f"{info.key}: shape {list(info.shape)} ({fmt}, logical {list(logical)}) does not match the model's "
                f"{list(expected)} (check config.json against the model config)"
            )
        want_scale = scale_shape(fmt, expected, scheme)
        if tuple(scale.shape) != tuple(want_scale):
            tiles = {"fp8": "x".join(map(str, scheme.fp8_block)) + " tiles", "fp8_rows": "1x32 row blocks",
                     "fp4": "one per row and 32 columns"}[fmt]
            raise ValueError(f"{scale.key}: scale shape {list(scale.shape)}, expected {list(want_scale)} for {fmt} "
                             f"({scheme.name}: {tiles})")
        return fmt
    if target_dtype.is_floating_point:
        if info.dtype not in _FLOAT_TAGS:
            raise ValueError(
                f"{info.key}: dtype {info.dtype} cannot load into a {target_dtype} tensor without a .scale "
                f"(expected one of {_FLOAT_TAGS})"
            )
    elif info.dtype not in _INT_TAGS:
        raise ValueError(f"{info.key}: dtype {info.dtype} cannot load into a {target_dtype} tensor (expected {_INT_TAGS})")
    if tuple(info.shape) != expected:
        raise ValueError(
            f"{info.key}: shape {list(info.shape)} does not match the model's {list(expected)} "
            f"(check config.json against the model config)"
        )
    return "plain"


@torch.no_grad()
def load_hf_checkpoint(
    model: nn.Module,
    path: str,
    *,
    ep_rank: int | None = None,
    ep_size: int | None = None,
    mtp_depths: int | None = None,
    only: Callable[[str], bool] | None = None,
    init_missing_mtp: bool = False,
) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers from the checkpoint directory ``path``; returns a
    :class:`LoadReport`. See the module docstring for the checks, the EP behaviour and the streaming order.
    ``only``: fill just the state-dict names it accepts (the checkpoint's keys of the other model tensors are
    skipped, not read; the rest of the model may stay on the meta device); the checks cover the accepted ones.
    ``init_missing_mtp``: MTP depths the checkpoint has no key of keep their initialisation instead of being
    refused."""
    start = time.perf_counter()
    family, scheme = checkpoint_scheme(path, getattr(model, "config", None), model_family(model))
    ckpt, layout = release_view(CheckpointDir.open(path))
    state = model.state_dict(keep_vars=True)
    kept_scales = {kept_scale_name(n) for n, t in state.items() if kept_format(t)}
    targets = {n: t for n, t in state.items() if n not in kept_scales and not n.endswith(_ADAPTER_SUFFIXES)}
    left_out: set[str] = set()
    if only is not None:
        left_out = {n for n in targets if not only(n)}
        targets = {n: t for n, t in targets.items() if n not in left_out}
    if family != K.V4:  # V4.1's mtp.* keys are the DSpark drafter (skipped, or the drafter's own), not MTP depths
        mtp_depths = 0
    elif mtp_depths is None:
        mtp = getattr(model, "mtp", None)
        mtp_depths = len(mtp.layers) if mtp is not None and hasattr(mtp, "layers") else 0
    fresh: list[str] = []
    missing = missing_mtp_depths(ckpt.tensors, mtp_depths)
    if missing:  # e.g. a transformers directory: transformers builds no MTP block
        fresh = sorted(n for n in targets if (m := _OURS_MTP.match(n)) and int(m.group(1)) in missing)
        if fresh and not init_missing_mtp:
            raise missing_mtp_error(path, layout, missing, mtp_depths)
        if fresh:
            left = set(fresh)
            targets = {n: t for n, t in targets.items() if n not in left}
            log.info("%s (%s layout) holds no weights for MTP depth(s) %s: they keep their initialisation (%d tensors; "
                     "model.init_missing_mtp=true)", path, layout, missing, len(fresh))
    ranges = _expert_ranges(model, targets, ep_rank, ep_size)
    not_built: dict[str, int] = {}
    items, skipped = _check_and_plan(ckpt, targets, ranges, mtp_depths, left_out, family, scheme, not_built,
                                     _table_rows(model, targets))
    _check_kept_scales(items, state)
    check_model_config(getattr(model, "config", None), path)
    if not_built:
        log.info("%s: skipped %d tensors outside the text backbone dsv4 builds (text-only training; they are not "
                 "read): %s", path, sum(not_built.values()), ", ".join(f"{g}: {n}" for g, n in sorted(not_built.items())))

    by_file: dict[str, list[_Item]] = {}
    for it in items:
        by_file.setdefault(ckpt.tensors[it.hf_key].file, []).append(it)
    reader = TensorReader(ckpt)
    report = LoadReport(skipped=skipped, layout=layout, fresh=fresh)
    try:
        for name in sorted(by_file):
            report.shards.append(name)
            group = sorted(by_file[name], key=lambda it: ckpt.tensors[it.hf_key].begin)
            for it in group:
                _load_item(reader, it, state)
                report.loaded.append(it.target if it.expert_row is None else f"{it.target}[{it.expert_row}]")
    finally:
        reader.close()
    report.keys_read = reader.keys_read
    report.bytes_read = reader.bytes_read
    report.seconds = time.perf_counter() - start
    return report


def checkpoint_scheme(path: str, config, family: str | None = None) -> tuple[str, QuantScheme]:
    """``(key family, quant scheme)`` of loading the directory ``path`` into a model of ``config`` (``family``, else
    the config's; V4 without a config): the directory's ``config.json``, when it has one, must be of that family's
    (:func:`~dsv4.checkpoint.keys.config_family_of`) with a ``quantization_config`` its formats read
    (``ValueError`` naming both families, or the field)."""
    from dsv4.config import DSV4Config

    if family is None:
        family = config_family(config) if isinstance(config, DSV4Config) else K.V4
    if not os.path.exists(os.path.join(path, CONFIG_FILE)):
        return family, SCHEMES[family]
    data = read_hf_config_dict(path)
    found = checkpoint_family(data)
    if found != K.config_family_of(family):
        raise ValueError(f"{path}: a {found} checkpoint (config.json model_type={data.get('model_type')!r}); the model "
                         f"is {family} ({type(config).__name__}): build the model from the checkpoint's config "
                         "(load_model_from_hf) or choose a checkpoint of its family")
    return family, quant_scheme_of(data, family)


# Fields that change the model's numbers without changing any tensor's shape (shapes are checked per key).
_NUMERIC_FIELDS = ("qk_rope_head_dim", "rope_theta", "compress_rope_theta", "scoring_func", "topk_method",
                   "routed_scaling_factor", "norm_topk_prob", "swiglu_limit", "sliding_window", "hc_sinkhorn_iters",
                   "hc_eps", "index_topk", "rms_norm_eps", "num_experts_per_tok", "hidden_act", "num_hash_layers")
# ... and V4.1's (compared when the model's config has them)
_V41_NUMERIC_FIELDS = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                       "candidate_topk_blocks", "candidate_block_size", "engram_layer_ids", "engram_max_ngram_size",
                       "engram_vocab_size", "engram_n_heads", "engram_pad_token_id", "engram_compressed_vocab_size")


def _yarn(scaling) -> tuple | None:
    if scaling is None:
        return None
    return (float(scaling["factor"]), float(scaling["original_max_position_embeddings"]),
            float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0)))


def check_model_config(config, path: str) -> None:
    """Refuse a model whose config computes differently from the checkpoint's ``config.json`` (both layouts): a
    ``ValueError`` listing each field as ``model.<field>=<file's value>`` (the model's value beside it). Only what the
    shape checks cannot see is compared: :data:`_NUMERIC_FIELDS`, YaRN (``rope_scaling``) and the compress ratio of
    every layer the model builds. A directory without ``config.json`` is not compared; one whose config is
    incomplete is not compared either, with a WARNING naming the missing field."""
    from dsv4.checkpoint.hf_config import config_from_hf
    from dsv4.config import DSV4Config

    if not isinstance(config, DSV4Config) or not os.path.exists(os.path.join(path, "config.json")):
        return
    try:
        file = config_from_hf(path, torch_dtype=config.torch_dtype,
                              num_nextn_predict_layers=config.num_nextn_predict_layers)
    except KeyError as err:
        log.warning("%s: its config.json cannot be compared with the model's (%s); the model's config is used",
                    path, err.args[0] if err.args else err)
        return
    compared = _NUMERIC_FIELDS + tuple(k for k in _V41_NUMERIC_FIELDS if hasattr(config, k) and hasattr(file, k))
    diffs = [(k, getattr(file, k), getattr(config, k)) for k in compared if getattr(file, k) != getattr(config, k)]
    if _yarn(file.rope_scaling) != _yarn(config.rope_scaling):
        diffs.append(("rope_scaling", file.rope_scaling, config.rope_scaling))
    layers = range(config.num_hidden_layers + config.num_nextn_predict_layers)
    if [file.ratio_for_layer(i) for i in layers] != [config.ratio_for_layer(i) for i in layers]:
        diffs.append(("compress_ratios", file.compress_ratios, config.compress_ratios))
    if diffs:
        raise ValueError(f"{path}: config.json differs from the model's config in what the weights mean; set "
                         + "; ".join(f"model.{k}={json.dumps(f)} (the model has {json.dumps(m)})" for k, f, m in diffs))


LOAD_CHUNK_BYTES = 256 * 1024**2
"""A stored weight above this many bytes is read, dequantised and copied in row chunks of about this size (V4.1's
Engram tables: ~98 GB each in FP8, whose fp32 dequantisation at once would need four times that)."""


def _row_block(it: _Item) -> int:
    """The rows one scale row covers (a chunk boundary must fall between scale rows)."""
    return it.scheme.fp8_block[0] if it.fmt == "fp8" else 1


def _load_chunked(reader: TensorReader, it: _Item, dest: torch.Tensor, info: TensorInfo) -> None:
    """``it`` (a float target, stored above :data:`LOAD_CHUNK_BYTES`) read, dequantised and copied by row chunks."""
    rows, block = info.shape[0], _row_block(it)
    step = max(block, LOAD_CHUNK_BYTES // max(1, info.nbytes // rows) // block * block)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        weight = reader.read(it.hf_key, (start, stop))
        if it.fmt == "plain":
            value = weight
        else:
            scale = reader.read(it.scale_key, (start // block, -(-stop // block)))
            value = dequantize(weight, scale, it.fmt, torch.float32, it.scheme)
        dest[start:stop].copy_(value.to(device=dest.device, dtype=dest.dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a ``DTensor`` 's local tensor, a row-sharded Engram table's rows)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _load_table_rows(reader: TensorReader, it: _Item, state: dict[str, torch.Tensor]) -> None:
    """An Engram table's held rows ``it.rows`` read by chunks of about :data:`LOAD_CHUNK_BYTES` (with their scale
    rows), each dequantised into a float table or copied as stored into the kept FP8 form."""
    start, stop = it.rows
    dest = _local(state[it.target])
    scale_dest = _local(state[kept_scale_name(it.target)]) if it.keep else None
    info = reader.ckpt.tensors[it.hf_key]
    step = max(1, LOAD_CHUNK_BYTES // max(1, info.nbytes // max(info.shape[0], 1)))
    for first in range(start, stop, step):
        last = min(stop, first + step)
        weight = reader.read(it.hf_key, (first, last))
        scale = reader.read(it.scale_key, (first, last)) if it.scale_key else None  # one scale row per row
        rows = slice(first - start, last - start)
        if it.keep:
            if it.fmt == "fp8_rows" and scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
                q, s = weight, scale.view(torch.float8_e8m0fnu)
            else:
                value = weight.float() if it.fmt == "plain" else dequantize(weight, scale, it.fmt, torch.float32,
                                                                            it.scheme)
                q, s = quantize(value, "fp8_rows", it.scheme)
            dest[rows].copy_(q.view(dest.dtype).to(dest.device))
            scale_dest[rows].copy_(s.to(scale_dest.device))
            continue
        value = weight if it.fmt == "plain" else dequantize(weight, scale, it.fmt, torch.float32, it.scheme)
        dest[rows].copy_(value.to(device=dest.device, dtype=dest.dtype))


def _load_item(reader: TensorReader, it: _Item, state: dict[str, torch.Tensor]) -> None:
    if it.rows is not None:
        _load_table_rows(reader, it, state)
        return
    target = state[it.target]
    dest = target if it.expert_row is None else target[it.expert_row]
    info = reader.ckpt.tensors[it.hf_key]
    if not it.keep and len(info.shape) >= 1 and info.shape[0] > 1 and info.nbytes > LOAD_CHUNK_BYTES:
        _load_chunked(reader, it, dest, info)
        return
    weight = reader.read(it.hf_key)
    scale = reader.read(it.scale_key) if it.scale_key else None  # may sit in another shard
    if it.keep:
        _load_kept(it, weight, scale, dest, state)
        return
    value = weight if it.fmt == "plain" else dequantize(weight, scale, it.fmt, torch.float32, it.scheme)
    dest.copy_(value.to(device=dest.device, dtype=dest.dtype))


def _check_kept_scales(items: list[_Item], state: dict[str, torch.Tensor]) -> None:
    """Every kept FP8 / FP4 target's scale has the shape the checkpoint family's formats give it (its tiles: the
    model keeps the release's bytes and scales as they are), else a ``ValueError`` naming the key, before anything
    is read."""
    for it in items:
        if it.keep not in ("fp8", "fp4") or it.rows is not None:
            continue
        logical = logical_shape(state[it.target])
        got = tuple(state[kept_scale_name(it.target)].shape)
        if it.expert_row is not None:
            logical, got = logical[1:], got[1:]
        want = scale_shape(it.keep, logical, it.scheme)
        if got != tuple(want):
            tiles = "x".join(map(str, it.scheme.fp8_block)) + " tiles" if it.keep == "fp8" else "32 columns"
            raise ValueError(f"{it.hf_key}: the model keeps it with a {list(got)} scale, but {it.scheme.name}'s "
                             f"{it.keep} ({tiles}) gives {list(want)}: keep the base in the checkpoint family's "
                             "formats (apply_lora / keep_base_quantized on a model of the checkpoint's config)")


def _load_kept(it: _Item, weight: torch.Tensor, scale: torch.Tensor | None, dest: torch.Tensor,
               state: dict[str, torch.Tensor]) -> None:
    """A kept target: the checkpoint's bytes and e8m0 scale as they are (the kept form is in the checkpoint
    family's tiles, :func:`_check_kept_scales`); an unquantised tensor (or a float32 scale) is quantised into the
    kept format, in those tiles."""
    scale_target = state[kept_scale_name(it.target)]
    scale_dest = scale_target if it.expert_row is None else scale_target[it.expert_row]
    if it.fmt == it.keep and scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        q, s = weight, scale.view(torch.float8_e8m0fnu)
    else:
        value = weight.float() if it.fmt == "plain" else dequantize(weight, scale, it.fmt, torch.float32, it.scheme)
        q, s = quantize_kept(value, it.keep, it.scheme)
    dest.copy_(q.view(dest.dtype).to(dest.device))
    scale_dest.copy_(s.to(scale_dest.device))


def engram_tables_stored_fp8(path: str) -> bool:
    """True when the checkpoint directory ``path`` stores V4.1 Engram tables in FP8 (the release's form); from the
    shard headers only."""
    ckpt, _ = release_view(CheckpointDir.open(path))
    return any(K.on_disk_format(k, K.V41) == "fp8_rows" and info.dtype == "F8_E4M3" for k, info in ckpt.tensors.items())


def keep_engram_tables_as_stored(model: nn.Module, path: str) -> list[str]:
    """Switch every frozen Engram table of ``model`` whose key the checkpoint directory ``path`` stores in FP8 (the
    release's form) to the kept FP8 form (:meth:`~dsv4.model.v41.engram_table.LocalEngramTable.keep_fp8`), so that
    :func:`load_hf_checkpoint` then copies the stored bytes and row scales as they are; from the shard headers only.
    Returns the tables' state-dict names (one INFO line names them); trainable tables stay in float."""
    family = config_family(model.config) if hasattr(model, "config") else K.V4
    if family != K.V41:
        return []
    ckpt, _ = release_view(CheckpointDir.open(path))
    kept = []
    for name, module in model.named_modules():
        if not isinstance(module, LocalEngramTable) or module.kept_fp8 or module.weight.requires_grad:
            continue
        hf = K.ours_to_hf(f"{name}.weight", family=family)
        info = ckpt.tensors.get(hf)
        if info is not None and info.dtype == "F8_E4M3":
            module.keep_fp8()
            kept.append(f"{name}.weight")
    if kept:
        log.info("%s: the frozen Engram tables %s are kept in their stored FP8 form (e4m3 rows, one e8m0 scale per row "
                 "and 32 columns), dequantised after each lookup", path, kept)
    return kept


def load_model_from_hf(path: str, *, device: str | torch.device = "cpu", init_missing_mtp: bool = False,
                       tokenizer=None, **overrides):
    """Build the causal LM of ``path/config.json``'s family (``DSV4ForCausalLM`` / ``DSV41ForCausalLM``;
    ``overrides`` replace config fields) and load it (``init_missing_mtp`` as in :func:`load_hf_checkpoint`).

    A V4.1 model with Engram layers hashes n-grams through its checkpoint's tokenizer: ``tokenizer`` when given,
    else the directory's own (``tokenizer.json``, read by :class:`~dsv4.data.tokenizers.HFTokenizer`, one INFO line
    naming it); a directory without one gives a model whose first forward asks for it
    (``model.set_engram_tokenizer``), with one INFO line saying so."""
    from dsv4.checkpoint.hf_config import config_from_hf
    from dsv4.model import build_causal_lm

    config = config_from_hf(path, **overrides)
    options = {}
    if config_family(config) == K.V41 and config.engram_layer_ids:
        if tokenizer is None and os.path.isfile(os.path.join(path, "tokenizer.json")):
            from dsv4.data.tokenizers import HFTokenizer

            tokenizer = HFTokenizer(path)
            log.info("%s: Engram hashes n-grams through the directory's tokenizer (tokenizer.json)", path)
        elif tokenizer is None:
            log.info("%s: no tokenizer.json and no tokenizer= given: call model.set_engram_tokenizer(...) before the "
                     "first forward (Engram layers %s hash through the checkpoint's tokenizer)", path,
                     config.engram_layer_ids)
        options["tokenizer"] = tokenizer
    model = build_causal_lm(config, **options).to(device)
    load_hf_checkpoint(model, path, init_missing_mtp=init_missing_mtp)
    return model

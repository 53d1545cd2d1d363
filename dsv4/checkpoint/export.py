"""Export a ``DSV4ForCausalLM`` to an HF-format directory: safetensors shards, ``model.safetensors.index.json``
(``metadata.total_size`` + ``weight_map``) and ``config.json``.

``dtype``:

* ``"bfloat16"`` (default): every tensor that is FP8/FP4/BF16 in the release is written as BF16; tensors the
  release keeps in F32 (``hc_*``, ``attn_sink``, ``ape``, ``gate.bias``) stay F32; ``tid2eid`` is I64. No scales.
* ``"float32"``: every float tensor as F32 (lossless for an fp32 model).
* ``"quantized"``: the release formats: FP8 e4m3 + 128x128 e8m0 ``.scale`` for the dense/shared-expert linears,
  indexer ``wq_b`` and MTP ``e_proj``/``h_proj``; packed FP4 + e8m0 per 32 columns for routed experts; BF16/F32
  /I64 as in the release; ``config.json`` gets a ``quantization_config`` and ``"expert_dtype": "fp4"``.

``config.json`` (:func:`~dsv4.checkpoint.hf_config.config_to_hf`) has the release's fields, ``compress_ratios`` with
one entry per MTP block after the backbone's.

A V4.1 model (its config a ``DSV41Config``) is written in the V4.1 release layout (:mod:`dsv4.checkpoint.keys`,
family ``deepseek_v41``): ``"quantized"`` stores the dense linears and ``engram.wkv`` as FP8 with 32x32 tiles, the
Engram tables FP8 with one scale per row and 32 columns, the routed experts packed FP4; ``"bfloat16"`` keeps in F32
what the V4.1 reference keeps in fp32 (``hc_*``, ``attn_sink``, ``gate.bias`` / ``bias_vl``, the compressor's
``wkv`` / ``wgate``, ``head``); ``config.json`` is nested (``text_config``, ``vision_config`` with no layers,
``image_token_id``).

Any parallel layout (FSDP2 shards, EP expert slices, cp / dp): every rank of the group calls
:func:`export_hf_checkpoint`. Every rank plans the same files from the metadata alone (:func:`converted_meta`, one
shard per ``max_shard_bytes`` in export order, each file's header and offsets from
:mod:`~dsv4.checkpoint.safetensors_write`) and gives each on-disk tensor a writer: a routed expert one of the ranks
holding it, a row-sharded Engram table (:mod:`dsv4.parallel.engram_table`) every rank its own rows (in chunks of
:data:`TABLE_ROW_CHUNK_BYTES`, quantised per row, never gathered), every other tensor the ranks in turn. An Engram
table kept in FP8 is written dequantised (``bfloat16`` / ``float32``) or re-quantised to the same values
(``quantized``: power-of-two row scales make the round trip exact). Rank 0 creates the files; then every rank walks the tensors in
the same order, gathers each (``full_tensor()``: a collective; a stacked expert tensor gives this rank's slice),
converts the ones it writes and writes them at their offsets; rank 0 renames the files and writes the index and
``config.json``. Peak extra memory: one gathered tensor (at most one FSDP unit) and its conversions, nothing per
shard. The files are byte-identical to a one-process export of the same weights, and to what
``safetensors.torch.save_file`` writes for each shard's tensors (``docs/checkpoints.md``).

The shard plan (:func:`_shards`) is ours rather than ``huggingface_hub.split_state_dict_into_shards_factory``: that
one names a lone shard ``model.safetensors`` (not ``model-00001-of-00001.safetensors``) and puts a tensor over the
limit in a shard of its own numbered before the open one (out of export order); otherwise the two give the same
files (``tests/unit/checkpoint/test_distributed_export.py``), and ours needs no run-time dependency.

The directory must be absent or empty unless ``overwrite`` (then every file the export did not write is removed
afterwards; :mod:`dsv4.checkpoint.export_dir`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.export_dir import export_dir_problem, remove_stale_files
from dsv4.checkpoint.hf_config import CONFIG_FILE, INDEX_FILE, SCHEMES, model_family, write_hf_config
from dsv4.checkpoint.quant import quantize, scale_shape
from dsv4.checkpoint.safetensors_write import TensorMeta, create_file, file_layout, write_rows, write_tensor
from dsv4.distributed import full_tensor, group_rank, group_size, is_initialized, resolve_group
from dsv4.model.moe import GroupedExperts
from dsv4.model.v41.engram_table import LocalEngramTable

EXPORT_DTYPES = ("bfloat16", "float32", "quantized")
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
TABLE_ROW_CHUNK_BYTES = 256 * 1024**2
"""A row-sharded Engram table is converted and written by chunks of about this many fp32 bytes of rows."""


@dataclass
class ExportReport:
    path: str
    files: list[str] = field(default_factory=list)
    total_size: int = 0
    num_tensors: int = 0
    weight_map: dict[str, str] = field(default_factory=dict)
    keys_written: list[str] = field(default_factory=list)  # the on-disk tensors this rank wrote


def _full(t: torch.Tensor) -> torch.Tensor:
    return full_tensor(t).detach().cpu()


def iter_hf_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(on-disk key, full tensor)`` for every persistent tensor of ``model`` (or for the ``(state-dict name,
    tensor)`` pairs of ``tensors``, e.g. a LoRA model's merged weights), experts split per expert."""
    family = model_family(model)
    for name, t in (model.state_dict().items() if tensors is None else tensors):
        if K.is_stacked_expert(name):
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if module.num_local_experts != module.num_experts:
                raise ValueError(
                    f"export: {name} holds experts [{module.expert_offset}, {module.expert_offset + module.num_local_experts}) "
                    f"of {module.num_experts}; call unshard_experts(model, ep_group) before exporting"
                )
            full = _full(t)
            for row in range(full.shape[0]):
                yield K.ours_to_hf(name, module.expert_offset + row, family), full[row].clone()
            continue
        hf = K.ours_to_hf(name, family=family)
        if hf is None:
            raise KeyError(f"export: no on-disk name for state-dict key {name!r}")
        yield hf, _full(t)


def convert_for_export(hf_key: str, tensor: torch.Tensor, dtype: str, family: str = K.V4) -> list[tuple[str, torch.Tensor]]:
    """One model tensor -> the on-disk tensor(s) of ``family`` (weight, and ``.scale`` when quantised)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    fmt = K.on_disk_format(hf_key, family)
    if not tensor.dtype.is_floating_point:
        return [(hf_key, tensor.to(torch.int64).contiguous())]
    if dtype == "float32":
        return [(hf_key, tensor.float().contiguous())]
    if fmt == "f32":
        return [(hf_key, tensor.float().contiguous())]
    if dtype == "quantized" and fmt in ("fp8", "fp8_rows", "fp4"):
        q, s = quantize(tensor, fmt, SCHEMES[family])
        return [(hf_key, q.contiguous()), (K.scale_key_of_weight(hf_key), s.contiguous())]
    return [(hf_key, tensor.to(torch.bfloat16).contiguous())]


@dataclass(frozen=True)
class ExportSource:
    """One state-dict tensor to export: its ``name``, (global) ``shape`` (a stacked expert tensor: this rank's
    ``[E_local, ...]``), whether it is floating point, and ``fetch()`` -> the full tensor (for a stacked expert
    tensor this rank's experts; a collective under FSDP: every rank fetches every source, in the same order)."""

    name: str
    shape: tuple[int, ...]
    is_float: bool
    fetch: Callable[[], torch.Tensor]
    rows: tuple[int, int] | None = None  # a row-sharded tensor: this rank holds (and writes) rows [start, stop)
    fetch_rows: Callable[[int, int], torch.Tensor] | None = None  # rows [a, b) of those (global row numbers)


def _table_rows(table: LocalEngramTable, first: int, last: int) -> torch.Tensor:
    """Rows ``[first, last)`` (global, held by ``table``) as fp32, the FP8 form dequantised."""
    local = torch.arange(first - table.row_start, last - table.row_start, device=table.weight.device)
    return table.read(local, torch.float32).detach().cpu()


def table_sources(model: nn.Module) -> tuple[dict[str, ExportSource], set[str]]:
    """The export sources of ``model``'s Engram tables (``{weight name: source}``, each the logical fp32 table) and
    the state-dict names they cover (the FP8 form's ``scale`` too). A row-sharded table is a ``rows`` source: every
    rank writes its own rows; a whole one is fetched whole."""
    from dsv4.parallel.engram_table import RowShardedEngramTable

    sources, covered = {}, set()
    for name, table in model.named_modules():
        if not isinstance(table, LocalEngramTable):
            continue
        weight = f"{name}.weight"
        held = (table.row_start, table.row_start + table.local_rows)
        sharded = isinstance(table, RowShardedEngramTable)
        sources[weight] = ExportSource(weight, (table.rows, table.head_dim), True,
                                       partial(_table_rows, table, *held), held if sharded else None,
                                       partial(_table_rows, table))
        covered |= {weight, f"{name}.scale"}
    return sources, covered


def model_sources(model: nn.Module) -> list[ExportSource]:
    """Every persistent tensor of ``model`` as it is (an Engram table as :func:`table_sources` gives it)."""
    tables, covered = table_sources(model)
    return [tables[name] if name in tables else ExportSource(name, tuple(t.shape), t.is_floating_point(), partial(_full, t))
            for name, t in model.state_dict().items() if name in tables or name not in covered]


def converted_meta(hf_key: str, shape: tuple[int, ...], is_float: bool, dtype: str, family: str = K.V4
                   ) -> list[TensorMeta]:
    """What :func:`convert_for_export` makes of a tensor of ``shape``, from the metadata alone."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    fmt = K.on_disk_format(hf_key, family)
    if not is_float:
        return [TensorMeta(hf_key, torch.int64, shape)]
    if dtype == "float32" or fmt == "f32":
        return [TensorMeta(hf_key, torch.float32, shape)]
    if dtype == "quantized" and fmt in ("fp8", "fp8_rows", "fp4"):
        if len(shape) != 2 or (fmt == "fp4" and shape[1] % 2):
            raise ValueError(f"export: {hf_key} of shape {list(shape)} cannot be stored as {fmt} (2-D"
                             f"{', even columns' if fmt == 'fp4' else ''})")
        scale = TensorMeta(K.scale_key_of_weight(hf_key), torch.float8_e8m0fnu,
                           tuple(scale_shape(fmt, shape, SCHEMES[family])))
        if fmt == "fp4":
            return [TensorMeta(hf_key, torch.int8, (shape[0], shape[1] // 2)), scale]
        return [TensorMeta(hf_key, torch.float8_e4m3fn, shape), scale]
    return [TensorMeta(hf_key, torch.bfloat16, shape)]


@dataclass
class _Planned:
    """One on-disk tensor before conversion: its source, expert row (global index) and the rank that writes it."""

    source: int
    hf_key: str
    expert: int | None
    writer: int  # ROWS: every rank writes the rows it holds
    parts: list[TensorMeta]


ROWS = -1


def expert_holders(model: nn.Module, group=None) -> dict[str, list[tuple[int, int]]]:
    """``{GroupedExperts module name: [(expert_offset, num_local_experts) of each rank of group]}`` (a collective
    when ``torch.distributed`` is initialised; ``group`` None: the world)."""
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
    local = [(m.expert_offset, m.num_local_experts) for _, m in modules]
    gathered = [local]
    group = resolve_group(group) if is_initialized() else None
    if is_initialized() and group_size(group) > 1:
        gathered = [None] * group_size(group)
        dist.all_gather_object(gathered, local, group=group)
    return {name: [ranges[i] for ranges in gathered] for i, (name, _) in enumerate(modules)}


def _expert_writers(name: str, num_experts: int, ranges: list[tuple[int, int]]) -> list[int]:
    """The rank that writes each expert: one of its holders (spread over replicas)."""
    writers = []
    for e in range(num_experts):
        holders = [r for r, (off, n) in enumerate(ranges) if off <= e < off + n]
        if not holders:
            missing = [x for x in range(num_experts) if not any(o <= x < o + n for o, n in ranges)]
            raise ValueError(
                f"export: experts {missing[0]}..{missing[-1]} of {name} ({num_experts} experts) are held by no rank "
                f"(ranges {ranges}); export an expert-sharded model on all its EP ranks together, or call "
                "unshard_experts(model, ep_group) first")
        writers.append(holders[e % len(holders)])
    return writers


def _plan(model: nn.Module, sources: list[ExportSource], dtype: str, world: int, group, family: str = K.V4
          ) -> list[_Planned]:
    holders = expert_holders(model, group)
    planned: list[_Planned] = []
    plain = 0
    for i, src in enumerate(sources):
        if K.is_stacked_expert(src.name):
            module_name = src.name.rsplit(".", 1)[0]
            module = model.get_submodule(module_name)
            writers = _expert_writers(module_name, module.num_experts, holders[module_name])
            for e in range(module.num_experts):
                hf = K.ours_to_hf(src.name, e, family)
                planned.append(_Planned(i, hf, e, writers[e],
                                        converted_meta(hf, src.shape[1:], src.is_float, dtype, family)))
            continue
        hf = K.ours_to_hf(src.name, family=family)
        if hf is None:
            raise KeyError(f"export: no on-disk name for state-dict key {src.name!r} ({family} layout)")
        if src.rows is not None:
            planned.append(_Planned(i, hf, None, ROWS, converted_meta(hf, src.shape, src.is_float, dtype, family)))
            continue
        planned.append(_Planned(i, hf, None, plain % world, converted_meta(hf, src.shape, src.is_float, dtype, family)))
        plain += 1
    return planned


def _shards(planned: list[_Planned], max_shard_bytes: int) -> list[list[TensorMeta]]:
    """On-disk tensors in export order, a new shard whenever the next one would pass ``max_shard_bytes``."""
    shards: list[list[TensorMeta]] = [[]]
    size = 0
    for p in planned:
        for meta in p.parts:
            if shards[-1] and size + meta.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(meta)
            size += meta.nbytes
    return shards if shards[-1] else []


def export_hf_checkpoint(
    model: nn.Module,
    path: str,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config=None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    sources: list[ExportSource] | None = None,
    group=None,
    overwrite: bool = False,
    beside: bool = False,
    file_prefix: str = "model",
) -> ExportReport:
    """Write ``model`` to ``path`` (see the module docstring). ``config`` defaults to ``model.config``; the tensors
    come from ``sources`` (``dsv4.peft.apply.merged_sources`` for a merged LoRA model), else the ``(state-dict name,
    tensor)`` pairs of ``tensors`` (materialised first), else ``model.state_dict()``. Under ``torch.distributed``
    every rank of ``group`` (default: the world) calls it with the same model structure.

    ``path`` must be absent or empty, else ``ValueError`` before anything is written (rank 0 looks; every rank
    raises); ``overwrite``: a directory of files is accepted and, once the new files are in place, every file the
    export did not write is removed (:mod:`dsv4.checkpoint.export_dir`).

    ``beside``: add the tensors to the checkpoint already in ``path`` (a DSpark drafter next to its target): the
    shards are named ``{file_prefix}-0000i-of-0000n.safetensors`` and merged into the directory's index; its other
    files and its ``config.json`` stay as they are. A key the index already holds, or a shard name already there, is
    refused (``ValueError``) unless ``overwrite``: then the index points the key at the new shard (a replaced weight's
    old ``.scale`` leaves the index with it, unless the new export writes one) and the directory's
    ``{file_prefix}-*`` shards no index entry names any more are removed (a replaced key inside another file stays
    in that file's bytes, unreferenced)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    config = config if config is not None else getattr(model, "config", None)
    if sources is None:
        sources = model_sources(model) if tensors is None else [
            ExportSource(name, tuple(t.shape), t.is_floating_point(), partial(lambda v: v, _full(t)))
            for name, t in tensors]
    distributed = is_initialized()
    group = resolve_group(group) if distributed else None
    rank, world = group_rank(group), group_size(group)
    family = model_family(model, config)
    planned = _plan(model, sources, dtype, world, group, family)
    shards = _shards(planned, max_shard_bytes)
    n = len(shards)
    names = [f"{file_prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    problem = None
    if rank == 0:
        problem = (_beside_problem(str(path), [m.key for metas in shards for m in metas], names, overwrite)
                   if beside else export_dir_problem(str(path), key="path", overwrite=overwrite,
                                                     flag="overwrite=True"))
    if distributed and world > 1:  # rank 0 alone looks (it creates the files), so every rank stops or none does
        box = [problem]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        problem = box[0]
    if problem is not None:
        raise ValueError(problem)
    temps = [f"shard-{i:05d}.tmp" for i in range(n)]
    layouts = [file_layout(metas, {"format": "pt"}) for metas in shards]
    file_of = {meta.key: i for i, metas in enumerate(shards) for meta in metas}
    report = ExportReport(path=path, files=names)
    for i, metas in enumerate(shards):
        for meta in metas:
            report.weight_map[meta.key] = names[i]
            report.total_size += meta.nbytes
            report.num_tensors += 1

    def barrier() -> None:
        if distributed and world > 1:
            dist.barrier(group=group)

    if rank == 0:
        os.makedirs(path, exist_ok=True)
        for temp, layout in zip(temps, layouts):
            create_file(os.path.join(path, temp), layout)
    barrier()
    fds: dict[int, int] = {}
    try:
        by_source: dict[int, list[_Planned]] = {}
        for p in planned:
            by_source.setdefault(p.source, []).append(p)
        def write_held_rows(src: ExportSource, p: _Planned) -> None:
            """A row-sharded source: this rank's rows, converted and written by chunks at their place."""
            start, stop = src.rows
            step = max(1, TABLE_ROW_CHUNK_BYTES // max(1, 4 * math.prod(src.shape[1:])))
            for first in range(start, stop, step):
                last = min(stop, first + step)
                value = src.fetch_rows(first, last)
                for meta, (key, t) in zip(p.parts, convert_for_export(p.hf_key, value, dtype, family), strict=True):
                    if key != meta.key or t.dtype != meta.dtype or tuple(t.shape[1:]) != meta.shape[1:]:
                        raise ValueError(f"export: {key} rows converted to {t.dtype} {list(t.shape)}, planned "
                                         f"{meta.dtype} {list(meta.shape)} under {meta.key}")
                    f = file_of[key]
                    if f not in fds:
                        fds[f] = os.open(os.path.join(path, temps[f]), os.O_WRONLY)
                    write_rows(fds[f], layouts[f], key, t, first, meta.shape[0], os.path.join(path, temps[f]))
            if stop > start:
                report.keys_written.extend(meta.key for meta in p.parts)

        def write_source(i: int, src: ExportSource) -> None:
            """Fetch one source (every rank: a collective under FSDP) and write this rank's part of it; nothing
            outlives the call, so the next fetch starts with no tensor of this one alive."""
            if src.rows is not None:  # no collective: each rank writes the rows it holds
                for p in by_source.get(i, []):
                    write_held_rows(src, p)
                return
            full = src.fetch().detach().cpu()
            offset = model.get_submodule(src.name.rsplit(".", 1)[0]).expert_offset if K.is_stacked_expert(src.name) else 0
            for p in by_source.get(i, []):
                if p.writer != rank:
                    continue
                value = full if p.expert is None else full[p.expert - offset]
                for meta, (key, t) in zip(p.parts, convert_for_export(p.hf_key, value, dtype, family), strict=True):
                    if key != meta.key or t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
                        raise ValueError(f"export: {key} converted to {t.dtype} {list(t.shape)}, planned {meta.dtype} "
                                         f"{list(meta.shape)} under {meta.key}")
                    f = file_of[key]
                    if f not in fds:
                        fds[f] = os.open(os.path.join(path, temps[f]), os.O_WRONLY)
                    write_tensor(fds[f], layouts[f], key, t, os.path.join(path, temps[f]))
                    report.keys_written.append(key)

        for i, src in enumerate(sources):
            write_source(i, src)
    finally:
        for fd in fds.values():
            os.close(fd)
    barrier()
    if rank == 0 and beside:
        for temp, final in zip(temps, names):
            os.replace(os.path.join(path, temp), os.path.join(path, final))
        _merge_index(path, report.weight_map, file_prefix)
    elif rank == 0:
        for temp, final in zip(temps, names):
            os.replace(os.path.join(path, temp), os.path.join(path, final))
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": report.total_size}, "weight_map": report.weight_map}, f, indent=2)
        if config is not None:
            torch_dtype = {"bfloat16": "bfloat16", "float32": "float32", "quantized": "bfloat16"}[dtype]
            write_hf_config(config, path, quantized=dtype == "quantized", torch_dtype=torch_dtype)
        if overwrite:
            remove_stale_files(path, [*names, INDEX_FILE, *([CONFIG_FILE] if config is not None else [])])
    barrier()
    return report


def _beside_problem(path: str, keys: list[str], names: list[str], overwrite: bool) -> str | None:
    """Why ``keys`` (in shards ``names``) cannot be added to the checkpoint in ``path``, or None."""
    index_file = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_file):
        return f"path={path!r} holds no {INDEX_FILE}: there is no checkpoint to add the tensors beside"
    if overwrite:
        return None
    with open(index_file) as f:
        held = json.load(f).get("weight_map", {})
    clash = sorted(set(keys) & set(held))
    if clash:
        return (f"{path}: its index already holds {len(clash)} of the exported keys (e.g. {clash[:3]}); set "
                "overwrite=True to replace them")
    taken = [n for n in names if os.path.lexists(os.path.join(path, n))]
    if taken:
        return f"{path}: shard file(s) {taken[:3]} exist already; set overwrite=True to replace them"
    return None


def _merge_index(path: str, weight_map: dict[str, str], file_prefix: str) -> None:
    """Point ``path``'s index at the new shards for every key of ``weight_map`` (dropping the old ``.scale`` of a
    weight now written without one), remove the ``file_prefix`` shards no entry names any more, and recount
    ``metadata.total_size`` from the shard headers."""
    from dsv4.checkpoint.safetensors_io import CheckpointDir

    index_file = os.path.join(path, INDEX_FILE)
    with open(index_file) as f:
        index = json.load(f)
    held = dict(index.get("weight_map", {}))
    for key in weight_map:  # a replaced weight's old scale goes too (a quantised tensor rewritten in float)
        scale = K.scale_key_of_weight(key)
        if scale is not None and scale not in weight_map:
            held.pop(scale, None)
    merged = {**held, **weight_map}
    used = set(merged.values())
    for entry in os.scandir(path):
        if entry.name.startswith(f"{file_prefix}-") and entry.name.endswith(".safetensors") and entry.name not in used:
            os.unlink(entry.path)
    index["weight_map"] = merged
    temp = index_file + ".tmp"
    with open(temp, "w") as f:
        json.dump(index, f, indent=2)
    os.replace(temp, index_file)
    index.setdefault("metadata", {})["total_size"] = sum(t.nbytes for t in CheckpointDir.open(path).tensors.values())
    with open(temp, "w") as f:
        json.dump(index, f, indent=2)
    os.replace(temp, index_file)

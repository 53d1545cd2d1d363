"""Safetensors access by header: list the tensors of a checkpoint directory without loading them, and read single
tensors with one ``seek`` + ``readinto`` (no mmap, so reading one key keeps only that key resident).

File layout: 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON ``{key: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data; offsets are relative to ``8 + n``.
A directory's key -> shard map comes from ``model.safetensors.index.json`` when present, else from scanning the
headers of every ``*.safetensors`` file; either way each shard's header is read once (headers only).

Why our own parser and not ``safetensors.safe_open``: ``safe_open`` maps the whole shard, so every page a key
touched stays resident until the file is closed; opening it once per key instead re-parses the shard's header for
every key (quadratic in keys per shard); and its errors name neither the file nor, for offsets that disagree with
the shape, the key. The measurements behind this are in ``docs/checkpoints.md``.

Hostile files are refused with :class:`CheckpointFormatError` (a ``ValueError``) naming the file (and the key),
before anything sized by the file's claims is allocated: the header length is checked against the file size and
:data:`MAX_HEADER_BYTES` before the header is read; the header must be UTF-8 JSON of ``{key: {dtype, shape,
data_offsets}}`` without duplicate keys; every tensor's bytes must lie inside the file, not overlap another's, and
(for a known dtype) equal ``prod(shape) x itemsize``. An index's shard names must stay inside the directory
(relative, no ``..``; symlinked shards, as in the Hugging Face cache, are followed). A refused file costs at most
its header's actual bytes; a file whose length field lies costs nothing.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import torch

from dsv4.checkpoint.hf_config import INDEX_FILE

# safetensors dtype tag -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

MAX_HEADER_BYTES = 100_000_000  # a shard header or an index file above 100 MB is refused (as safetensors does)
MAX_DIMS = 64


class CheckpointFormatError(ValueError):
    """A checkpoint file or index that is not what it claims to be; the message names the file (and the key)."""


@dataclass(frozen=True)
class TensorInfo:
    key: str
    dtype: str  # safetensors tag, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    file: str  # shard file name (relative to the directory)
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"{self.key} (in {self.file}): unknown safetensors dtype {self.dtype!r:.200} (known: {sorted(DTYPES)})"
            )
        return DTYPES[self.dtype]


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise CheckpointFormatError(f"duplicate key {dup!r:.200}")
    return out


def _parse_json(path: str, raw: bytes, what: str):
    """``raw`` (UTF-8 JSON) parsed, or a :class:`CheckpointFormatError` naming ``path``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{path}: {what} is not valid UTF-8 (byte {e.start} of {len(raw)})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{path}: {what}: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(
            f"{path}: {what} is not valid JSON (truncated or corrupt?): {e.msg} (byte {e.pos} of {len(raw)})"
        ) from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of > 4300 digits, or nesting too deep
        raise CheckpointFormatError(f"{path}: {what} is not usable JSON: {type(e).__name__}: {e}") from None


def _read_exact(f, n: int, path: str, what: str) -> bytes:
    raw = f.read(n)
    if len(raw) != n:
        raise CheckpointFormatError(f"{path}: file ended after {len(raw)} of the {n} bytes of its {what}")
    return raw


def _check_entry(path: str, key: str, meta, data_start: int, size: int) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, absolute begin, absolute end)`` of one header entry, checked against the file."""
    where = f"{path}: tensor {key!r:.200}"  # a hostile name may be long
    if not isinstance(meta, dict):
        raise CheckpointFormatError(f"{where}: header entry is a {type(meta).__name__}, not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointFormatError(f"{where}: dtype {dtype!r:.200} is not a string")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > MAX_DIMS:
        raise CheckpointFormatError(
            f"{where}: shape {shape!r:.200} is not a list of at most {MAX_DIMS} non-negative integers"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and type(offsets[0]) is type(offsets[1]) is int
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointFormatError(f"{where}: data_offsets {offsets!r:.200} are not [begin, end] with 0 <= begin <= end")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > size:
        raise CheckpointFormatError(
            f"{where}: data_offsets {offsets} run to byte {end}, past the end of the file ({size} bytes)"
        )
    if dtype in DTYPES:  # unknown tags are refused when read (and by the loader's checks, naming the key)
        nbytes, need = end - begin, DTYPES[dtype].itemsize
        for d in shape:
            need *= d
        if need != nbytes:
            raise CheckpointFormatError(
                f"{where}: data_offsets {offsets} hold {nbytes} bytes, but shape {shape} x {dtype} needs {need}"
            )
    return dtype, tuple(shape), begin, end


def _read_entries(path: str) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointFormatError(f"{path}: not a safetensors file ({size} bytes, no 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointFormatError(
                f"{path}: header length {n} exceeds the file ({size} bytes): truncated or not a safetensors file"
            )
        if n > MAX_HEADER_BYTES:
            raise CheckpointFormatError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        header = _parse_json(path, _read_exact(f, n, path, "header"), "header")
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    start = 8 + n
    entries = {key: _check_entry(path, key, meta, start, size) for key, meta in header.items()}
    spans = sorted((b, e, k) for k, (_, _, b, e) in entries.items() if e > b)
    for (_, prev_end, prev), (b, _, k) in zip(spans, spans[1:]):
        if b < prev_end:
            raise CheckpointFormatError(f"{path}: tensor {k!r:.200}: data overlaps that of {prev!r:.200}")
    return entries, start


def _shard_name_inside(index_file: str, directory: str, name) -> str:
    """``name`` if it is a relative path that stays inside ``directory`` (lexically: symlinks are allowed)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointFormatError(f"{index_file}: shard name {name!r:.200} is not a file name")
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointFormatError(
            f"{index_file}: shard {name!r:.200} points outside the checkpoint directory {directory} (refused)"
        )
    return name


def _read_index(directory: str, index_file: str) -> dict[str, str]:
    size = os.path.getsize(index_file)
    if size > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"{index_file}: {size} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    with open(index_file, "rb") as f:
        index = _parse_json(index_file, _read_exact(f, size, index_file, "contents"), "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{index_file}: no \"weight_map\" object of tensor name -> shard file")
    checked: set[str] = set()
    for name in weight_map.values():
        if not (isinstance(name, str) and name in checked):
            checked.add(_shard_name_inside(index_file, directory, name))
    return weight_map


@dataclass
class CheckpointDir:
    """Every tensor of a checkpoint directory, by key, from the shard headers (nothing is loaded)."""

    path: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    has_index: bool = False

    @classmethod
    def open(cls, path: str) -> "CheckpointDir":
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
        index_file = os.path.join(path, INDEX_FILE)
        if os.path.exists(index_file):
            weight_map = _read_index(path, index_file)
            files = sorted(set(weight_map.values()))
        else:
            weight_map = {}
            files = sorted(
                n for n in os.listdir(path) if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n))
            )
            if not files:
                raise FileNotFoundError(f"{path}: no {INDEX_FILE} and no *.safetensors files")
        out = cls(path=path, has_index=bool(weight_map))
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index_file} names shard {name!r}, which is not a file in {path}")
            entries, _ = _read_entries(file)
            for key, (dtype, shape, begin, end) in entries.items():
                if weight_map and weight_map.get(key) != name:
                    continue  # the index is authoritative
                if key in out.tensors:
                    raise CheckpointFormatError(f"{key}: present in both {out.tensors[key].file} and {name} of {path}")
                out.tensors[key] = TensorInfo(key, dtype, shape, name, begin, end)
        missing = sorted(k for k in weight_map if k not in out.tensors)
        if missing:
            raise KeyError(f"{INDEX_FILE} lists {len(missing)} keys absent from their shard headers, e.g. {missing[:5]}")
        return out

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})


class TensorReader:
    """Reads single tensors from a checkpoint directory; counts keys and bytes read. Keeps at most one file
    handle open (files are visited shard by shard by the loader)."""

    def __init__(self, ckpt: CheckpointDir) -> None:
        self.ckpt = ckpt
        self.keys_read: list[str] = []
        self.bytes_read = 0
        self._counted: set[str] = set()
        self._name: str | None = None
        self._handle = None

    def _file(self, name: str):
        if self._name != name:
            self.close()
            self._handle = open(os.path.join(self.ckpt.path, name), "rb", buffering=0)
            self._name = name
        return self._handle

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only its rows ``[start, stop)`` along the first dimension (one contiguous byte
        range). A key counts in ``keys_read`` once, at its first read (whole or any rows)."""
        info = self.ckpt.tensors[key]
        dtype = info.torch_dtype()
        numel = 1
        for d in info.shape:
            numel *= d
        if numel * dtype.itemsize != info.nbytes:  # checked when the header was read; a hand-built TensorInfo
            raise CheckpointFormatError(
                f"{self.ckpt.path}/{info.file}: tensor {key!r}: {info.nbytes} bytes, but shape {list(info.shape)} x "
                f"{info.dtype} needs {numel * dtype.itemsize}"
            )
        shape, begin, nbytes = tuple(info.shape), info.begin, info.nbytes
        if rows is not None:
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"{key}: rows [{start}, {stop}) outside its shape {list(shape)}")
            row_bytes = info.nbytes // shape[0] if shape[0] else 0
            shape, begin, nbytes = (stop - start, *shape[1:]), info.begin + start * row_bytes, (stop - start) * row_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8)
        f = self._file(info.file)
        f.seek(begin)
        view = memoryview(buf.numpy())
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointFormatError(
                    f"{self.ckpt.path}/{info.file}: tensor {key!r}: file ended after {begin - info.begin + got} of its "
                    f"{info.nbytes} bytes"
                )
            got += n
        if key not in self._counted:
            self._counted.add(key)
            self.keys_read.append(key)
        self.bytes_read += nbytes
        return buf.view(dtype).reshape(shape)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._name = None

"""Minimal safetensors access by header: list tensors of a checkpoint directory without loading them, and read
single tensors with one ``seek`` + ``readinto`` (no mmap, so reading one key keeps only that key resident).

File layout: 8-byte little-endian header length ``n``, ``n`` bytes of JSON ``{key: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data; offsets are relative to ``8 + n``.
A directory's key -> shard map comes from ``model.safetensors.index.json`` when present, else from scanning the
headers of every ``*.safetensors`` file; either way each shard's header is read once (headers only).
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
            raise ValueError(f"{self.key}: unknown safetensors dtype {self.dtype!r} (known: {sorted(DTYPES)})")
        return DTYPES[self.dtype]


def read_header(path: str) -> tuple[dict, int]:
    """``(header without __metadata__, data start offset)`` of one ``.safetensors`` file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


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
            with open(index_file) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            weight_map = {}
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{path}: no {INDEX_FILE} and no *.safetensors files")
        out = cls(path=path, has_index=bool(weight_map))
        for name in files:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise FileNotFoundError(f"{INDEX_FILE} names shard {name!r}, which is missing from {path}")
            header, start = read_header(file)
            for key, meta in header.items():
                if weight_map and weight_map.get(key) != name:
                    continue  # the index is authoritative
                if key in out.tensors:
                    raise ValueError(f"{key}: present in both {out.tensors[key].file} and {name}")
                b, e = meta["data_offsets"]
                out.tensors[key] = TensorInfo(key, meta["dtype"], tuple(meta["shape"]), name, start + b, start + e)
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
        self._name: str | None = None
        self._handle = None

    def _file(self, name: str):
        if self._name != name:
            self.close()
            self._handle = open(os.path.join(self.ckpt.path, name), "rb", buffering=0)
            self._name = name
        return self._handle

    def read(self, key: str) -> torch.Tensor:
        info = self.ckpt.tensors[key]
        dtype = info.torch_dtype()
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        f = self._file(info.file)
        f.seek(info.begin)
        view = memoryview(buf.numpy())
        got = 0
        while got < info.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{key}: file {info.file} ended after {got} of {info.nbytes} bytes")
            got += n
        self.keys_read.append(key)
        self.bytes_read += info.nbytes
        return buf.view(dtype).reshape(info.shape)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._name = None

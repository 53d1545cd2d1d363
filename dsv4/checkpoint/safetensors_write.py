"""Safetensors files laid out before any tensor exists, then filled tensor by tensor, by any number of processes.

A file's bytes depend only on its tensors' names, dtypes and shapes (and their data), so the header and every
tensor's byte range are known from the metadata alone (:func:`file_layout`). The layout is the one
``safetensors.torch.save_file`` writes for the same tensors (header ``{"__metadata__": ..., key: {dtype, shape,
data_offsets}}`` in compact JSON, padded with spaces to a multiple of 8; data ordered by dtype, largest first in
safetensors' own dtype order, then by name), so a file filled here is byte-identical to ``save_file`` of the same
dict (``tests/unit/checkpoint/test_distributed_export.py``).

:func:`create_file` writes the header and sets the file's length; :func:`write_tensor` writes one tensor's bytes
at its offset, :func:`write_rows` a range of a tensor's rows (``pwrite``: processes writing disjoint tensors of one file need no coordination beyond "created
before written", on a local disk or a shared POSIX filesystem).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from dsv4.checkpoint.safetensors_io import DTYPES

TAG_OF = {dtype: tag for tag, dtype in DTYPES.items()}
# safetensors' data order: dtypes in this order (its Dtype enum, largest first), then names
_DTYPE_ORDER = ["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_RANK = {tag: i for i, tag in enumerate(_DTYPE_ORDER)}


@dataclass(frozen=True)
class TensorMeta:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def tag(self) -> str:
        if self.dtype not in TAG_OF:
            raise ValueError(f"{self.key}: dtype {self.dtype} has no safetensors tag")
        return TAG_OF[self.dtype]


@dataclass(frozen=True)
class FileLayout:
    header: bytes  # the 8-byte length and the padded JSON header
    offsets: dict[str, tuple[int, int]]  # key -> absolute [begin, end) in the file
    size: int


def file_layout(tensors: list[TensorMeta], metadata: dict[str, str] | None = None) -> FileLayout:
    """The bytes ``safetensors.torch.save_file`` would put before the data, and where each tensor goes."""
    keys = [t.key for t in tensors]
    if len(set(keys)) != len(keys):
        raise ValueError(f"file_layout: duplicate tensor names in {keys}")
    ordered = sorted(tensors, key=lambda t: (_RANK[t.tag], t.key))
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    spans, pos = {}, 0
    for t in ordered:
        header[t.key] = {"dtype": t.tag, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        spans[t.key] = (pos, pos + t.nbytes)
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return FileLayout(header=struct.pack("<Q", len(text)) + text,
                      offsets={k: (start + b, start + e) for k, (b, e) in spans.items()}, size=start + pos)


def create_file(path: str, layout: FileLayout) -> None:
    """Write ``layout``'s header to ``path`` (replacing any file there) and extend it to its full size."""
    with open(path, "wb") as f:
        f.write(layout.header)
        f.truncate(layout.size)


def write_tensor(fd: int, layout: FileLayout, key: str, tensor: torch.Tensor, path: str = "") -> None:
    """Write ``tensor``'s bytes at ``key``'s place in the file open as ``fd`` (its dtype and size checked)."""
    begin, end = layout.offsets[key]
    t = tensor.detach().contiguous().cpu()
    if t.numel() * t.element_size() != end - begin:
        raise ValueError(f"{path}: tensor {key!r} has {t.numel() * t.element_size()} bytes, its place {end - begin}")
    _pwrite(fd, t, begin)


def write_rows(fd: int, layout: FileLayout, key: str, rows: torch.Tensor, first: int, total: int,
               path: str = "") -> None:
    """Write ``rows`` as rows ``[first, first + len(rows))`` of the ``total``-row tensor ``key`` (dim 0), at their
    place in the file open as ``fd``: ranks holding disjoint rows of one tensor write it together."""
    begin, end = layout.offsets[key]
    t = rows.detach().contiguous().cpu()
    row_bytes = (end - begin) // total if total else 0
    if row_bytes * total != end - begin or t.numel() * t.element_size() != row_bytes * t.shape[0] or \
            not 0 <= first <= first + t.shape[0] <= total:
        raise ValueError(f"{path}: rows [{first}, {first + t.shape[0]}) of {key!r} ({t.numel() * t.element_size()} "
                         f"bytes) do not fit its {total} rows of {row_bytes} bytes")
    _pwrite(fd, t, begin + first * row_bytes)


def _pwrite(fd: int, t: torch.Tensor, offset: int) -> None:
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)

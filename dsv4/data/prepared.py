"""Data prepared once: documents tokenized and packed into memory-mapped arrays on disk, reused by every later start.

:func:`prepare_dataset` returns the packed rows of a data source as a :class:`PreparedRows` dataset read from
``<cache_dir>/<kind>-<key>/`` (the key: :mod:`dsv4.data.prepared_key`); the rows are identical, token for token,
to those of the in-memory :func:`~dsv4.data.dataset.build_packed_dataset` for the same inputs (same documents,
order, packing, labels, document ids and positions). :func:`prepare_split_dataset` does the same for a
``data.val_fraction`` split: the training rows in ``<dir>/train/`` and the held-out rows in ``<dir>/val/``, each
equal to the in-memory packing of its part of :func:`~dsv4.data.validation.split_documents` (the documents are
tokenized once; the split is chosen on document indices, then each part is packed). A rows directory holds

* ``input_ids.npy`` / ``labels.npy``: ``int32 [N, S]`` (``numpy.load(mmap_mode="r")``: a rank reads only the rows
  it is given; pages it never touches are never read);
* ``pieces.npy`` ``int64 [P, 3]``: ``(document index, first token, length)`` of every piece, rows back to back;
  ``row_ptr.npy`` ``int64 [N + 1]``: row ``r`` holds pieces ``row_ptr[r]:row_ptr[r + 1]``. Document ids
  (``1..k``, 0 on padding) and positions (``0..len-1``) of a row follow from them and the shard multiple;
* ``meta.json``: the key's inputs (:func:`~dsv4.data.prepared_key.prepared_fingerprint`), the
  :class:`~dsv4.data.packer.PackStats`, the row count and the tokens of its documents.

A split directory holds ``train/``, ``val/`` and a ``meta.json`` (the fingerprint, each part's row and document
count, the tokens), written last.

**Building** happens once per key: the builder holds ``<dir>.lock`` (a :class:`filelock.FileLock`: ``flock`` on
the lock file), writes into a temporary directory next to the final one and renames it into place when complete,
so a reader sees a finished directory or none. Every other process (the ranks of a ``torchrun`` launch, a second
job) waits on the lock, up to ``wait_timeout_s`` (a TimeoutError names the lock and the directory), then maps the
finished one. A start that finds the directory logs ``data: reusing prepared dataset <dir> (N rows, T tokens)``
(a split: ``(N training rows, M held-out rows, T tokens)``) and tokenizes nothing.

**Streaming**: records are read one at a time from the source (``DataSource.records``: JSONL lines, dataset rows,
corpus files), tokenized by ``num_proc`` worker processes in chunks of :data:`CHUNK` records (results taken in
submission order), and appended to flat ``int32`` token and label files; only per-document tables (a few integers
per document and piece) stay in memory. The rows are then written in blocks of :data:`ROW_BLOCK` rows into
``numpy.lib.format.open_memmap`` arrays. A corpus larger than host memory is prepared with memory proportional to
its number of documents, not its tokens. A registered source without ``records`` is tokenized in memory by its
``documents`` factory and then written the same way. Progress: a ``tqdm`` bar on a terminal, else a plain
``data: tokenized ...`` line every :data:`PROGRESS_EVERY_S` seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from filelock import FileLock, Timeout

from dsv4.batch import IGNORE_INDEX, TokenBatch
from dsv4.config import check_cp_length
from dsv4.data.packer import OVERLONG, PackStats, _positive_int, first_fit_decreasing
from dsv4.data.prepared_key import prepared_fingerprint, prepared_path
from dsv4.data.sources import Document, Record, record_document, source_args
from dsv4.data.validation import check_val_fraction, held_out_indices

log = logging.getLogger("dsv4")

CHUNK = 64  # records per task handed to a tokenizing process
ROW_BLOCK = 256  # rows materialised at once
PROGRESS_EVERY_S = 10.0
ARRAYS = ("input_ids", "labels", "pieces", "row_ptr")
TRAIN, VAL = "train", "val"  # the parts of a split directory


# -------------------------------------------------------------------------------------------------- dataset


class PreparedRows:
    """The packed rows of a prepared directory, memory-mapped read-only: item ``i`` is row ``i`` as a one-row
    :class:`~dsv4.batch.TokenBatch` (int64, as :class:`~dsv4.data.packer.PackedRows` gives it). The arrays are
    opened lazily in each process (a DataLoader worker or a spawned rank maps its own)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        meta = json.loads((self.path / "meta.json").read_text())
        self.stats = PackStats(**meta["stats"])
        self.pad_id = int(meta["fingerprint"]["pad_id"])
        self.num_rows = int(meta["num_rows"])
        self._arrays: dict[str, np.ndarray] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {name: np.load(self.path / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
        return self._arrays

    def __len__(self) -> int:
        return self.num_rows

    @property
    def seq_len(self) -> int:
        return self.stats.seq_len

    def row_pieces(self, index: int) -> list[tuple[int, int, int]]:
        """``(document index, first token, length)`` of the pieces of row ``index``, in row order."""
        a = self.arrays
        lo, hi = int(a["row_ptr"][index]), int(a["row_ptr"][index + 1])
        return [tuple(int(x) for x in p) for p in a["pieces"][lo:hi]]

    def __getitem__(self, index: int) -> TokenBatch:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"PreparedRows: row {index} is out of range for {n} rows")
        index %= n
        a = self.arrays
        ids = torch.from_numpy(np.asarray(a["input_ids"][index], dtype=np.int64)).unsqueeze(0)
        labels = torch.from_numpy(np.asarray(a["labels"][index], dtype=np.int64)).unsqueeze(0)
        seq_ids, positions = _row_ids_positions([p[2] for p in self.row_pieces(index)], self.seq_len,
                                                self.stats.shard_multiple)
        return TokenBatch(ids, labels, torch.from_numpy(seq_ids).unsqueeze(0),
                          torch.from_numpy(positions).unsqueeze(0))


def _row_ids_positions(lengths: Sequence[int], seq_len: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    seq_ids = np.zeros(seq_len, dtype=np.int64)
    positions = np.zeros(seq_len, dtype=np.int64)
    offset = 0
    for k, n in enumerate(lengths):
        seq_ids[offset:offset + n] = k + 1
        positions[offset:offset + n] = np.arange(n)
        offset += -(-n // multiple) * multiple
    return seq_ids, positions


# -------------------------------------------------------------------------------------------------- tokenize

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, chat_template: str | None, messages_key: str) -> None:
    from dsv4.data.tokenizers import build_tokenizer

    torch.set_num_threads(1)
    _WORKER.update(tokenizer=build_tokenizer(tokenizer), chat_template=chat_template, messages_key=messages_key)


def _encoded(document: Document) -> tuple[np.ndarray, np.ndarray]:
    """Ids and labels (shifted inside the document, -100 where the target is not supervised and on the last token;
    the packer's rule) as int32."""
    ids = np.asarray(document.ids, dtype=np.int64).reshape(-1)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    if ids.size > 1:
        keep = np.ones(ids.size - 1, dtype=bool) if document.loss_mask is None else \
            np.asarray(document.loss_mask, dtype=bool).reshape(-1)[1:]
        labels[:-1] = np.where(keep, ids[1:], IGNORE_INDEX)
    return ids.astype(np.int32), labels.astype(np.int32)


def _tokenize_chunk(chunk: list[Record]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    w = _WORKER
    return [(r[0], *_encoded(record_document(r, w["messages_key"], w["tokenizer"], w["chat_template"])))
            for r in chunk]


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _Progress:
    """A tqdm bar on a terminal, else a log line every PROGRESS_EVERY_S seconds (and at the end)."""

    def __init__(self, total: int | None) -> None:
        self.total, self.done, self.tokens = total, 0, 0
        self.start = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="doc", desc="data: tokenizing", dynamic_ncols=True)

    def update(self, documents: int, tokens: int) -> None:
        self.done += documents
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(documents)
        elif time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            self._line()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total else ""
        log.info("data: tokenized %d%s documents, %d tokens, %.0f s", self.done, of, self.tokens,
                 time.monotonic() - self.start)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._line()


def _tokenized(source: Mapping[str, Any], num_proc: int) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """``(where, ids, labels)`` of every document, in source order, tokenized by ``num_proc`` processes."""
    kwargs = dict(source)
    src, args = source_args(**kwargs)
    if src.records is None:  # a source without a record stream: its documents, tokenized in memory
        documents = src.documents(args)
        progress = _Progress(len(documents))
        for d in documents:
            ids, labels = _encoded(d)
            progress.update(1, ids.size)
            yield d.source, ids, labels
        progress.close()
        return
    total, records = src.records(args)
    progress = _Progress(total)
    init = (kwargs.get("tokenizer", "byte"), args.chat_template, args.messages_key)
    if num_proc <= 1:
        _init_worker(*init)
        results: Iterable = map(_tokenize_chunk, _chunks(records, CHUNK))
        pool = None
    else:
        method = "fork" if sys.platform == "linux" and not torch.cuda.is_initialized() else "spawn"
        pool = multiprocessing.get_context(method).Pool(num_proc, initializer=_init_worker, initargs=init)
        results = pool.imap(_tokenize_chunk, _chunks(records, CHUNK))
    try:
        for chunk in results:
            progress.update(len(chunk), sum(ids.size for _, ids, _ in chunk))
            yield from chunk
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        progress.close()


# ---------------------------------------------------------------------------------------------------- build


def _pieces_of(ids_len: int, labels: np.ndarray, seq_len: int, overlong: str) -> tuple[list[tuple[int, int]], int]:
    """The ``(first token, length)`` pieces of one non-empty document under ``overlong`` that hold a supervised
    target, and the number of candidate pieces (the packer's rules)."""
    if ids_len <= seq_len:
        candidates = [(0, ids_len)]
    elif overlong == "split":
        candidates = [(s, min(seq_len, ids_len - s)) for s in range(0, ids_len, seq_len)]
    elif overlong == "truncate_left":
        candidates = [(ids_len - seq_len, seq_len)]
    else:  # drop
        candidates = []
    supervised = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])
    return [(s, n) for s, n in candidates if supervised[s + n] > supervised[s]], len(candidates)


@dataclass
class _Flat:
    """The tokenizing pass: every document's ids and labels back to back in ``ids_path`` / ``labels_path``
    (``int32``); per document (empty ones too, in source order) its first flat token, its length and its number of
    candidate pieces; the supervised pieces ``(document, first token, length)`` in document order."""

    ids_path: Path
    labels_path: Path
    doc_start: np.ndarray
    doc_len: np.ndarray
    candidates: np.ndarray
    pieces: np.ndarray

    def unlink(self) -> None:
        self.ids_path.unlink(missing_ok=True)
        self.labels_path.unlink(missing_ok=True)


def _tokenize_flat(source: Mapping[str, Any], seq_len: int, overlong: str, num_proc: int, out: Path) -> _Flat:
    """Tokenize ``source`` (streamed) into flat files in ``out``; raises on a document longer than a row under
    ``overlong=error`` (naming its index among all documents and where it is)."""
    flat = _Flat(out / "flat_ids.bin", out / "flat_labels.bin", *(np.zeros(0, np.int64),) * 4)
    doc_start, doc_len, candidates, pieces = array("q"), array("q"), array("q"), array("q")
    total = 0
    try:
        with open(flat.ids_path, "wb") as fids, open(flat.labels_path, "wb") as flabels:
            for where, ids, labels in _tokenized(source, num_proc):
                index = len(doc_len)
                doc_start.append(total)
                doc_len.append(ids.size)
                if ids.size == 0:
                    candidates.append(0)
                    continue
                if ids.size > seq_len and overlong == "error":
                    raise ValueError(
                        f"document {index} ({where}) has {ids.size} tokens, more than seq_len {seq_len}, and "
                        "data.overlong=error; raise seq_len or choose split, truncate_left or drop (documents are "
                        "never cut silently)")
                found, count = _pieces_of(ids.size, labels, seq_len, overlong)
                candidates.append(count)
                for start, n in found:
                    pieces.extend((index, start, n))
                fids.write(ids.tobytes())
                flabels.write(labels.tobytes())
                total += ids.size
    except BaseException:
        flat.unlink()
        raise
    flat.doc_start, flat.doc_len, flat.candidates = (np.frombuffer(a, dtype=np.int64).copy()
                                                     for a in (doc_start, doc_len, candidates))
    flat.pieces = np.frombuffer(pieces, dtype=np.int64).reshape(-1, 3).copy()
    return flat


def _write_rows(flat: _Flat, documents: np.ndarray | None, seq_len: int, multiple: int, overlong: str, pad_id: int,
                out: Path, meta: Mapping[str, Any]) -> PreparedRows:
    """Pack the documents ``documents`` of ``flat`` (sorted indices, None: all; a document's index in the rows is
    its rank among them, as when the in-memory packer is handed just these documents) and write the arrays and
    ``meta.json`` (``meta`` plus the stats, the row and the token count) into ``out``. Raises as the packer does
    on no document, only empty ones or nothing supervised."""
    out.mkdir(parents=True, exist_ok=True)
    total_docs = flat.doc_len.size
    documents = np.arange(total_docs) if documents is None else np.asarray(documents, dtype=np.int64)
    member = np.zeros(total_docs, dtype=bool)
    member[documents] = True
    rank = np.cumsum(member) - 1  # a selected document's index among the selected ones
    lengths = flat.doc_len[documents]
    num_docs, num_empty, num_long = documents.size, int((lengths == 0).sum()), int((lengths > seq_len).sum())
    num_tokens = int(lengths.sum())
    counts = {"split": 0, "truncate_left": 0, "drop": 0, overlong: num_long}
    pieces = flat.pieces[member[flat.pieces[:, 0]]] if flat.pieces.size else flat.pieces
    if num_docs == 0:
        raise ValueError("no documents to pack (empty dataset)")
    if num_docs == num_empty:
        raise ValueError(f"all {num_docs} documents are empty (0 tokens); nothing to pack")
    if not len(pieces):
        raise ValueError(
            f"no supervised token to train on: {num_docs - num_empty} documents of up to {seq_len} tokens "
            f"(data.overlong={overlong}: {num_long} longer than a row) hold no target with loss (e.g. chats without "
            "an assistant turn in reach)")
    aligned = (-(-pieces[:, 2] // multiple) * multiple).tolist()
    rows = first_fit_decreasing(aligned, seq_len)
    flat_ids = np.memmap(flat.ids_path, dtype=np.int32, mode="r", shape=(int(flat.doc_len.sum()),))
    flat_labels = np.memmap(flat.labels_path, dtype=np.int32, mode="r", shape=(int(flat.doc_len.sum()),))
    num_rows = len(rows)
    input_ids = np.lib.format.open_memmap(out / "input_ids.npy", mode="w+", dtype=np.int32, shape=(num_rows, seq_len))
    labels_out = np.lib.format.open_memmap(out / "labels.npy", mode="w+", dtype=np.int32, shape=(num_rows, seq_len))
    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    piece_table = np.zeros((len(pieces), 3), dtype=np.int64)
    supervised = rows_without_labels = real = 0
    k = 0
    piece_list, doc_start, rank = pieces.tolist(), flat.doc_start.tolist(), rank.tolist()
    for block in range(0, num_rows, ROW_BLOCK):
        hi = min(block + ROW_BLOCK, num_rows)
        ids_block = np.full((hi - block, seq_len), pad_id, dtype=np.int32)
        labels_block = np.full((hi - block, seq_len), IGNORE_INDEX, dtype=np.int32)
        for r in range(block, hi):
            offset = 0
            for p in rows[r]:
                doc, start, n = piece_list[p]
                begin = doc_start[doc] + start
                ids_block[r - block, offset:offset + n] = flat_ids[begin:begin + n]
                labels_block[r - block, offset:offset + n] = flat_labels[begin:begin + n]
                piece_table[k] = (rank[doc], start, n)
                k += 1
                real += n
                offset += aligned[p]
            row_ptr[r + 1] = k
        row_labels = (labels_block != IGNORE_INDEX).sum(axis=1)
        supervised += int(row_labels.sum())
        rows_without_labels += int((row_labels == 0).sum())
        input_ids[block:hi] = ids_block
        labels_out[block:hi] = labels_block
    input_ids.flush()
    labels_out.flush()
    del input_ids, labels_out, flat_ids, flat_labels
    np.save(out / "pieces.npy", piece_table)
    np.save(out / "row_ptr.npy", row_ptr)
    stats = PackStats(
        num_rows=num_rows, seq_len=seq_len, shard_multiple=multiple, num_documents=num_docs,
        num_empty_documents=num_empty, num_split_documents=counts["split"], num_pieces=len(pieces), real_tokens=real,
        alignment_padding=sum(aligned) - real, pack_padding=num_rows * seq_len - sum(aligned),
        supervised_tokens=supervised, overlong=overlong, num_truncated_documents=counts["truncate_left"],
        num_dropped_documents=counts["drop"],
        num_unsupervised_pieces=int(flat.candidates[documents].sum()) - len(pieces),
        unused_tokens=num_tokens - real, rows_without_labels=rows_without_labels)
    full = {**meta, "stats": asdict(stats), "num_rows": num_rows, "tokens": num_tokens}
    (out / "meta.json").write_text(json.dumps(full, indent=1))
    return PreparedRows(out)


def _build(source: Mapping[str, Any], seq_len: int, multiple: int, overlong: str, pad_id: int, num_proc: int,
           out: Path, fingerprint: Mapping[str, Any], val_split: tuple[float, int] | None) -> None:
    """Tokenize (streamed), pack and write into ``out`` (an empty directory): the rows, or with ``val_split``
    ``(fraction, seed)`` the training rows in ``out/train`` and the held-out rows in ``out/val`` (the documents of
    :func:`~dsv4.data.validation.held_out_indices`). ``out/meta.json`` is written last."""
    flat = _tokenize_flat(source, seq_len, overlong, num_proc, out)
    try:
        if val_split is None:
            _write_rows(flat, None, seq_len, multiple, overlong, pad_id, out, {"fingerprint": fingerprint})
            return
        held = np.asarray(held_out_indices(flat.doc_len.size, *val_split), dtype=np.int64)
        train = np.setdiff1d(np.arange(flat.doc_len.size), held)
        splits = {}
        for name, documents in ((TRAIN, train), (VAL, held)):
            rows = _write_rows(flat, documents, seq_len, multiple, overlong, pad_id, out / name,
                               {"fingerprint": fingerprint, "split": name})
            splits[name] = {"num_rows": len(rows), "num_documents": int(documents.size)}
    finally:
        flat.unlink()
    meta = {"fingerprint": fingerprint, "splits": splits, "tokens": int(flat.doc_len.sum())}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


# ----------------------------------------------------------------------------------------------------- lock


@contextlib.contextmanager
def _exclusive(lock_path: Path, target: Path, timeout_s: float) -> Iterator[None]:
    """Hold ``lock_path`` (a :class:`filelock.FileLock`); a process that finds it held logs once that it waits, and
    raises TimeoutError naming the lock and ``target`` after ``timeout_s`` seconds."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("data: waiting for another process to prepare %s (lock %s)", target, lock_path)
        try:
            lock.acquire(timeout=timeout_s, poll_interval=0.5)
        except Timeout:
            raise TimeoutError(
                f"data: waited {timeout_s:.0f} s for another process to prepare {target} (lock {lock_path} is still "
                "held); if no process is preparing it, delete the lock file") from None
    try:
        yield
    finally:
        lock.release()


def _complete(path: Path) -> bool:
    return (path / "meta.json").is_file()


def _describe(path: Path) -> str:
    """``N rows, T tokens`` (with a split: ``N training rows, M held-out rows, T tokens``) of a prepared directory."""
    meta = json.loads((path / "meta.json").read_text())
    if "splits" in meta:
        train, val = meta["splits"][TRAIN]["num_rows"], meta["splits"][VAL]["num_rows"]
        return f"{train} training rows, {val} held-out rows, {meta['tokens']} tokens"
    return f"{meta['num_rows']} rows, {meta['tokens']} tokens"


def _prepare(source: Mapping[str, Any], seq_len: int, shard_multiple: int, cache_dir: str | os.PathLike,
             cp_size: int, overlong: str, pad_id: int, num_proc: int, wait_timeout_s: float,
             val_split: tuple[float, int] | None) -> Path:
    """The complete prepared directory of the inputs: found, or built once under the lock (see the module
    docstring); logs which."""
    seq_len, multiple = _positive_int("seq_len", seq_len), _positive_int("shard_multiple", shard_multiple)
    check_cp_length(seq_len, cp_size, multiple)
    if overlong not in OVERLONG:
        raise ValueError(f"`data.overlong`={overlong!r} must be one of {', '.join(OVERLONG)}")
    if val_split is not None:
        val_split = (check_val_fraction(val_split[0]), int(val_split[1]))
    fingerprint = prepared_fingerprint(source, seq_len, multiple, overlong, pad_id, val_split)
    final = prepared_path(cache_dir, fingerprint)
    if not _complete(final):
        with _exclusive(final.with_name(final.name + ".lock"), final, wait_timeout_s):
            if not _complete(final):
                start = time.monotonic()
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
                try:
                    _build(source, seq_len, multiple, overlong, pad_id, num_proc, tmp, fingerprint, val_split)
                    if final.exists():  # an incomplete directory (not written by a prepare)
                        shutil.rmtree(final)
                    os.replace(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                log.info("data: prepared dataset %s (%s) in %.1f s", final, _describe(final),
                         time.monotonic() - start)
                return final
    log.info("data: reusing prepared dataset %s (%s)", final, _describe(final))
    return final


def prepare_dataset(
    source: Mapping[str, Any],
    seq_len: int,
    shard_multiple: int,
    cache_dir: str | os.PathLike,
    *,
    cp_size: int = 1,
    overlong: str = "split",
    pad_id: int = 0,
    num_proc: int = 1,
    wait_timeout_s: float = 6 * 3600.0,
) -> PreparedRows:
    """The prepared rows of ``source`` (keyword arguments of :func:`~dsv4.data.build_documents`): reused when
    ``cache_dir`` holds them, else built once (see the module docstring). Raises as the in-memory path does (bad
    data naming where, ``seq_len`` not a multiple of ``cp_size x shard_multiple``, nothing supervised)."""
    return PreparedRows(_prepare(source, seq_len, shard_multiple, cache_dir, cp_size, overlong, pad_id, num_proc,
                                 wait_timeout_s, None))


def prepare_split_dataset(
    source: Mapping[str, Any],
    seq_len: int,
    shard_multiple: int,
    cache_dir: str | os.PathLike,
    *,
    val_fraction: float,
    seed: int,
    cp_size: int = 1,
    overlong: str = "split",
    pad_id: int = 0,
    num_proc: int = 1,
    wait_timeout_s: float = 6 * 3600.0,
) -> tuple[PreparedRows, PreparedRows]:
    """``(training rows, held-out rows)`` of ``source`` split by ``data.val_fraction`` (the documents
    :func:`~dsv4.data.validation.held_out_indices` picks with ``seed``), prepared once like :func:`prepare_dataset`:
    each equals the in-memory packing of :func:`~dsv4.data.validation.split_documents`' part. Raises as the
    in-memory path does (a split without a held-out or a training document, names the counts)."""
    final = _prepare(source, seq_len, shard_multiple, cache_dir, cp_size, overlong, pad_id, num_proc, wait_timeout_s,
                     (val_fraction, seed))
    return PreparedRows(final / TRAIN), PreparedRows(final / VAL)

"""First-fit-decreasing packing of documents into rows of ``seq_len`` slots, documents on shard-multiple starts.

:class:`PackedRows` holds every row as one :class:`dsv4.batch.TokenBatch` (``N`` rows, ``S = seq_len``; int64):

* ``input_ids [N, S]``: the documents of each row in placement order, ``pad_id`` in every empty slot;
* ``labels [N, S]``: shifted inside each document, ``labels[i] = ids[i + 1]``; -100 on a document's last token, on
  every slot whose *target* token has ``loss_mask`` False, and on every padding slot;
* ``seq_ids [N, S]``: 1-based document id within the row, 0 on padding (pack and alignment padding);
* ``positions [N, S]``: document-local ``0..len-1``; 0 on padding.

Alignment is counted inside the fixed budget: a document takes ``ceil(len / multiple) * multiple`` slots and starts
on a multiple of ``multiple`` (the aligned layout of :mod:`dsv4.packing` places it). With ``S`` a multiple of
``cp x multiple`` (:func:`dsv4.config.check_cp_length`) every CP rank's contiguous slice starts on a window
boundary, so the training path never repads. ``seq_len % multiple != 0`` is a ValueError.

Placement (:func:`first_fit_decreasing`): pieces sorted by aligned length, longest first, ties by document order;
each goes into the first row (in creation order) with enough free slots, or opens a new row. Deterministic;
O(P log P) for P pieces (a max-segment tree finds the first row that fits).

Long documents (``len > S``), by ``overlong`` (:data:`OVERLONG`):

* ``split``: cut into chunks of ``S`` tokens (the last chunk shorter). Each chunk is a separate document for
  attention (positions restart at 0), but **the last label of a chunk is the first token of the next chunk** (the
  label the token has in the unsplit document), so no target is lost; a later chunk no longer sees the start of
  its document.
* ``truncate_left``: keep the last ``S`` tokens (a conversation keeps its final turns and the context right before
  them).
* ``drop``: leave the document out. ``error``: ValueError naming the document.

Nothing is cut silently: every count is in :class:`PackStats` (:meth:`PackStats.summary` is the line the recipe
logs). A piece (a document, a chunk, a kept tail) without a single supervised target is left out, so **no packed
row is without a label**; empty documents are skipped. Both are counted.
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from dsv4.batch import IGNORE_INDEX, TokenBatch
from dsv4.data.sources import Document
from dsv4.packing import build_layout, document_table


OVERLONG = ("split", "truncate_left", "drop", "error")
"""What the packer does with a document longer than a row (see the module docstring)."""


@dataclass(frozen=True)
class PackStats:
    """Token accounting of a packing; ``total_slots == real_tokens + alignment_padding + pack_padding``.

    ``num_split_documents`` / ``num_truncated_documents`` / ``num_dropped_documents``: longer than a row, handled
    by ``overlong``; ``num_unsupervised_pieces``: pieces without a supervised target, left out;
    ``unused_tokens``: tokens of the documents that are in no row (truncated, dropped, unsupervised);
    ``rows_without_labels``: packed rows without a label (0 by construction)."""

    num_rows: int
    seq_len: int
    shard_multiple: int
    num_documents: int
    num_empty_documents: int
    num_split_documents: int
    num_pieces: int
    real_tokens: int
    alignment_padding: int
    pack_padding: int
    supervised_tokens: int
    overlong: str = "split"
    num_truncated_documents: int = 0
    num_dropped_documents: int = 0
    num_unsupervised_pieces: int = 0
    unused_tokens: int = 0
    rows_without_labels: int = 0

    @property
    def total_slots(self) -> int:
        return self.num_rows * self.seq_len

    @property
    def padding_fraction(self) -> float:
        """(pack padding + alignment padding) / total slots."""
        return (self.pack_padding + self.alignment_padding) / max(self.total_slots, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "total_slots": self.total_slots, "padding_fraction": self.padding_fraction}

    def summary(self) -> str:
        """One line: documents, rows, what happened to long and unsupervised documents, padding."""
        long = {"split": f"{self.num_split_documents} split", "truncate_left":
                f"{self.num_truncated_documents} truncated to their last {self.seq_len} tokens",
                "drop": f"{self.num_dropped_documents} dropped", "error": "none"}[self.overlong]
        return (f"packing: {self.num_documents} documents -> {self.num_rows} rows of {self.seq_len} tokens; longer "
                f"than a row (data.overlong={self.overlong}): {long}; {self.num_unsupervised_pieces} pieces without "
                f"a supervised token left out; {self.num_empty_documents} empty documents; {self.unused_tokens} "
                f"tokens in no row; rows without labels: {self.rows_without_labels}; {self.supervised_tokens} "
                f"supervised tokens; padding {100 * self.padding_fraction:.1f}% (pack "
                f"{100 * self.pack_padding / max(self.total_slots, 1):.1f}%, alignment "
                f"{100 * self.alignment_padding / max(self.total_slots, 1):.1f}%)")


@dataclass
class PackedRows:
    """The packed rows: a map-style dataset whose item ``i`` is row ``i`` as a one-row batch. ``pieces[r]`` lists
    ``(document index, first token, length)`` of every piece in row ``r``, in row order (document id ``k + 1`` of
    the row is ``pieces[r][k]``)."""

    batch: TokenBatch
    pieces: list[list[tuple[int, int, int]]]
    stats: PackStats
    pad_id: int

    def __len__(self) -> int:
        return self.batch.num_rows

    def __getitem__(self, index: int) -> TokenBatch:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"PackedRows: row {index} is out of range for {n} rows")
        return self.batch.select(slice(index % n, index % n + 1))

    @property
    def seq_len(self) -> int:
        return self.batch.width


class _FirstFit:
    """Max-segment tree over row capacities: the leftmost row with at least ``need`` free slots in O(log n).

    All ``n`` leaves start at full capacity, so an unopened row is found only when no opened row (all of which lie
    to its left) fits: exactly first-fit.
    """

    def __init__(self, n: int, capacity: int) -> None:
        size = 1
        while size < max(n, 1):
            size *= 2
        self.size = size
        self.tree = [-1] * (2 * size)
        self.tree[size:size + n] = [capacity] * n
        for i in range(size - 1, 0, -1):
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def place(self, need: int) -> int:
        tree, i = self.tree, 1
        while i < self.size:
            i = 2 * i if tree[2 * i] >= need else 2 * i + 1
        tree[i] -= need
        leaf = i - self.size
        i //= 2
        while i:
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
            i //= 2
        return leaf


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of ``capacity``: longest first (ties by index), each into the first bin with
    room. An item larger than ``capacity`` gets a bin of its own. Bins in creation order, items in placement order."""
    order = sorted(range(len(sizes)), key=lambda p: (-sizes[p], p))
    oversize = [[p] for p in order if sizes[p] > capacity]
    fitting = [p for p in order if sizes[p] <= capacity]
    fit = _FirstFit(len(fitting), capacity)
    rows: list[list[int]] = []
    for p in fitting:
        r = fit.place(sizes[p])
        if r == len(rows):
            rows.append([])
        rows[r].append(p)
    return oversize + rows


def _as_document(doc: Document | Sequence[int], index: int) -> Document:
    return doc if isinstance(doc, Document) else Document(list(doc), None, f"document {index}")


def _flat_tokens(documents: list[Document]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenated ids, shifted labels (per document, loss mask applied) and document start offsets."""
    lengths = torch.tensor([len(d) for d in documents], dtype=torch.long)
    starts = lengths.cumsum(0) - lengths
    id_buffer, mask_buffer = array("q"), array("b")
    for d in documents:
        id_buffer.extend(d.ids.reshape(-1).tolist() if isinstance(d.ids, torch.Tensor) else d.ids)
        if d.loss_mask is None:
            mask_buffer.extend(array("b", [1]) * len(d))
        else:
            mask = d.loss_mask.reshape(-1).tolist() if isinstance(d.loss_mask, torch.Tensor) else d.loss_mask
            mask_buffer.extend(mask)
    ids = torch.frombuffer(id_buffer, dtype=torch.long).clone()
    target_ok = torch.frombuffer(mask_buffer, dtype=torch.int8).bool()
    last = torch.zeros(ids.numel(), dtype=torch.bool)
    last[starts + lengths - 1] = True
    labels = torch.full_like(ids, IGNORE_INDEX)
    if ids.numel() > 1:
        keep = ~last[:-1] & target_ok[1:]
        labels[:-1] = torch.where(keep, ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
    return ids, labels, starts


def _positive_int(name: str, value) -> int:
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def pack_documents(
    documents: Sequence[Document | Sequence[int]],
    seq_len: int,
    shard_multiple: int = 1,
    *,
    split_long: bool = True,
    pad_id: int = 0,
    overlong: str | None = None,
) -> PackedRows:
    """Pack ``documents`` into rows of ``seq_len`` slots by first-fit-decreasing (see the module docstring).

    ``documents`` are :class:`~dsv4.data.sources.Document` objects or plain id sequences. ``overlong`` (one of
    :data:`OVERLONG`; None: ``split`` with ``split_long``, else ``error``) handles documents longer than a row.
    Raises ValueError for an empty input, ``seq_len``/``shard_multiple`` that are not positive or ``seq_len %
    shard_multiple != 0``, a long document under ``error``, and an input with no supervised target left.
    """
    seq_len, multiple = _positive_int("seq_len", seq_len), _positive_int("shard_multiple", shard_multiple)
    if overlong is None:
        overlong = "split" if split_long else "error"
    if overlong not in OVERLONG:
        raise ValueError(f"`data.overlong`={overlong!r} must be one of {', '.join(OVERLONG)}")
    if seq_len % multiple:
        raise ValueError(
            f"seq_len {seq_len} is not a multiple of the shard multiple {multiple} (seq_len % shard_multiple = "
            f"{seq_len % multiple}); use e.g. seq_len {seq_len - seq_len % multiple + multiple}"
        )
    docs = [_as_document(d, i) for i, d in enumerate(documents)]
    if not docs:
        raise ValueError("no documents to pack (empty dataset)")
    kept = [i for i, d in enumerate(docs) if len(d) > 0]
    if not kept:
        raise ValueError(f"all {len(docs)} documents are empty (0 tokens); nothing to pack")
    if overlong == "error":
        for i in kept:
            if len(docs[i]) > seq_len:
                raise ValueError(
                    f"document {i} ({docs[i].source}) has {len(docs[i])} tokens, more than seq_len {seq_len}, and "
                    "data.overlong=error; raise seq_len or choose split, truncate_left or drop (documents are never "
                    "cut silently)"
                )
    ids_flat, labels_flat, doc_starts = _flat_tokens([docs[i] for i in kept])
    supervised_before = torch.cat([torch.zeros(1, dtype=torch.long), (labels_flat != IGNORE_INDEX).long().cumsum(0)])

    # pieces: (kept position, first token, length); what overlong keeps of a long document
    candidates: list[tuple[int, int, int]] = []
    counts = {"split": 0, "truncate_left": 0, "drop": 0}
    for pos, i in enumerate(kept):
        n = len(docs[i])
        if n <= seq_len:
            candidates.append((pos, 0, n))
            continue
        counts[overlong] += 1
        if overlong == "split":
            candidates.extend((pos, start, min(seq_len, n - start)) for start in range(0, n, seq_len))
        elif overlong == "truncate_left":
            candidates.append((pos, n - seq_len, seq_len))
    pieces = []
    for piece in candidates:
        begin = int(doc_starts[piece[0]]) + piece[1]
        if supervised_before[begin + piece[2]] > supervised_before[begin]:
            pieces.append(piece)
    if not pieces:
        raise ValueError(
            f"no supervised token to train on: {len(kept)} documents of up to {seq_len} tokens (data.overlong="
            f"{overlong}: {counts.get(overlong, 0)} longer than a row) hold no target with loss (e.g. chats without "
            "an assistant turn in reach)"
        )
    split_count = counts["split"]
    aligned = [-(-length // multiple) * multiple for _, _, length in pieces]
    rows = first_fit_decreasing(aligned, seq_len)

    # caller rows: each row's pieces back to back; the aligned layout then moves them onto multiples
    num_rows, d_max = len(rows), max(len(r) for r in rows)
    lengths = torch.zeros(num_rows, d_max, dtype=torch.long)
    src, dest, piece_len = [], [], []
    for r, members in enumerate(rows):
        offset = 0
        for k, p in enumerate(members):
            pos, start, n = pieces[p]
            lengths[r, k] = n
            src.append(int(doc_starts[pos]) + start)
            dest.append(r * seq_len + offset)
            piece_len.append(n)
            offset += n
    piece_len_t = torch.tensor(piece_len, dtype=torch.long)
    within = torch.arange(int(piece_len_t.sum())) - torch.repeat_interleave(piece_len_t.cumsum(0) - piece_len_t,
                                                                              piece_len_t)
    src_idx = torch.repeat_interleave(torch.tensor(src, dtype=torch.long), piece_len_t) + within
    dest_idx = torch.repeat_interleave(torch.tensor(dest, dtype=torch.long), piece_len_t) + within
    caller_ids = torch.full((num_rows * seq_len,), int(pad_id), dtype=torch.long)
    caller_labels = torch.full((num_rows * seq_len,), IGNORE_INDEX, dtype=torch.long)
    caller_ids[dest_idx] = ids_flat[src_idx]
    caller_labels[dest_idx] = labels_flat[src_idx]
    layout = build_layout(document_table(lengths, lengths, multiple), seq_len, seq_len)
    input_ids = layout.pack(caller_ids.view(num_rows, seq_len), fill=int(pad_id))
    labels = layout.pack(caller_labels.view(num_rows, seq_len), fill=IGNORE_INDEX)

    real = int(piece_len_t.sum())
    align_pad = sum(aligned) - real
    stats = PackStats(
        num_rows=num_rows,
        seq_len=seq_len,
        shard_multiple=multiple,
        num_documents=len(docs),
        num_empty_documents=len(docs) - len(kept),
        num_split_documents=split_count,
        num_pieces=len(pieces),
        real_tokens=real,
        alignment_padding=align_pad,
        pack_padding=num_rows * seq_len - real - align_pad,
        supervised_tokens=int((labels != IGNORE_INDEX).sum()),
        overlong=overlong,
        num_truncated_documents=counts["truncate_left"],
        num_dropped_documents=counts["drop"],
        num_unsupervised_pieces=len(candidates) - len(pieces),
        unused_tokens=int(ids_flat.numel()) - real,
        rows_without_labels=int(((labels != IGNORE_INDEX).sum(dim=1) == 0).sum()),
    )
    return PackedRows(
        batch=TokenBatch(input_ids, labels, layout.sequence_ids, layout.position_ids),
        pieces=[[(kept[pieces[p][0]], pieces[p][1], pieces[p][2]) for p in members] for members in rows],
        stats=stats,
        pad_id=int(pad_id),
    )

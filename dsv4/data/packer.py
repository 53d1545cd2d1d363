"""First-fit-decreasing packing of documents into fixed rows of ``seq_len`` tokens, with alignment inside the budget.

Shapes (``N`` rows, ``S = seq_len``, ``D`` = the most documents in one row; all int64):

* ``input_ids [N, S]``: documents back to back, ``pad_id`` in every empty slot.
* ``labels [N, S]``: shifted inside each document, ``labels[i] = ids[i + 1]``; -100 on a document's last token, on
  every slot whose *target* token has ``loss_mask`` False, and on every padding slot.
* ``position_ids [N, S]``: document-local ``0..len-1``; 0 on every padding slot.
* ``seq_lens [N, D]``: real length of each document of the row, in row order, -1000 right-padded.
* ``seq_lens_padded [N, D]``: the aligned stride of each document, ``ceil(len / alignment) * alignment``,
  -1000 right-padded. The row's trailing pack padding is **not** folded into the last entry (unlike the seed
  collator): ``sum(seq_lens_padded[r]) <= S`` and the slots after it are pack padding that belongs to no document
  (``build_packed_seq_ids`` gives them id 0). Document k of a row starts at ``sum(seq_lens_padded[r, :k])``, a
  multiple of ``alignment``.

Alignment is counted inside the fixed budget: a document takes ``ceil(len / alignment) * alignment`` slots, so the
CP repad (which pads every document to a multiple of ``pad_multiple``) never grows a row when ``pad_multiple``
divides ``alignment``; with ``S`` a multiple of ``cp_size * alignment`` the CP-sharded rows keep ``S`` columns at
most. ``seq_len % alignment != 0`` is a ValueError. (Under CP the sharder uses ``max(pad_multiple, 2)``, so pack
with ``alignment >= 2`` there.)

Placement (first-fit-decreasing): pieces are sorted by aligned length, longest first, ties by document order; each
goes into the first row (in creation order) with enough free slots, or opens a new row. Rows are emitted in creation
order, documents inside a row in placement order. Deterministic; O(P log P) for P pieces (a max-segment tree finds
the first row that fits).

Long documents (``len > S``): with ``split_long`` (default) a document is cut into chunks of ``S`` tokens (the last
chunk shorter), so chunk starts are multiples of ``S`` and hence of ``alignment``. Each chunk is a separate document
for attention (positions restart at 0), but **the last label of a chunk is the first token of the next chunk** (the
label the token has in the unsplit document), so no target is lost: the labelled-token count of a split document
equals that of the unsplit one. Only the final chunk's last token has label -100. Without ``split_long`` a long
document is a ValueError naming it; nothing is ever cut silently. Empty documents are skipped (counted in the stats).
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from dsv4.data.sources import Document

__all__ = ["IGNORE_INDEX", "SEQ_LENS_PAD", "PackStats", "PackedRows", "pack_documents"]

IGNORE_INDEX = -100
SEQ_LENS_PAD = -1000


@dataclass(frozen=True)
class PackStats:
    """Token accounting of a packing; ``total_slots == real_tokens + alignment_padding + pack_padding``."""

    num_rows: int
    seq_len: int
    alignment: int
    num_documents: int
    num_empty_documents: int
    num_split_documents: int
    num_pieces: int
    real_tokens: int
    alignment_padding: int
    pack_padding: int
    supervised_tokens: int

    @property
    def total_slots(self) -> int:
        return self.num_rows * self.seq_len

    @property
    def padding_fraction(self) -> float:
        """(pack padding + alignment padding) / total slots."""
        return (self.pack_padding + self.alignment_padding) / max(self.total_slots, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "total_slots": self.total_slots, "padding_fraction": self.padding_fraction}


@dataclass
class PackedRows:
    """The packed rows (see the module docstring for shapes). ``pieces[r]`` lists ``(document index, first token,
    length)`` of every piece in row ``r``, in row order; ``num_docs[r]`` is its length."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_padded: torch.Tensor
    num_docs: torch.Tensor
    pieces: list[list[tuple[int, int, int]]]
    stats: PackStats
    pad_id: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index`` as a dict of 1-D tensors; ``seq_lens``/``seq_lens_padded`` trimmed to its documents."""
        d = int(self.num_docs[index])
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "position_ids": self.position_ids[index],
            "seq_lens": self.seq_lens[index, :d],
            "seq_lens_padded": self.seq_lens_padded[index, :d],
        }


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
    alignment: int = 1,
    *,
    split_long: bool = True,
    pad_id: int = 0,
) -> PackedRows:
    """Pack ``documents`` into rows of ``seq_len`` slots by first-fit-decreasing (see the module docstring).

    ``documents`` are :class:`~dsv4.data.sources.Document` objects or plain id sequences. Raises ValueError for an
    empty input, ``seq_len``/``alignment`` that are not positive or ``seq_len % alignment != 0``, and (without
    ``split_long``) a document longer than ``seq_len``.
    """
    seq_len, alignment = _positive_int("seq_len", seq_len), _positive_int("alignment", alignment)
    if seq_len % alignment:
        raise ValueError(
            f"seq_len {seq_len} is not a multiple of the alignment {alignment} (seq_len % alignment = "
            f"{seq_len % alignment}); use e.g. seq_len {seq_len - seq_len % alignment + alignment}"
        )
    docs = [_as_document(d, i) for i, d in enumerate(documents)]
    if not docs:
        raise ValueError("no documents to pack (empty dataset)")
    kept = [i for i, d in enumerate(docs) if len(d) > 0]
    if not kept:
        raise ValueError(f"all {len(docs)} documents are empty (0 tokens); nothing to pack")
    if not split_long:
        for i in kept:
            if len(docs[i]) > seq_len:
                raise ValueError(
                    f"document {i} ({docs[i].source}) has {len(docs[i])} tokens, more than seq_len {seq_len}, and "
                    "split_long=False; raise seq_len or allow splitting (documents are never cut silently)"
                )

    # pieces: (kept position, first token, length); chunks of seq_len tokens for long documents
    pieces: list[tuple[int, int, int]] = []
    split_count = 0
    for pos, i in enumerate(kept):
        n = len(docs[i])
        split_count += n > seq_len
        pieces.extend((pos, start, min(seq_len, n - start)) for start in range(0, n, seq_len))
    aligned = [-(-length // alignment) * alignment for _, _, length in pieces]
    order = sorted(range(len(pieces)), key=lambda p: (-aligned[p], p))
    fit = _FirstFit(len(pieces), seq_len)
    rows: list[list[int]] = []
    for p in order:
        r = fit.place(aligned[p])
        if r == len(rows):
            rows.append([])
        rows[r].append(p)

    kept_docs = [docs[i] for i in kept]
    ids_flat, labels_flat, doc_starts_t = _flat_tokens(kept_docs)
    doc_starts = doc_starts_t.tolist()
    num_rows, d_max = len(rows), max(len(r) for r in rows)
    lens_table = [[SEQ_LENS_PAD] * d_max for _ in rows]
    padded_table = [[SEQ_LENS_PAD] * d_max for _ in rows]
    dest, src, length = [], [], []
    row_pieces: list[list[tuple[int, int, int]]] = []
    for r, members in enumerate(rows):
        offset = 0
        row_pieces.append([])
        for k, p in enumerate(members):
            pos, start, n = pieces[p]
            dest.append(r * seq_len + offset)
            src.append(doc_starts[pos] + start)
            length.append(n)
            lens_table[r][k] = n
            padded_table[r][k] = aligned[p]
            row_pieces[-1].append((kept[pos], start, n))
            offset += aligned[p]
    seq_lens = torch.tensor(lens_table, dtype=torch.long)
    seq_lens_padded = torch.tensor(padded_table, dtype=torch.long)

    length_t = torch.tensor(length, dtype=torch.long)
    piece_of = torch.repeat_interleave(torch.arange(len(length)), length_t)
    within = torch.arange(int(length_t.sum())) - torch.repeat_interleave(length_t.cumsum(0) - length_t, length_t)
    dest_idx = torch.tensor(dest, dtype=torch.long)[piece_of] + within
    src_idx = torch.tensor(src, dtype=torch.long)[piece_of] + within
    input_ids = torch.full((num_rows * seq_len,), int(pad_id), dtype=torch.long)
    labels = torch.full((num_rows * seq_len,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(num_rows * seq_len, dtype=torch.long)
    input_ids[dest_idx] = ids_flat[src_idx]
    labels[dest_idx] = labels_flat[src_idx]
    position_ids[dest_idx] = within

    real = int(length_t.sum())
    align_pad = sum(aligned) - real
    stats = PackStats(
        num_rows=num_rows,
        seq_len=seq_len,
        alignment=alignment,
        num_documents=len(docs),
        num_empty_documents=len(docs) - len(kept),
        num_split_documents=split_count,
        num_pieces=len(pieces),
        real_tokens=real,
        alignment_padding=align_pad,
        pack_padding=num_rows * seq_len - real - align_pad,
        supervised_tokens=int((labels != IGNORE_INDEX).sum()),
    )
    return PackedRows(
        input_ids=input_ids.view(num_rows, seq_len),
        labels=labels.view(num_rows, seq_len),
        position_ids=position_ids.view(num_rows, seq_len),
        seq_lens=seq_lens,
        seq_lens_padded=seq_lens_padded,
        num_docs=torch.tensor([len(r) for r in rows], dtype=torch.long),
        pieces=row_pieces,
        stats=stats,
        pad_id=int(pad_id),
    )

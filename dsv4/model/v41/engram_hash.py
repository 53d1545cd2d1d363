"""Engram n-gram hashing of DeepSeek-V4.1: token ids -> the table rows each position reads.

For a position ``p`` and an n-gram size ``n`` in ``2 .. max_ngram_size`` (``max_ngram_size`` = N), the n-gram is
the classes (:mod:`dsv4.model.v41.engram_vocab`) of the tokens ``p, p-1, .., p-n+1``. With ``c_j`` the class of
token ``p - j`` and ``m_j`` the layer's odd multipliers::

    h_n = (c_0 * m_0) ^ (c_1 * m_1) ^ ... ^ (c_{n-1} * m_{n-1})          (int64, never overflows)
    row(n, head) = h_n % prime(n, head) + offset(n, head)                head in 0 .. n_heads - 1

Buckets are ordered n-gram size major, head minor: ``bucket = (n - 2) * n_heads + head``, ``n_buckets = (N - 1) *
n_heads``. Each bucket has its own prime; the primes are the consecutive primes ``>= engram_vocab_size``, the
first ``n_buckets`` for the first Engram layer, the next ``n_buckets`` for the second, and so on (no prime is used
twice in a model). A layer's table holds the buckets back to back: ``offset`` is the sum of the earlier buckets'
primes, and the sum of all its primes must equal the layer's ``engram_num_embeddings`` entry (Flash: 384006168 and
384016682). The multipliers are ``2 * r + 1`` with ``r = np.random.default_rng(10007 * layer_id).integers(0,
bound, size=N, dtype=np.int64)``, ``bound = max(1, (2**63 - 1) // class_count // 2)`` (``layer_id`` the decoder
layer index, e.g. 1 and 14; ``class_count`` = ``engram_compressed_vocab_size``).

History stops at the sequence start, at padding and image tokens and at document boundaries: token ``p - j`` is
*blocked* when it, or any token between it and ``p``, is padding / an image token / of another document than ``p``
(or lies before the sequence start); then ``c_j`` is the class of ``engram_pad_token_id`` for that ``j`` and every
larger ``j`` (once a shorter n-gram is blocked, the longer ones are too). A padding or image position ``p`` itself
is *inactive*: all its ``c_j`` are the pad class, and the Engram gate there is exactly 0.

Context parallelism: a rank that holds a slice of a row passes :class:`EngramHistory`, the ``N - 1`` token ids
before its first position with their document ids, instead of the whole row; its ids equal the whole row's. The
history travels as a halo of token ids: the chunk before writes :func:`engram_history_tail` (its last ``N - 1`` ids,
each shifted by one and 0 where that token cannot be history of the next chunk's first token: padding or another
document than its last token), the CP halo exchange moves it to the chunk that continues the
document (zeros to every other chunk), and :func:`engram_history_from_tail` reads it back with the receiving chunk's
own first document id. No document ids travel: a chunk receives only when its first token continues the document
its predecessor ends with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dsv4.model.v41.engram_vocab import EngramClassMap

__all__ = [
    "EngramHashSpec", "EngramHashing", "EngramHistory", "EngramWindows", "engram_hash", "engram_hash_specs",
    "engram_hash_specs_for", "engram_history_from_tail", "engram_history_tail", "engram_ngram_ids", "engram_windows",
]

SEQ_LENS_ABSENT = (0, -1000)
"""``seq_lens`` entries that mark an absent document (``dsv4.packing.SEQ_LENS_PAD`` is -1000)."""


@dataclass(frozen=True)
class EngramHashSpec:
    """The hash of one Engram layer: its decoder ``layer_id``, ``primes`` (one per bucket, order in the module
    docstring), ``multipliers`` (``max_ngram_size`` odd ints) and ``pad_class`` (class written for blocked
    history)."""

    layer_id: int
    max_ngram_size: int
    n_heads: int
    primes: tuple[int, ...]
    multipliers: tuple[int, ...]
    pad_class: int

    @property
    def n_buckets(self) -> int:
        """Rows read per position: ``(max_ngram_size - 1) * n_heads``."""
        return len(self.primes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First table row of each bucket."""
        return tuple(int(v) for v in np.cumsum((0,) + self.primes[:-1]))

    @property
    def rows(self) -> int:
        """Table rows the layer needs: the sum of its primes."""
        return int(sum(self.primes))


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def _primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes ``>= start``."""
    found: list[int] = []
    value = start
    while len(found) < count:
        if _is_prime(value):
            found.append(value)
        value += 1
    return found


def _multipliers(layer_id: int, max_ngram_size: int, class_count: int) -> tuple[int, ...]:
    bound = max(1, np.iinfo(np.int64).max // class_count // 2)
    draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in draws)


def engram_hash_specs(*, layer_ids: Sequence[int], num_embeddings: Sequence[int], max_ngram_size: int, n_heads: int,
                      vocab_size: int, class_count: int, pad_class: int) -> tuple[EngramHashSpec, ...]:
    """One :class:`EngramHashSpec` per Engram layer (in ``layer_ids`` order; ``vocab_size`` is
    ``engram_vocab_size``, the lower bound of the primes). Raises ValueError, naming both numbers, when a layer's
    primes do not sum to its ``num_embeddings`` entry."""
    layer_ids, num_embeddings = [int(i) for i in layer_ids], [int(r) for r in num_embeddings]
    if len(layer_ids) != len(num_embeddings):
        raise ValueError(f"Engram: engram_layer_ids has {len(layer_ids)} entries but engram_num_embeddings has "
                         f"{len(num_embeddings)}; one table per Engram layer")
    if max_ngram_size < 2 or n_heads < 1 or vocab_size < 2 or class_count < 1:
        raise ValueError(f"Engram: needs engram_max_ngram_size >= 2 (got {max_ngram_size}), engram_n_heads >= 1 "
                         f"(got {n_heads}), engram_vocab_size >= 2 (got {vocab_size}), a class count >= 1 (got "
                         f"{class_count})")
    if not 0 <= pad_class < class_count:
        raise ValueError(f"Engram: pad class {pad_class} is outside [0, {class_count})")
    n_buckets = (max_ngram_size - 1) * n_heads
    primes = _primes_from(vocab_size, n_buckets * len(layer_ids))
    specs = []
    for k, (layer_id, rows) in enumerate(zip(layer_ids, num_embeddings)):
        spec = EngramHashSpec(layer_id, max_ngram_size, n_heads, tuple(primes[k * n_buckets:(k + 1) * n_buckets]),
                              _multipliers(layer_id, max_ngram_size, class_count), pad_class)
        if spec.rows != rows:
            raise ValueError(f"Engram layer {layer_id}: its {n_buckets} hash buckets need {spec.rows} table rows but "
                             f"engram_num_embeddings gives {rows}")
        specs.append(spec)
    return tuple(specs)


def engram_hash_specs_for(config: Any, class_map: EngramClassMap) -> tuple[EngramHashSpec, ...]:
    """:func:`engram_hash_specs` from a V4.1 config (its ``engram_*`` fields) and the tokenizer's class map, whose
    count must equal ``engram_compressed_vocab_size`` (ValueError naming both)."""
    if class_map.count != config.engram_compressed_vocab_size:
        raise ValueError(f"Engram: the tokenizer's class map has {class_map.count} classes but "
                         f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}")
    return engram_hash_specs(layer_ids=config.engram_layer_ids, num_embeddings=config.engram_num_embeddings,
                             max_ngram_size=config.engram_max_ngram_size, n_heads=config.engram_n_heads,
                             vocab_size=config.engram_vocab_size, class_count=class_map.count,
                             pad_class=class_map.class_of(config.engram_pad_token_id))


@dataclass(frozen=True)
class EngramHistory:
    """The tokens just before a row slice: ``input_ids [B, H]`` and their ``doc_ids [B, H]`` (in the numbering of
    the slice's ``packed_seq_ids``; 1 for text when the row is not packed; 0 for padding, image tokens and
    positions before the row start). Only the last ``max_ngram_size - 1`` columns are read; a shorter history
    counts as starting the row."""

    input_ids: torch.Tensor
    doc_ids: torch.Tensor


def engram_history_tail(input_ids: torch.Tensor, packed_seq_ids: torch.Tensor | None, padding_mask: torch.Tensor | None,
                        reach: int) -> torch.Tensor:
    """``[B, reach]`` int32: what a chunk ``[B, L]`` (``L >= reach``) sends as the Engram history of the chunk after
    it (see the module docstring): its last ``reach`` token ids plus one, 0 where the token is padding or belongs
    to another document than the chunk's last token (blocked history; the hash blocks every token before a blocked
    one too). Ids must fit in int32 (any tokenizer's vocabulary does)."""
    rows, length = input_ids.shape
    if not 0 <= reach <= length:
        raise ValueError(f"Engram: a history of {reach} tokens from a chunk of {length}")
    ids = input_ids[:, length - reach:].long()
    docs = (torch.ones_like(ids) if packed_seq_ids is None else packed_seq_ids[:, length - reach:].long())
    if padding_mask is not None:
        docs = docs.masked_fill(padding_mask[:, length - reach:].bool(), 0)
    usable = (docs > 0) & (docs == docs[:, -1:])  # the hash blocks every token before a blocked one
    return torch.where(usable, ids + 1, torch.zeros_like(ids)).to(torch.int32)


def engram_history_from_tail(tail: torch.Tensor, packed_seq_ids: torch.Tensor | None) -> EngramHistory:
    """The :class:`EngramHistory` of chunks ``[B, L]`` (document ids ``packed_seq_ids``, None = one document) that
    received ``tail [B, reach]`` (:func:`engram_history_tail` of the chunk each continues, zeros where none): a
    non-zero entry is a token of the document the chunk's first token continues."""
    first = (torch.ones_like(tail[:, :1], dtype=torch.int64) if packed_seq_ids is None
             else packed_seq_ids[:, :1].long())
    tail = tail.long()
    return EngramHistory((tail - 1).clamp_min(0), torch.where(tail > 0, first, torch.zeros_like(tail)))


@dataclass(frozen=True)
class EngramWindows:
    """``classes [B, L, N]`` int64: ``classes[b, p, j]`` = class of token ``p - j``, or the pad class where
    blocked; ``active [B, L]`` bool: False on padding and image tokens (their gate is 0)."""

    classes: torch.Tensor
    active: torch.Tensor


def _bool_mask(mask: torch.Tensor | None, shape: tuple[int, ...], name: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype != torch.bool or tuple(mask.shape) != shape:
        raise ValueError(f"Engram: {name} must be a bool tensor of shape {list(shape)}, got {mask.dtype} "
                         f"{list(mask.shape)}")
    return mask


def _doc_ids_from_seq_lens(seq_lens: torch.Tensor, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Document id (1-based column of ``seq_lens``, 0 after the last document) of each position of rows holding
    their documents back to back."""
    lengths = seq_lens.unsqueeze(0) if seq_lens.dim() == 1 else seq_lens
    if lengths.dim() != 2 or lengths.shape[0] != shape[0] or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"Engram: seq_lens must be an int tensor [B={shape[0]}, D] (or [D] for B = 1), got "
                         f"{lengths.dtype} {list(seq_lens.shape)}")
    lengths = lengths.to(device=device, dtype=torch.int64)
    absent = (lengths == SEQ_LENS_ABSENT[0]) | (lengths == SEQ_LENS_ABSENT[1])
    if bool(((lengths < 0) & ~absent).any()):
        raise ValueError(f"Engram: seq_lens holds a negative document length: {lengths.tolist()}")
    ends = lengths.masked_fill(absent, 0).cumsum(1)
    if bool((ends[:, -1] > shape[1]).any()) if ends.shape[1] else False:
        raise ValueError(f"Engram: seq_lens sum to {ends[:, -1].tolist()} tokens but the rows hold {shape[1]}")
    positions = torch.arange(shape[1], device=device).expand(shape[0], -1).contiguous()
    column = torch.searchsorted(ends, positions, right=True)
    return torch.where(column < ends.shape[1], column + 1, torch.zeros_like(column))


def engram_windows(input_ids: torch.Tensor, class_map: EngramClassMap | torch.Tensor, *, max_ngram_size: int,
                   pad_class: int, packed_seq_ids: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                   padding_mask: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                   history: EngramHistory | None = None) -> EngramWindows:
    """The blocked class windows of every position (shared by all Engram layers of a forward).

    ``input_ids [B, L]`` token ids; documents from ``packed_seq_ids [B, L]`` (1-based, 0 = padding) or ``seq_lens``
    (``[B, D]`` lengths of documents held back to back from column 0; absent documents 0 or -1000; columns after
    the last document are padding), else one document per row; ``padding_mask`` (True = pad) and ``image_mask``
    (True = image token) block too. ``history`` (see :class:`EngramHistory`) replaces the row start; it needs
    ``packed_seq_ids`` when the row is packed (``seq_lens`` numbers documents from the slice's own start).
    """
    classes = class_map.classes if isinstance(class_map, EngramClassMap) else class_map
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"Engram: input_ids must be an int tensor [B, L], got {input_ids.dtype} "
                         f"{list(input_ids.shape)}")
    shape = tuple(input_ids.shape)
    device = input_ids.device
    if packed_seq_ids is not None and seq_lens is not None:
        raise ValueError("Engram: pass packed_seq_ids or seq_lens, not both")
    if history is not None and seq_lens is not None:
        raise ValueError("Engram: a history needs packed_seq_ids (document ids shared with the history), not seq_lens")
    classes = classes.to(device)
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= classes.numel()):
        raise ValueError(f"Engram: input_ids hold ids in [{int(input_ids.min())}, {int(input_ids.max())}] but the "
                         f"class map covers [0, {classes.numel()})")
    if packed_seq_ids is not None:
        if tuple(packed_seq_ids.shape) != shape or packed_seq_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Engram: packed_seq_ids must be an int tensor of shape {list(shape)}, got "
                             f"{packed_seq_ids.dtype} {list(packed_seq_ids.shape)}")
        docs = packed_seq_ids.to(torch.int64)
    elif seq_lens is not None:
        docs = _doc_ids_from_seq_lens(seq_lens, shape, device)
    else:
        docs = torch.ones(shape, dtype=torch.int64, device=device)
    for mask in (_bool_mask(padding_mask, shape, "padding_mask"), _bool_mask(image_mask, shape, "image_mask")):
        if mask is not None:
            docs = docs.masked_fill(mask, 0)
    token_classes = classes[input_ids.long()]

    reach = max_ngram_size - 1
    before_cls = torch.full((shape[0], reach), pad_class, dtype=torch.int64, device=device)
    before_doc = torch.zeros((shape[0], reach), dtype=torch.int64, device=device)
    if history is not None:
        h_ids, h_docs = history.input_ids, history.doc_ids
        if h_ids.dim() != 2 or h_ids.shape[0] != shape[0] or tuple(h_docs.shape) != tuple(h_ids.shape):
            raise ValueError(f"Engram: history input_ids and doc_ids must both be [B={shape[0]}, H], got "
                             f"{list(h_ids.shape)} and {list(h_docs.shape)}")
        if h_ids.numel() and (int(h_ids.min()) < 0 or int(h_ids.max()) >= classes.numel()):
            raise ValueError(f"Engram: history input_ids hold ids outside the class map [0, {classes.numel()})")
        take = min(reach, h_ids.shape[1])
        if take:
            before_cls[:, reach - take:] = classes[h_ids[:, -take:].to(device).long()]
            before_doc[:, reach - take:] = h_docs[:, -take:].to(device=device, dtype=torch.int64)
    ext_cls = torch.cat([before_cls, token_classes], dim=1)
    ext_doc = torch.cat([before_doc, docs], dim=1)

    blocked = docs == 0
    columns = [torch.where(blocked, pad_class, token_classes)]
    for j in range(1, max_ngram_size):
        blocked = blocked | (ext_doc[:, reach - j:reach - j + shape[1]] != docs)
        columns.append(torch.where(blocked, pad_class, ext_cls[:, reach - j:reach - j + shape[1]]))
    return EngramWindows(torch.stack(columns, dim=-1), docs != 0)


def engram_hash(windows: EngramWindows, spec: EngramHashSpec) -> torch.Tensor:
    """``ngram_ids [B, L, n_buckets]`` int64: the table rows of one layer (formula in the module docstring)."""
    if windows.classes.shape[-1] != spec.max_ngram_size:
        raise ValueError(f"Engram: windows of {windows.classes.shape[-1]} tokens for a spec of max_ngram_size "
                         f"{spec.max_ngram_size}")
    device = windows.classes.device
    products = windows.classes * torch.tensor(spec.multipliers, dtype=torch.int64, device=device)
    primes = torch.tensor(spec.primes, dtype=torch.int64, device=device).view(spec.max_ngram_size - 1, spec.n_heads)
    rolling = products[..., 0]
    per_size = []
    for n in range(2, spec.max_ngram_size + 1):
        rolling = torch.bitwise_xor(rolling, products[..., n - 1])
        per_size.append(rolling.unsqueeze(-1) % primes[n - 2])
    return torch.cat(per_size, dim=-1) + torch.tensor(spec.offsets, dtype=torch.int64, device=device)


def engram_ngram_ids(input_ids: torch.Tensor, class_map: EngramClassMap | torch.Tensor, spec: EngramHashSpec,
                     **blocking: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ngram_ids [B, L, n_buckets] int64, active [B, L] bool)`` of one layer; ``blocking`` is the keyword
    arguments of :func:`engram_windows` (``packed_seq_ids``, ``seq_lens``, ``padding_mask``, ``image_mask``,
    ``history``)."""
    windows = engram_windows(input_ids, class_map, max_ngram_size=spec.max_ngram_size, pad_class=spec.pad_class,
                             **blocking)
    return engram_hash(windows, spec), windows.active


@dataclass(frozen=True)
class EngramHashing:
    """Everything a forward needs to hash: the tokenizer's class map and one spec per Engram layer.
    ``EngramHashing.build(config, tokenizer)`` refuses a class count other than ``engram_compressed_vocab_size``
    and table rows other than the primes' sums (ValueError naming both numbers)."""

    class_map: EngramClassMap
    specs: tuple[EngramHashSpec, ...]

    @classmethod
    def build(cls, config: Any, tokenizer: Any) -> "EngramHashing":
        from dsv4.model.v41.engram_vocab import engram_class_map_for

        class_map = engram_class_map_for(tokenizer, config)
        return cls(class_map, engram_hash_specs_for(config, class_map))

    def to(self, device: torch.device | str) -> "EngramHashing":
        """The same hashing with the class map on ``device`` (keep one per device: a forward then moves nothing)."""
        class_map = self.class_map.to(device)
        return self if class_map is self.class_map else EngramHashing(class_map, self.specs)

    def spec(self, layer_id: int) -> EngramHashSpec:
        """The spec of decoder layer ``layer_id``."""
        for spec in self.specs:
            if spec.layer_id == layer_id:
                return spec
        raise KeyError(f"Engram: layer {layer_id} is not an Engram layer ({[s.layer_id for s in self.specs]})")

    def __call__(self, input_ids: torch.Tensor, **blocking: Any) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """``({layer_id: ngram_ids [B, L, n_buckets]}, active [B, L])`` for every Engram layer; ``blocking`` as in
        :func:`engram_windows`. The windows are built once and hashed per layer."""
        if not self.specs:
            raise ValueError("Engram: the config has no engram_layer_ids")
        first = self.specs[0]
        windows = engram_windows(input_ids, self.class_map, max_ngram_size=first.max_ngram_size,
                                 pad_class=first.pad_class, **blocking)
        return {spec.layer_id: engram_hash(windows, spec) for spec in self.specs}, windows.active

"""The Engram class map of DeepSeek-V4.1: every token id -> a compressed class id derived from the tokenizer.

Engram hashes n-grams of *classes*, not of raw token ids: token ids whose decoded text is the same after
normalisation share a class (``"Hello"``, ``"hello"`` and ``"HELLO"``; ``"café"`` and ``"cafe"``). The rule, per
token id ``t`` in ``0 .. vocab - 1`` (the checkpoint's own tokenizer, added and special tokens included):

1. ``text = decode([t])`` with special tokens kept.
2. If ``text`` contains U+FFFD (the token is not valid text on its own, e.g. one byte of a multi-byte character in a
   byte-level BPE), its key is the raw vocabulary string of ``t`` (``id_to_token``), not normalised.
3. Otherwise ``text`` is normalised: NFKC, NFD, combining accents stripped, lowercased, every run of
   ``[ \\t\\r\\n]`` replaced by one space; a result that is exactly one space stays one space, anything else has its
   leading and trailing whitespace stripped (and U+E000 then becomes a space, as in the released rule). The key
   is that string, or ``text`` itself when it came out empty.
4. Keys are numbered in order of first appearance (token id order): class ids are ``0 .. count - 1``.

The count of distinct keys is ``engram_compressed_vocab_size`` of the config; it sets the hash multipliers, so a
tokenizer whose count differs is refused (:func:`engram_class_map_for`). V4.1-Flash's tokenizer gives 99092.

Tokenizers accepted: a ``tokenizers.Tokenizer``, a transformers fast tokenizer (``backend_tokenizer``; the vocab is
``len(tokenizer)``), dsv4's :class:`~dsv4.data.tokenizers.HFTokenizer` and :class:`~dsv4.data.tokenizers.ByteTokenizer`.
The byte tokenizer's undecodable ids (bytes 128..255) have no vocabulary string; each gets the key ``<0xHH>``
(its byte, spelled as byte-fallback vocabularies spell it), so each is its own class: 227 classes in all
(128 ASCII ids, of which ``A-Z`` merge with ``a-z`` and ``\\t \\n \\r`` with the space, plus 128 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["EngramClassMap", "engram_class_map", "engram_class_map_for", "normalize_token_text"]

_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class EngramClassMap:
    """``classes [vocab]`` int64 (class id of each token id, in ``[0, count)``) and ``count`` (distinct classes)."""

    classes: torch.Tensor
    count: int

    @property
    def vocab_size(self) -> int:
        """Number of token ids the map covers."""
        return int(self.classes.numel())

    def to(self, device: torch.device | str) -> "EngramClassMap":
        """The same map with ``classes`` on ``device`` (itself when already there)."""
        classes = self.classes.to(device)
        return self if classes is self.classes else EngramClassMap(classes, self.count)

    def class_of(self, token_id: int) -> int:
        """The class id of one token id (e.g. the class written for blocked history: ``engram_pad_token_id``'s)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"Engram class map: token id {token_id} is outside the tokenizer vocabulary "
                             f"[0, {self.vocab_size})")
        return int(self.classes[token_id])


_NORMALIZERS: dict[str, Any] = {}


def _normalizers() -> tuple[Any, Any]:
    """(fold, strip): the tokenizers-library normalisers the rule is made of (built once)."""
    if not _NORMALIZERS:
        try:
            from tokenizers import Regex, normalizers
        except ImportError as exc:  # pragma: no cover - tokenizers ships with the data extras
            raise ImportError("Engram's class map needs the `tokenizers` package: pip install tokenizers") from exc
        _NORMALIZERS["fold"] = normalizers.Sequence([
            normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        ])
        _NORMALIZERS["strip"] = normalizers.Strip()
    return _NORMALIZERS["fold"], _NORMALIZERS["strip"]


def normalize_token_text(text: str) -> str:
    """Step 3 of the rule: the normalised form of a decoded token (may be empty)."""
    fold, strip = _normalizers()
    folded = fold.normalize_str(text)
    # A lone space survives; otherwise surrounding whitespace goes. U+E000 also ends up as a space: the released
    # rule protects the lone space by a U+E000 placeholder that it turns back into a space everywhere.
    return folded if folded == " " else strip.normalize_str(folded).replace("\ue000", " ")


def _vocab_access(tokenizer: Any) -> tuple[int, Callable[[int], str], Callable[[int], Any]]:
    """(vocab size, decode one id with special tokens kept, raw vocabulary string of one id) for ``tokenizer``."""
    from dsv4.data.tokenizers import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return 256, lambda t: tokenizer.decode([t]), lambda t: f"<0x{t:02X}>"
    if isinstance(tokenizer, HFTokenizer):
        backend, size = tokenizer.backend_tokenizer, tokenizer.vocab_size
        if backend is None:
            raise TypeError(f"Engram's class map needs a fast tokenizer; {tokenizer!r} loads as a slow one")
    elif hasattr(tokenizer, "backend_tokenizer"):  # transformers PreTrainedTokenizerFast
        backend, size = tokenizer.backend_tokenizer, len(tokenizer)
    elif hasattr(tokenizer, "id_to_token") and hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        backend, size = tokenizer, tokenizer.get_vocab_size(with_added_tokens=True)
    else:
        raise TypeError(f"Engram's class map needs a tokenizers.Tokenizer, a transformers fast tokenizer or a dsv4 "
                        f"tokenizer; got {type(tokenizer).__name__}")
    return int(size), lambda t: backend.decode([t], skip_special_tokens=False), backend.id_to_token


def engram_class_map(tokenizer: Any) -> EngramClassMap:
    """The class map of ``tokenizer`` by the rule in the module docstring (one decode per token id)."""
    size, decode, raw = _vocab_access(tokenizer)
    numbering: dict[Any, int] = {}
    classes = []
    for token_id in range(size):
        text = decode(token_id)
        if _REPLACEMENT in text:
            key = raw(token_id)
        else:
            key = normalize_token_text(text) or text
        classes.append(numbering.setdefault(key, len(numbering)))
    return EngramClassMap(torch.tensor(classes, dtype=torch.int64), len(numbering))


def engram_class_map_for(tokenizer: Any, compressed_vocab_size: int | Any) -> EngramClassMap:
    """:func:`engram_class_map`, refused unless its class count equals ``compressed_vocab_size`` (an int, or a
    config with ``engram_compressed_vocab_size``): the count sets the hash multipliers, so another count hashes
    every n-gram into different rows of the checkpoint's tables."""
    expected = getattr(compressed_vocab_size, "engram_compressed_vocab_size", compressed_vocab_size)
    found = engram_class_map(tokenizer)
    if found.count != int(expected):
        raise ValueError(f"Engram: the tokenizer's class map has {found.count} classes but "
                         f"engram_compressed_vocab_size is {int(expected)}; use the checkpoint's own tokenizer "
                         f"(or set engram_compressed_vocab_size to {found.count} for a model trained from scratch)")
    return found

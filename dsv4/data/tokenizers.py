"""Tokenizers for the data pipeline: a byte-level default and a wrapper around local Hugging Face tokenizers.

Protocol (:class:`Tokenizer`): ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` (every id is
in ``[0, vocab_size)``) and ``pad_id`` (the id written into empty slots of a packed row; its label is always -100,
so its value never reaches the loss).

* :class:`ByteTokenizer` maps the UTF-8 bytes of a text to ids 0..255 (vocab 256, ``pad_id`` 0). It has no special
  tokens: documents are delimited by the packing metadata (``seq_lens``), not by EOS tokens. ``decode(encode(t))
  == t`` for every string; ``decode`` of an arbitrary byte sequence replaces invalid UTF-8 with U+FFFD.
* :class:`HFTokenizer` wraps a ``tokenizers`` JSON file or a tokenizer directory (``tokenizer.json``, or anything
  ``transformers.AutoTokenizer`` reads) from a **local path only**; nothing is downloaded from a hub.
  ``encode`` adds no special tokens unless asked to (same reason as above). A directory that
  ``AutoTokenizer`` cannot load but that holds a ``tokenizer.json`` is read through that file (one INFO line names
  the file and the exception), and so is every directory when transformers is not installed.

Both also have ``encode_with_offsets(text) -> (ids, offsets)``: the ids of ``encode(text)`` and each token's
``(start, end)`` character offsets in ``text`` (chat data derives its loss mask from them,
:mod:`dsv4.data.chat`). A tokenizer object without it can tokenize text documents but not chats.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable


log = logging.getLogger("dsv4")

_INSTALL_HINT = "pip install datasets tokenizers"


@runtime_checkable
class Tokenizer(Protocol):
    """What the sources and the packer need from a tokenizer."""

    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes <-> ids 0..255; ``vocab_size`` 256, ``pad_id`` 0, no special tokens."""

    vocab_size: int = 256
    pad_id: int = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The bytes of ``text`` and, for each, the offsets ``(i, i + 1)`` of the character ``i`` it belongs to."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            piece = char.encode("utf-8")
            ids.extend(piece)
            offsets.extend([(i, i + 1)] * len(piece))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids must lie in [0, 256), got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256, pad_id=0)"


class HFTokenizer:
    """A local Hugging Face tokenizer: a ``tokenizers`` JSON file or a tokenizer directory.

    Args:
        path: ``tokenizer.json`` (any ``.json`` file written by ``tokenizers.Tokenizer.save``) or a directory.
            A directory is read with ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``
            when transformers is installed, else through its ``tokenizer.json``.
        add_special_tokens: passed to the underlying ``encode`` (default False: packing metadata, not BOS/EOS,
            delimits documents).
        pad_token: the token whose id is ``pad_id``; default: the tokenizer's pad token, else its EOS token,
            else id 0.
    """

    def __init__(self, path: str | os.PathLike, *, add_special_tokens: bool = False, pad_token: str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(
                f"HFTokenizer: {str(self.path)!r} does not exist; the tokenizer must be a local file or directory "
                "(hub downloads are not supported)"
            )
        self.add_special_tokens = bool(add_special_tokens)
        self._fast: Any = None  # tokenizers.Tokenizer
        self._hf: Any = None  # transformers tokenizer
        json_file = self.path if self.path.is_file() else self.path / "tokenizer.json"
        if self.path.is_dir() and importlib.util.find_spec("transformers") is not None:
            from transformers import AutoTokenizer

            try:
                self._hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            except Exception as exc:  # no config / unknown class: fall back to tokenizer.json when there is one
                if not json_file.is_file():
                    raise ValueError(f"HFTokenizer: transformers cannot load {str(self.path)!r}: {exc}") from exc
                log.info("tokenizer: reading %s with the tokenizers library: transformers.AutoTokenizer cannot load "
                         "%s (%s: %s)", json_file, self.path, type(exc).__name__, exc)
        elif self.path.is_dir() and not json_file.is_file():
            raise ValueError(
                f"HFTokenizer: directory {str(self.path)!r} has no tokenizer.json and transformers is not "
                "installed (pip install transformers, or point at a tokenizer.json file)"
            )
        elif self.path.is_dir():
            log.info("tokenizer: reading %s with the tokenizers library: transformers is not installed", json_file)
        if self._hf is None:
            try:
                from tokenizers import Tokenizer as _FastTokenizer
            except ImportError as exc:
                raise ImportError(f"HFTokenizer needs the `tokenizers` package: {_INSTALL_HINT}") from exc
            try:
                self._fast = _FastTokenizer.from_file(str(json_file))
            except Exception as exc:  # tokenizers raises a bare Exception on malformed files
                raise ValueError(f"HFTokenizer: cannot read tokenizer file {str(json_file)!r}: {exc}") from exc
        self.directory = json_file.parent
        self._config_cache: dict | None = None
        self.pad_id = self._resolve_pad_id(pad_token, json_file)

    def _config(self) -> dict:
        """``tokenizer_config.json`` beside the tokenizer ({} without one), read once."""
        if self._config_cache is None:
            config = self.directory / "tokenizer_config.json"
            self._config_cache = {}
            if config.is_file():
                try:
                    self._config_cache = json.loads(config.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError) as exc:
                    raise ValueError(f"HFTokenizer: {str(config)!r} is not valid JSON: {exc}") from exc
        return self._config_cache

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own Jinja chat template: ``chat_template.jinja`` beside it, else ``tokenizer_config.json``'s
        ``chat_template`` (a string, or a list of ``{name, template}`` of which the one named ``default``); None
        when it has none."""
        jinja = self.directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = self._config().get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) and template else None

    @property
    def template_vars(self) -> dict[str, str]:
        """``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` of ``tokenizer_config.json`` (the variables
        Hugging Face chat templates read besides ``messages``)."""
        found = {}
        for key, value in self._config().items():
            if key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    found[key] = value
        return found

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return int(self._fast.get_vocab_size(with_added_tokens=True))

    @property
    def backend_tokenizer(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (None for a slow transformers tokenizer)."""
        if self._hf is not None:
            return getattr(self._hf, "backend_tokenizer", None)
        return self._fast

    def token_to_id(self, token: str) -> int | None:
        if self._hf is not None:
            return self._hf.get_vocab().get(token)
        return self._fast.token_to_id(token)

    def _resolve_pad_id(self, pad_token: str | None, json_file: Path) -> int:
        if pad_token is not None:
            tid = self.token_to_id(pad_token)
            if tid is None:
                raise ValueError(f"HFTokenizer: pad_token {pad_token!r} is not in the vocabulary of {str(self.path)!r}")
            return int(tid)
        if self._hf is not None:
            for tid in (self._hf.pad_token_id, self._hf.eos_token_id):
                if tid is not None:
                    return int(tid)
            return 0
        config = json_file.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                cfg = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"HFTokenizer: {str(config)!r} is not valid JSON: {exc}") from exc
            for key in ("pad_token", "eos_token"):
                tok = cfg.get(key)
                tok = tok.get("content") if isinstance(tok, dict) else tok
                if isinstance(tok, str) and self._fast.token_to_id(tok) is not None:
                    return int(self._fast.token_to_id(tok))
        padding = self._fast.padding
        if padding and padding.get("pad_id") is not None:
            return int(padding["pad_id"])
        return 0

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=self.add_special_tokens))
        return list(self._fast.encode(text, add_special_tokens=self.add_special_tokens).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of :meth:`encode` and each token's ``(start, end)`` character offsets in ``text``."""
        if self._hf is not None:
            if not getattr(self._hf, "is_fast", False):
                raise ValueError(f"HFTokenizer: {str(self.path)!r} loads as {type(self._hf).__name__}, which reports "
                                 "no token offsets (chat data needs them); point data.tokenizer at its tokenizer.json")
            out = self._hf(text, add_special_tokens=self.add_special_tokens, return_offsets_mapping=True)
            return list(out["input_ids"]), [(int(s), int(e)) for s, e in out["offset_mapping"]]
        encoding = self._fast.encode(text, add_special_tokens=self.add_special_tokens)
        return list(encoding.ids), list(encoding.offsets)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._fast.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, pad_id={self.pad_id})"


def single_id(tokenizer: Tokenizer, token: str) -> int | None:
    """The id ``token`` encodes to when it encodes to exactly one id (a special token of the vocabulary), else
    None."""
    ids = tokenizer.encode(token)
    return int(ids[0]) if len(ids) == 1 else None


def build_tokenizer(spec: str | os.PathLike | Tokenizer | None = "byte") -> Tokenizer:
    """``None`` / ``"byte"`` -> :class:`ByteTokenizer`; a local path -> :class:`HFTokenizer`; a tokenizer object
    (anything with ``encode``/``decode``/``vocab_size``/``pad_id``) is returned as is."""
    if spec is None or (isinstance(spec, str) and spec == "byte"):
        return ByteTokenizer()
    if isinstance(spec, (str, os.PathLike)):
        return HFTokenizer(spec)
    missing = [name for name in ("encode", "decode", "vocab_size", "pad_id") if not hasattr(spec, name)]
    if missing:
        raise ValueError(f"tokenizer {spec!r} lacks {missing}; pass 'byte', a local path, or a Tokenizer object")
    return spec

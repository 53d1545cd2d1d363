"""Document sources: the bundled stdlib corpus, JSONL files (plain text or chat) and local Hugging Face datasets.

Every source returns a list of :class:`Document`, each one document of token ids plus an optional per-token loss
mask (``loss_mask[j]`` True = token j is supervised *as a target*; None = every token is). Documents are never cut
here; the packer splits documents longer than a row.

Bad data fails when the source is built, before anything is tokenized, with a message that names the file and
line (or dataset row) and the offending key: a JSONL line that is not JSON or not an object, a record with neither
the text nor the messages field, a malformed message, an empty file or dataset.

* ``stdlib_corpus``: every ``.py`` file under the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, recursive, ``site-packages``/``dist-packages`` skipped, files that are not
  UTF-8 skipped), one document per file; paths are sorted, then shuffled with ``random.Random(seed)`` (``seed=None``
  keeps the sorted order), so the selection is deterministic for a given Python installation. Needs no download.
* ``jsonl_documents``: one JSON object per line with a ``text`` string or a ``messages`` list (chat, rendered by
  :mod:`dsv4.data.chat`, assistant-only loss). Blank lines are skipped. When both fields are present ``messages``
  wins.
* ``hf_documents``: a local ``datasets`` dataset (a ``save_to_disk`` directory, a data directory, or a
  ``.jsonl/.json/.parquet/.csv/.arrow/.txt`` file); the same record rules as JSONL. Nothing is downloaded.

``data.kind`` names a source registered in :data:`DATA_SOURCES` (built in: ``stdlib``, ``jsonl``, ``hf``);
:func:`build_documents` is the one entry point configs use. A new source is one module with its documents factory
and one :class:`DataSource` registration (``docs/extending.md``).
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dsv4.data.chat import _compile, tokenize_chat, validate_messages
from dsv4.data.tokenizers import Tokenizer, build_tokenizer
from dsv4.registry import Registry

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
                     ".txt": "text"}


@dataclass
class Document:
    """One document: ``ids`` (token ids), ``loss_mask`` (per token, True = supervised target; None = all) and
    ``source`` (where it came from, for error messages and inspection)."""

    ids: Sequence[int]
    loss_mask: Sequence[bool] | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != len(self.ids):
            raise ValueError(
                f"Document {self.source!r}: loss_mask has {len(self.loss_mask)} entries but ids has {len(self.ids)}"
            )

    def __len__(self) -> int:
        return len(self.ids)


# ----------------------------------------------------------------------------------------------------- stdlib


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Sorted ``.py`` files under ``root`` (default: the stdlib), skipping site-packages and caches."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"stdlib corpus: {str(base)!r} is not a directory")
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def stdlib_corpus(
    max_documents: int | None = None,
    max_bytes: int | None = None,
    min_bytes: int = 64,
    seed: int | None = 0,
    *,
    tokenizer: Tokenizer | None = None,
    root: str | os.PathLike | None = None,
) -> list[Document]:
    """The standard library's ``.py`` files as documents (see the module docstring).

    Args:
        max_documents: stop after this many documents.
        max_bytes: total byte budget; a file that would overflow it is skipped and the walk goes on.
        min_bytes: skip files smaller than this (empty ``__init__.py`` and the like).
        seed: shuffle of the sorted file list; None keeps the sorted order.
        tokenizer: default :class:`~dsv4.data.tokenizers.ByteTokenizer`.
        root: another directory to read instead of the stdlib (tests, inspection).
    """
    for name, value in (("max_documents", max_documents), ("max_bytes", max_bytes)):
        if value is not None and value <= 0:
            raise ValueError(f"stdlib corpus: {name} must be positive or None, got {value}")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer("byte")
    paths = stdlib_files(root)
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if seed is not None:
        random.Random(seed).shuffle(paths)
    documents: list[Document] = []
    used = 0
    for path in paths:
        if max_documents is not None and len(documents) >= max_documents:
            break
        size = path.stat().st_size
        if size < min_bytes or (max_bytes is not None and used + size > max_bytes):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        documents.append(Document(tokenizer.encode(text), None, f"stdlib:{path.relative_to(base).as_posix()}"))
        used += size
    if not documents:
        raise ValueError(
            f"stdlib corpus under {str(base)!r} yielded no documents ({len(paths)} .py files; max_documents="
            f"{max_documents}, max_bytes={max_bytes}, min_bytes={min_bytes})"
        )
    return documents


# ------------------------------------------------------------------------------------------ records -> documents


def _check_record(record: Any, where: str, text_key: str, messages_key: str) -> str:
    """Which field of a record to use (``text_key`` or ``messages_key``); raise naming ``where`` if unusable."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if record.get(messages_key) is not None:
        validate_messages(record[messages_key], where)
        return messages_key
    if text_key in record and record[text_key] is not None:
        if not isinstance(record[text_key], str):
            raise ValueError(f"{where}: field `{text_key}` must be a string, got {type(record[text_key]).__name__}")
        return text_key
    raise KeyError(
        f"{where}: record has neither a `{text_key}` nor a `{messages_key}` field (keys: {sorted(record)})"
    )


def _to_document(record: dict, field: str, messages_key: str, tokenizer: Tokenizer, chat_template: str | None,
                 where: str) -> Document:
    if field == messages_key:
        ids, mask = tokenize_chat(record[field], tokenizer, chat_template, where=where)
        return Document(ids, mask, where)
    return Document(tokenizer.encode(record[field]), None, where)


def jsonl_documents(
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    text_key: str = "text",
    messages_key: str = "messages",
    chat_template: str | None = None,
    *,
    max_documents: int | None = None,
) -> list[Document]:
    """Documents of a JSONL file; every line is parsed and checked before the first one is tokenized."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"jsonl data: {str(path)!r} is not a file")
    if chat_template is not None:
        _compile(chat_template)
    records: list[tuple[str, dict, str]] = []
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: line is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}): {line[:80]!r}") from exc
            records.append((where, record, _check_record(record, where, text_key, messages_key)))
    if not records:
        raise ValueError(f"jsonl data: {str(path)!r} holds no records (empty dataset)")
    if max_documents is not None:
        records = records[:max_documents]
    return [_to_document(rec, field, messages_key, tokenizer, chat_template, where) for where, rec, field in records]


def _load_hf_dataset(path: Path, split: str, cache_dir: str | os.PathLike | None) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("data=hf needs the `datasets` package: pip install datasets tokenizers") from exc
    cache_dir = None if cache_dir is None else str(cache_dir)
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise KeyError(f"hf data: {str(path)!r} has no split {split!r} (splits: {sorted(loaded)})")
            return loaded[split]
        return loaded
    if path.is_file():
        builder = _HF_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"hf data: cannot read {str(path)!r}; supported files: {sorted(_HF_FILE_BUILDERS)}")
        if path.stat().st_size == 0:
            raise ValueError(f"hf data: {str(path)!r} is empty (empty dataset)")
        args, kwargs = (builder,), {"data_files": {split: str(path)}}
    else:
        args, kwargs = (str(path),), {}
    try:
        return datasets.load_dataset(*args, split=split, cache_dir=cache_dir, **kwargs)
    except Exception as exc:  # datasets raises many types (StopIteration on empty files, DatasetGenerationError, ...)
        raise ValueError(
            f"hf data: `datasets` could not load {str(path)!r} split {split!r}: {type(exc).__name__}: {exc}"
        ) from exc


def hf_documents(
    path_or_name: str | os.PathLike,
    split: str = "train",
    tokenizer: Tokenizer | None = None,
    text_key: str = "text",
    messages_key: str = "messages",
    chat_template: str | None = None,
    *,
    max_documents: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> list[Document]:
    """Documents of a local Hugging Face dataset (see the module docstring); hub names are refused.

    ``cache_dir`` is where ``datasets`` caches the Arrow conversion of data files (default: its own cache).
    """
    path = Path(path_or_name)
    if not path.exists():
        raise ValueError(
            f"hf data: {str(path_or_name)!r} is not a local file or directory; data=hf reads local datasets only "
            "(save one with `Dataset.save_to_disk` or point at a .jsonl/.parquet file)"
        )
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer("byte")
    if chat_template is not None:
        _compile(chat_template)
    dataset = _load_hf_dataset(path, split, cache_dir)
    columns = list(dataset.column_names or [])
    if text_key not in columns and messages_key not in columns:
        raise KeyError(f"hf data: {str(path)!r} split {split!r} has neither a `{text_key}` nor a `{messages_key}` "
                       f"column (columns: {columns})")
    if len(dataset) == 0:
        raise ValueError(f"hf data: {str(path)!r} split {split!r} has no rows (empty dataset)")
    count = len(dataset) if max_documents is None else min(len(dataset), max_documents)
    records = []
    for i in range(count):
        where = f"{path}[{split}] row {i}"
        record = dataset[i]
        records.append((where, record, _check_record(record, where, text_key, messages_key)))
    return [_to_document(rec, field, messages_key, tokenizer, chat_template, where) for where, rec, field in records]


# --------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class SourceArgs:
    """What :func:`build_documents` hands a source: the data group's keys (``conf/data/*.yaml``, the schema's
    ``DataConfig``) with ``tokenizer`` built and ``chat_template`` read from ``chat_template_file``. A source reads
    the keys it needs; ``options`` holds the source-specific ones (only those its :class:`DataSource` declares)."""

    kind: str
    path: str | os.PathLike | None
    tokenizer: Tokenizer
    chat_template: str | None = None
    split: str = "train"
    text_key: str = "text"
    messages_key: str = "messages"
    max_documents: int | None = None
    max_bytes: int | None = None
    min_bytes: int = 64
    seed: int | None = 0
    cache_dir: str | os.PathLike | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def required_path(self) -> str | os.PathLike:
        """``path``, or ``ValueError`` when the source needs one and the config has none."""
        if self.path is None:
            raise ValueError(f"data kind {self.kind!r} needs a `path`")
        return self.path


@dataclass(frozen=True)
class DataSource:
    """One registered document source.

    Attributes:
        documents: ``documents(args: SourceArgs) -> list[Document]``; bad data raises naming where and which key.
        options: the keys of ``data.options`` it reads; any other key fails before ``documents`` runs.
    """

    documents: Callable[[SourceArgs], list[Document]]
    options: tuple[str, ...] = ()


DATA_SOURCES: Registry[DataSource] = Registry("data.kind", "data source",
                                              unknown="`{key}`: data kind {name!r} is not one of {names}")


def _stdlib_source(args: SourceArgs) -> list[Document]:
    return stdlib_corpus(args.max_documents, args.max_bytes, args.min_bytes, args.seed, tokenizer=args.tokenizer,
                         root=args.path)


def _jsonl_source(args: SourceArgs) -> list[Document]:
    return jsonl_documents(args.required_path(), args.tokenizer, args.text_key, args.messages_key,
                           args.chat_template, max_documents=args.max_documents)


def _hf_source(args: SourceArgs) -> list[Document]:
    return hf_documents(args.required_path(), args.split, args.tokenizer, args.text_key, args.messages_key,
                        args.chat_template, max_documents=args.max_documents, cache_dir=args.cache_dir)


DATA_SOURCES.register("stdlib", DataSource(_stdlib_source))
DATA_SOURCES.register("jsonl", DataSource(_jsonl_source))
DATA_SOURCES.register("hf", DataSource(_hf_source))

DATA_KINDS: tuple[str, ...] = DATA_SOURCES.names()  # the built-in kinds; DATA_SOURCES lists every one


# ---------------------------------------------------------------------------------------------------- factory


def build_documents(
    kind: str = "stdlib",
    path: str | os.PathLike | None = None,
    tokenizer: Tokenizer | str | None = "byte",
    *,
    split: str = "train",
    text_key: str = "text",
    messages_key: str = "messages",
    chat_template: str | None = None,
    chat_template_file: str | os.PathLike | None = None,
    max_documents: int | None = None,
    max_bytes: int | None = None,
    min_bytes: int = 64,
    seed: int | None = 0,
    cache_dir: str | os.PathLike | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[Document]:
    """Plain-argument factory over the registered sources (for configs): ``kind`` is a name in
    :data:`DATA_SOURCES` (``"stdlib"``, ``"jsonl"``, ``"hf"``, ...).

    ``tokenizer`` is a spec for :func:`~dsv4.data.tokenizers.build_tokenizer` (``"byte"``, a local path) or a
    tokenizer object; ``chat_template_file`` reads the template text from a file. ``max_bytes``/``min_bytes``/
    ``seed`` apply to the stdlib corpus only, ``split``/``cache_dir`` to ``hf`` only; ``max_documents`` to every kind;
    ``options``: source-specific keys (the built-ins take none).
    """
    source = DATA_SOURCES.get(kind)
    options = dict(options or {})
    unread = sorted(set(options) - set(source.options))
    if unread:
        raise ValueError(f"`data.options`: data kind {kind!r} does not read {unread} (it reads "
                         f"{list(source.options) or 'no options'})")
    tok = build_tokenizer(tokenizer)
    if chat_template_file is not None:
        if chat_template is not None:
            raise ValueError("pass chat_template or chat_template_file, not both")
        template_path = Path(chat_template_file)
        if not template_path.is_file():
            raise ValueError(f"chat_template_file {str(template_path)!r} is not a file")
        chat_template = template_path.read_text(encoding="utf-8")
    return source.documents(SourceArgs(
        kind=kind, path=path, tokenizer=tok, chat_template=chat_template, split=split, text_key=text_key,
        messages_key=messages_key, max_documents=max_documents, max_bytes=max_bytes, min_bytes=min_bytes, seed=seed,
        cache_dir=cache_dir, options=options))

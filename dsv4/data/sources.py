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
from typing import Any, Callable, Iterator, Mapping, Sequence

from dsv4.data.chat import DEEPSEEK_V4_FORMAT, _compile, tokenize_chat, validate_messages
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
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer("byte")
    return [Document(tokenizer.encode(text), None, where)
            for where, text in stdlib_texts(max_documents, max_bytes, min_bytes, seed, root=root)]


def stdlib_texts(
    max_documents: int | None = None,
    max_bytes: int | None = None,
    min_bytes: int = 64,
    seed: int | None = 0,
    *,
    root: str | os.PathLike | None = None,
) -> Iterator[tuple[str, str]]:
    """``(source, text)`` of the files :func:`stdlib_corpus` selects, in its order, one file read at a time;
    ValueError (before the first item) for a bad limit, at the end when nothing was selected."""
    for name, value in (("max_documents", max_documents), ("max_bytes", max_bytes)):
        if value is not None and value <= 0:
            raise ValueError(f"stdlib corpus: {name} must be positive or None, got {value}")
    paths = stdlib_files(root)
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    return _stdlib_walk(paths, base, max_documents, max_bytes, min_bytes, seed)


def _stdlib_walk(paths: list[Path], base: Path, max_documents: int | None, max_bytes: int | None, min_bytes: int,
                 seed: int | None) -> Iterator[tuple[str, str]]:
    if seed is not None:
        random.Random(seed).shuffle(paths)
    count = used = 0
    for path in paths:
        if max_documents is not None and count >= max_documents:
            break
        size = path.stat().st_size
        if size < min_bytes or (max_bytes is not None and used + size > max_bytes):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield f"stdlib:{path.relative_to(base).as_posix()}", text
        count += 1
        used += size
    if not count:
        raise ValueError(
            f"stdlib corpus under {str(base)!r} yielded no documents ({len(paths)} .py files; max_documents="
            f"{max_documents}, max_bytes={max_bytes}, min_bytes={min_bytes})"
        )


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
        ids, mask = tokenize_chat(record[field], tokenizer, chat_template, where=where,
                                  template_vars=getattr(tokenizer, "template_vars", None))
        return Document(ids, mask, where)
    return Document(tokenizer.encode(record[field]), None, where)


Record = tuple[str, dict, str]
"""``(where, record, field)``: one record of a source, where it is (file and line, dataset row, ...) and which of its
fields to use (the text or the messages key); :func:`record_document` tokenizes it."""


def record_document(record: Record, messages_key: str, tokenizer: Tokenizer, chat_template: str | None) -> Document:
    """The document of one checked record (chat records through the template, assistant-only loss)."""
    where, rec, field_ = record
    return _to_document(rec, field_, messages_key, tokenizer, chat_template, where)


def jsonl_records(
    path: str | os.PathLike,
    text_key: str = "text",
    messages_key: str = "messages",
    *,
    max_documents: int | None = None,
) -> tuple[int, Iterator[Record]]:
    """``(count, records)`` of a JSONL file: every line is parsed and checked first (one line in memory at a time;
    bad data raises here, naming the file and line), then ``records`` reads the file again, one record at a time."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"jsonl data: {str(path)!r} is not a file")
    count = sum(1 for _ in _jsonl_lines(path, text_key, messages_key, max_documents))
    if not count:
        raise ValueError(f"jsonl data: {str(path)!r} holds no records (empty dataset)")
    return count, _jsonl_lines(path, text_key, messages_key, max_documents)


def _jsonl_lines(path: Path, text_key: str, messages_key: str, max_documents: int | None) -> Iterator[Record]:
    count = 0
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
            field_ = _check_record(record, where, text_key, messages_key)
            if max_documents is None or count < max_documents:
                count += 1
                yield where, record, field_


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
    if chat_template is not None:
        _compile(chat_template)
    _, records = jsonl_records(path, text_key, messages_key, max_documents=max_documents)
    return [record_document(r, messages_key, tokenizer, chat_template) for r in records]


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
    _, records = hf_records(path, split, text_key, messages_key, max_documents=max_documents, cache_dir=cache_dir)
    return [record_document(r, messages_key, tokenizer, chat_template) for r in records]


def hf_records(
    path_or_name: str | os.PathLike,
    split: str = "train",
    text_key: str = "text",
    messages_key: str = "messages",
    *,
    max_documents: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[int, Iterator[Record]]:
    """``(count, records)`` of a local dataset: every row is checked first, then ``records`` reads them again one at
    a time (``datasets`` keeps the rows memory-mapped on disk)."""
    path = Path(path_or_name)
    if not path.exists():
        raise ValueError(
            f"hf data: {str(path_or_name)!r} is not a local file or directory; data=hf reads local datasets only "
            "(save one with `Dataset.save_to_disk` or point at a .jsonl/.parquet file)"
        )
    dataset = _load_hf_dataset(path, split, cache_dir)
    columns = list(dataset.column_names or [])
    if text_key not in columns and messages_key not in columns:
        raise KeyError(f"hf data: {str(path)!r} split {split!r} has neither a `{text_key}` nor a `{messages_key}` "
                       f"column (columns: {columns})")
    if len(dataset) == 0:
        raise ValueError(f"hf data: {str(path)!r} split {split!r} has no rows (empty dataset)")
    count = len(dataset) if max_documents is None else min(len(dataset), max_documents)

    def rows() -> Iterator[Record]:
        for i in range(count):
            where = f"{path}[{split}] row {i}"
            record = dataset[i]
            yield where, record, _check_record(record, where, text_key, messages_key)

    for _ in rows():
        pass
    return count, rows()


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
        records: optional ``records(args) -> (count or None, iterator of Record)`` yielding, one at a time, the
            records ``documents`` tokenizes, in the same order (bad data raising before the iterator is returned
            where the source can check it). A prepare (:mod:`dsv4.data.prepared`) streams them; a source without
            it is tokenized in memory by ``documents`` and then written out.
    """

    documents: Callable[[SourceArgs], list[Document]]
    options: tuple[str, ...] = ()
    records: Callable[[SourceArgs], tuple[int | None, Iterator[Record]]] | None = None


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


def _stdlib_records(args: SourceArgs) -> tuple[int | None, Iterator[Record]]:
    texts = stdlib_texts(args.max_documents, args.max_bytes, args.min_bytes, args.seed, root=args.path)
    return None, ((where, {"text": text}, "text") for where, text in texts)


def _jsonl_records(args: SourceArgs) -> tuple[int | None, Iterator[Record]]:
    return jsonl_records(args.required_path(), args.text_key, args.messages_key, max_documents=args.max_documents)


def _hf_records(args: SourceArgs) -> tuple[int | None, Iterator[Record]]:
    return hf_records(args.required_path(), args.split, args.text_key, args.messages_key,
                      max_documents=args.max_documents, cache_dir=args.cache_dir)


DATA_SOURCES.register("stdlib", DataSource(_stdlib_source, records=_stdlib_records))
DATA_SOURCES.register("jsonl", DataSource(_jsonl_source, records=_jsonl_records))
DATA_SOURCES.register("hf", DataSource(_hf_source, records=_hf_records))

DATA_KINDS: tuple[str, ...] = DATA_SOURCES.names()  # the built-in kinds; DATA_SOURCES lists every one


# ---------------------------------------------------------------------------------------------------- factory


def build_documents(*args: Any, **kwargs: Any) -> list[Document]:
    """Plain-argument factory over the registered sources (for configs): the documents of the source that
    :func:`source_args` resolves from the same arguments (``kind`` a name in :data:`DATA_SOURCES`: ``"stdlib"``,
    ``"jsonl"``, ``"hf"``, ...)."""
    source, spec = source_args(*args, **kwargs)
    return source.documents(spec)


def source_args(
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
) -> tuple[DataSource, SourceArgs]:
    """The registered source of ``kind`` and the :class:`SourceArgs` :func:`build_documents` hands it (tokenizer
    built, template read, options checked).

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
    if chat_template_file is not None and chat_template is not None:
        raise ValueError("pass chat_template or chat_template_file, not both")
    if chat_template_file == DEEPSEEK_V4_FORMAT:
        chat_template = DEEPSEEK_V4_FORMAT
    elif chat_template_file is not None:
        template_path = Path(chat_template_file)
        if not template_path.is_file():
            raise ValueError(f"chat_template_file {str(template_path)!r} is not a file")
        chat_template = template_path.read_text(encoding="utf-8")
    return source, SourceArgs(
        kind=kind, path=path, tokenizer=tok, chat_template=chat_template, split=split, text_key=text_key,
        messages_key=messages_key, max_documents=max_documents, max_bytes=max_bytes, min_bytes=min_bytes, seed=seed,
        cache_dir=cache_dir, options=options)

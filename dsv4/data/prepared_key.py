"""The key of a prepared dataset: a SHA-256 over everything its rows depend on, and the directory it names.

:func:`prepared_fingerprint` lists the inputs (JSON-serialisable; written to the directory's ``meta.json``) and
:func:`prepared_path` hashes them into ``<cache_dir>/<kind>-<first 20 hex digits>``. Two starts get the same
directory exactly when their fingerprints are equal. The fingerprint holds

* ``format_version`` (:data:`FORMAT_VERSION`, raised when the on-disk layout or the packing rules change);
* ``source``: the data keys (kind, path, field names, limits, seed, split, options), without the tokenizer and the
  template, which are keyed by content below;
* ``inputs``: every input file's path, size and modification time (:func:`input_files`; a directory: every file
  under it; the bundled corpus: the selected standard-library files);
* ``tokenizer``: ``byte``, or ``sha256:`` over the name and content of every file the tokenizer is built from
  (:func:`tokenizer_files`);
* ``chat_template``: SHA-256 of each template text a chat may be rendered with (:func:`chat_template_fingerprint`);
* ``seq_len``, ``shard_multiple``, ``overlong``, ``pad_id`` and ``val_split`` (``{fraction, seed}`` of a
  ``data.val_fraction`` split, None without one).

``cp`` does not change the packing (``seq_len`` is checked to be a multiple of ``cp`` x the shard multiple) and is
not in the key.

**Tokenizer files** (:func:`tokenizer_files`): a tokenizer *directory* (what ``transformers.AutoTokenizer`` reads,
usually the model checkpoint) is keyed by every regular file directly in it and in its ``additional_chat_templates/``
folder, except hidden files, Markdown files and model weights (:data:`WEIGHT_SUFFIXES`, ``*.index.json``). So any
file a tokenizer class may read (``tokenizer.json``, ``tokenizer.model``, ``vocab.json`` / ``merges.txt``,
``vocab.txt``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``added_tokens.json``,
``chat_template.jinja`` / ``chat_template.json``, ``config.json``, remote tokenizer code) is in the key, whatever its
name; a README or a new weight shard is not. A tokenizer *file* (a ``tokenizers`` JSON) is keyed by itself and the
files beside it that are read with it (:data:`TOKENIZER_SIDE_FILES`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Mapping

FORMAT_VERSION = 2

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz",
                   ".npy", ".tflite", ".ot")
"""Files of a tokenizer directory that are model weights (never read by a tokenizer), left out of the key."""

TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                        "chat_template.json")
"""The files beside a tokenizer *file* that are read with it (special tokens, pad token, chat template)."""

CHAT_TEMPLATES_DIR = "additional_chat_templates"


def _sha256_files(paths: Iterable[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        name = path.relative_to(root).as_posix().encode()
        digest.update(len(name).to_bytes(8, "little") + name + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def _is_tokenizer_file(path: Path) -> bool:
    name = path.name
    return (path.is_file() and not name.startswith(".") and not name.endswith((".md", ".index.json"))
            and not name.endswith(WEIGHT_SUFFIXES))


def tokenizer_files(path: str | os.PathLike) -> list[Path]:
    """The files the tokenizer at ``path`` is built from (see the module docstring), sorted; ValueError naming
    ``data.tokenizer`` when ``path`` does not exist."""
    path = Path(path)
    if path.is_dir():
        extra = path / CHAT_TEMPLATES_DIR
        found = [p for p in path.iterdir() if _is_tokenizer_file(p)]
        found += [p for p in extra.iterdir() if _is_tokenizer_file(p)] if extra.is_dir() else []
        return sorted(found, key=lambda p: p.relative_to(path).as_posix())
    if path.is_file():
        beside = [path.parent / n for n in TOKENIZER_SIDE_FILES if (path.parent / n).is_file()]
        return sorted({path, *beside}, key=lambda p: p.name)
    raise ValueError(f"`data.tokenizer`={str(path)!r} does not exist; the tokenizer must be a local file or directory")


def _tokenizer_path(spec: Any) -> Path | None:
    """The local path of a tokenizer spec (a path, or a tokenizer object with a ``path``); None for anything else."""
    spec = getattr(spec, "path", spec)
    return Path(spec) if isinstance(spec, (str, os.PathLike)) else None


def tokenizer_fingerprint(spec: Any) -> str:
    """``byte`` for the byte tokenizer, ``sha256:<hex>`` over the names and contents of :func:`tokenizer_files` for a
    local tokenizer (a path or an :class:`~dsv4.data.tokenizers.HFTokenizer`), else the object's ``repr``."""
    from dsv4.data.tokenizers import ByteTokenizer

    if spec is None or spec == "byte" or isinstance(spec, ByteTokenizer):
        return "byte"
    path = _tokenizer_path(spec)
    if path is None:
        return repr(spec)
    root = path if path.is_dir() else path.parent
    return "sha256:" + _sha256_files(tokenizer_files(path), root)


def tokenizer_chat_templates(spec: Any) -> dict[str, str]:
    """Every chat template text the tokenizer's own files hold, by where it is: ``chat_template.jinja``,
    ``chat_template.json`` (its ``chat_template``), ``tokenizer_config.json`` (``chat_template``: a string, or a list
    of ``{name, template}``) and ``additional_chat_templates/*.jinja``; {} for the byte tokenizer."""
    path = _tokenizer_path(spec)
    if path is None or not path.exists():
        return {}
    root = path if path.is_dir() else path.parent
    found: dict[str, str] = {}
    for name in ("chat_template.jinja", *(p.relative_to(root).as_posix() for p in sorted(
            (root / CHAT_TEMPLATES_DIR).glob("*.jinja")))):
        if (root / name).is_file():
            found[name] = (root / name).read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if not (root / name).is_file():
            continue
        try:
            template = json.loads((root / name).read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError):  # a broken file is in the tokenizer hash; it fails at build
            continue
        if isinstance(template, str):
            found[name] = template
        elif isinstance(template, list):
            for item in template:
                if isinstance(item, dict) and isinstance(item.get("template"), str):
                    found[f"{name}:{item.get('name')}"] = item["template"]
    return found


def configured_chat_template(source: Mapping[str, Any]) -> str | None:
    """The template the data keys set: ``chat_template`` (text, or ``deepseek_v4``), else the text of
    ``chat_template_file`` (``deepseek_v4`` by name); None when neither is set. ValueError naming the key when the
    file does not exist."""
    from dsv4.data.chat import DEEPSEEK_V4_FORMAT

    template, file = source.get("chat_template"), source.get("chat_template_file")
    if template is not None or file is None:
        return template
    if file == DEEPSEEK_V4_FORMAT:
        return DEEPSEEK_V4_FORMAT
    if not Path(file).is_file():
        raise ValueError(f"`data.chat_template_file`={str(file)!r} is not a file (or deepseek_v4)")
    return Path(file).read_text(encoding="utf-8")


def chat_template_fingerprint(source: Mapping[str, Any]) -> dict[str, Any]:
    """SHA-256 of each template a chat of ``source`` may be rendered with: ``config`` (the data keys'
    :func:`configured_chat_template`, None when unset), ``tokenizer`` (the tokenizer's own templates,
    :func:`tokenizer_chat_templates`; None without one) and ``builtin`` (the built-in role-marker template). Whichever
    of them is used, changing its text changes the key."""
    from dsv4.data.chat import DEFAULT_CHAT_TEMPLATE

    own = tokenizer_chat_templates(source.get("tokenizer", "byte"))
    return {
        "config": _sha256_text(configured_chat_template(source)),
        "tokenizer": _sha256_text(json.dumps(own, sort_keys=True)) if own else None,
        "builtin": _sha256_text(DEFAULT_CHAT_TEMPLATE),
    }


def input_files(path: str | os.PathLike) -> list[list]:
    """``[[resolved path], [relative path, size, mtime_ns], ...]`` of every file under a directory (sorted), or
    ``[[resolved path, size, mtime_ns]]`` of a file."""
    path = Path(path)
    if path.is_file():
        stat = path.stat()
        return [[str(path.resolve()), stat.st_size, stat.st_mtime_ns]]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            file = Path(dirpath) / name
            try:
                stat = file.stat()
            except OSError:  # a dangling link: not an input
                continue
            found.append([file.relative_to(path).as_posix(), stat.st_size, stat.st_mtime_ns])
    return [[str(path.resolve())], *found]


def _source_inputs(source: Mapping[str, Any]) -> list[list] | None:
    path = source.get("path")
    if source.get("kind", "stdlib") == "stdlib":  # the corpus's own file selection (site-packages skipped)
        from dsv4.data.sources import stdlib_files

        root = Path(path if path is not None else sysconfig.get_paths()["stdlib"])
        return [[str(root.resolve())]] + [[f.relative_to(root).as_posix(), f.stat().st_size, f.stat().st_mtime_ns]
                                          for f in stdlib_files(root)]
    return input_files(path) if path is not None and Path(path).exists() else None


def prepared_fingerprint(source: Mapping[str, Any], seq_len: int, shard_multiple: int, overlong: str,
                         pad_id: int = 0, val_split: tuple[float, int] | None = None) -> dict[str, Any]:
    """Everything the prepared rows of ``source`` (keyword arguments of :func:`~dsv4.data.build_documents`) depend
    on, JSON-serialisable (see the module docstring); ``val_split``: ``(fraction, seed)`` of a held-out split."""
    keys = {k: v for k, v in source.items() if k not in ("tokenizer", "chat_template", "chat_template_file")}
    return {
        "format_version": FORMAT_VERSION,
        "source": json.loads(json.dumps(keys, default=str)),
        "inputs": _source_inputs(source),
        "tokenizer": tokenizer_fingerprint(source.get("tokenizer", "byte")),
        "chat_template": chat_template_fingerprint(source),
        "seq_len": int(seq_len),
        "shard_multiple": int(shard_multiple),
        "overlong": overlong,
        "pad_id": int(pad_id),
        "val_split": None if val_split is None else {"fraction": float(val_split[0]), "seed": int(val_split[1])},
    }


def prepared_path(cache_dir: str | os.PathLike, fingerprint: Mapping[str, Any]) -> Path:
    """``<cache_dir>/<kind>-<first 20 hex digits of the SHA-256 of the fingerprint>``."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]
    return Path(os.path.expanduser(str(cache_dir))) / f"{fingerprint['source'].get('kind', 'stdlib')}-{digest}"

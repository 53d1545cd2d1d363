"""The directory an export writes into: empty, or replaced on request.

An export into a directory that already holds files would leave them beside the new ones (a stale
``model-00001-of-00009.safetensors`` next to a 5-shard export, an old index, an adapter of another run), and a
reader that globs ``*.safetensors`` would mix the two. So a non-empty directory is refused
(:func:`export_dir_problem`, a ``ValueError`` naming the directory and the key) unless the caller asks to
overwrite it; then, after the new files are in place, :func:`remove_stale_files` deletes every file the export did
not write. Overwriting touches only the directory's own entries: a file or a symbolic link (the link itself,
never its target) is removed, nothing is followed or descended into, and a directory holding a subdirectory is
refused even with overwrite (a mistyped path such as the home directory is never emptied).
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

log = logging.getLogger("dsv4")


def export_dir_problem(path: str, *, key: str, overwrite: bool, flag: str) -> str | None:
    """Why ``path`` cannot receive an export, or None when it can: it does not exist, or is an empty directory, or
    (``overwrite``) a directory holding files and symbolic links only. ``key`` names the setting that chose the
    path (``export.hf_dir``), ``flag`` the one that allows overwriting (``export.overwrite=true``)."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return f"`{key}`={path!r} is not a directory"
    entries = sorted(os.scandir(path), key=lambda e: e.name)
    if not entries:
        return None
    subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    if subdirs:
        return (f"`{key}`={path!r} holds the directory {subdirs[0]!r}" + (f" (+{len(subdirs) - 1} more)" if len(subdirs) > 1 else "")
                + f"; an export replaces files only (with {flag}): remove it or choose another directory")
    if overwrite:
        return None
    names = [e.name for e in entries]
    return (f"`{key}`={path!r} is not empty ({len(names)} file(s), e.g. {names[:3]}); the export would leave them "
            f"beside its own files: choose an empty directory, or set {flag} to remove every file the export does "
            "not write")


def check_export_dir(path: str, *, key: str, overwrite: bool, flag: str) -> None:
    """Raise the ``ValueError`` of :func:`export_dir_problem`, if any."""
    problem = export_dir_problem(path, key=key, overwrite=overwrite, flag=flag)
    if problem is not None:
        raise ValueError(problem)


def remove_stale_files(path: str, written: Iterable[str]) -> list[str]:
    """Remove every file and symbolic link directly in ``path`` whose name is not in ``written``; returns the names
    removed (one INFO line lists them). Subdirectories are left alone; links are removed, never followed."""
    keep = set(written)
    removed = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name in keep or entry.is_dir(follow_symlinks=False):
            continue
        os.unlink(entry.path)
        removed.append(entry.name)
    if removed:
        log.info("export overwrite: removed %d file(s) of %s the new export did not write: %s", len(removed), path,
                 removed[:10] + ([f"+{len(removed) - 10} more"] if len(removed) > 10 else []))
    return removed

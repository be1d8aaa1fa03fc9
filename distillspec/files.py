"""Writing a run's files so that a crash never leaves half of one: each file or folder is written beside its place
under a temporary name, then renamed into it (a rename within one file system is atomic), so a reader finds the old
version or the new one, never a mix."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file beside it, flushed to disk, then renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, value: Any, **kw: Any) -> Path:
    """:func:`write_atomic` of ``value`` as JSON (``kw``: :func:`json.dumps`'s, e.g. ``indent``)."""
    return write_atomic(path, json.dumps(value, **kw))


def write_folder(path: str | Path, fill: Callable[[Path], Any]) -> Path:
    """Make the folder ``path`` anew: ``fill(tmp)`` writes its content into a temporary folder beside it, which then
    takes its place (the old folder is moved aside first and removed last)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    old = path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():
        os.replace(old, path)  # a crash between the two renames below: the old folder is still the good one
    try:
        fill(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)  # the old folder comes back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def read_json(path: str | Path) -> Any | None:
    """The JSON in ``path``, or None when there is no such file or it does not parse (cut off while written by an
    older version, or edited by hand)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None

"""Writing a run's files so that a crash never leaves half of one: each file or folder is written beside its place
under a temporary name, then renamed into it (a rename within one file system is atomic), so a reader finds the old
version or the new one, never a mix. One job at a time writes into a folder (:func:`exclusive`)."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from distillspec.errors import DistillSpecError

LOCK = ".lock"  #: the file :func:`exclusive` locks in a run's folder


def cache_root() -> Path:
    """Where the project caches what it makes once (gardens, dequantized models, drafts, assembled GGUF files):
    ``$DISTILLSPEC_CACHE``, else ``$XDG_CACHE_HOME/distillspec``, else ``~/.cache/distillspec``."""
    if os.environ.get("DISTILLSPEC_CACHE"):
        return Path(os.environ["DISTILLSPEC_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "distillspec"


@contextmanager
def exclusive(folder: str | Path) -> Iterator[Path]:
    """Hold ``folder``'s lock while the block runs: a second job pointed at the same folder stops at once with the
    holder's process id, instead of writing its files among this one's. The operating system releases the lock when
    the holder exits, however it exits (a killed job leaves no stale lock)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DistillSpecError(
            f"{folder} is in use by another job (process {holder}): give this one another --output-dir, or wait"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield folder
    finally:
        os.close(fd)


@contextmanager
def one_at_a_time(path: str | Path, waiting: str, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock file ``path`` while the block runs: a second process waits for the first to finish, saying so
    once (``log(waiting)``; printed by default). The operating system releases the lock when the holder exits,
    however it exits."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (log or functools.partial(print, flush=True))(waiting)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


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


class RecordLog:
    """A list of JSON records that is also a file of JSON lines, each appended as it is made (``tail -f`` follows
    it). A checkpoint stores how many records it covers, not the records: each is written once, instead of into every
    checkpoint again (O(steps) bytes instead of O(steps^2)). Opened with ``keep`` records (a checkpoint's count), the
    file is cut back to them: records appended after that checkpoint, by a run that then died, go."""

    def __init__(self, path: str | Path, keep: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        size = 0
        if keep:
            try:
                with self.path.open("rb") as f:
                    for line in f:
                        if len(self.records) == keep:
                            break
                        self.records.append(json.loads(line))
                        size += len(line)
            except (OSError, ValueError) as exc:
                raise DistillSpecError(f"{self.path}: cannot read the {keep} records it needs: {exc}") from None
            if len(self.records) < keep:
                raise DistillSpecError(f"{self.path} holds {len(self.records)} records, its checkpoint counts {keep}")
        with self.path.open("ab") as f:
            f.truncate(size)

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

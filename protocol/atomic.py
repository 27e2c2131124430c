"""Atomic file replacement: a reader sees the old file or the complete new one, never a part.

Every file fedsplit writes for others to read (weight files, history and reports, summaries,
plots, stored uploads) goes through `atomic_path`: write to a temporary file in the target's
folder, fsync it, rename it over the target, fsync the folder. On any error the temporary file
is removed and the previous target is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the filesystem allows fsync on folders)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it replaces ``target`` durably."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def file_version(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(mtime ns, size, inode) of ``path``: a file replaced through `atomic_path` is a new
    inode, so every rewrite changes it (a reader re-reads only then). Raises `OSError` when
    ``path`` cannot be stat'ed."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=_plain))


def _plain(value: Any) -> Any:
    """JSON fallback: numbers as floats/ints, anything else as text."""
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)

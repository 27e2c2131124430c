"""Where files live under ``DATA_DIR/files`` and how they get there (rename + directory fsync).

    files/tmp/                       bodies being received (and Keras files' canonical copies)
    files/rounds/ID/uploads/N.h5     the upload, aggregated: the bytes a site sent (their sha256
                                     is the receipt's) when in fedsplit's layout, checked in place;
                                     a Keras file's canonical fedsplit copy (the sandbox's)
    files/rounds/ID/uploads/N.upload an upload stored before issue 43: the bytes sent (N.h5 then
                                     is the canonical copy)
    files/rounds/ID/template.h5      the admin's template (as N.h5), if any
    files/rounds/ID/model.h5         the aggregate; model.keras.h5 its Keras-layout copy
    files/rounds/ID/report.json      the aggregation report
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from fedsplit.protocol.atomic import fsync_dir, write_json_atomic


class FileStore:
    """Paths of stored files and atomic placement."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"

    def prepare(self) -> None:
        """Create the directories and delete leftovers of interrupted uploads."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        (self.root / "rounds").mkdir(parents=True, exist_ok=True)
        for leftover in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                leftover.unlink()

    def round_dir(self, round_id: int) -> Path:
        """Directory of one round."""
        return self.root / "rounds" / str(round_id)

    def relative(self, path: Path) -> str:
        """Path as stored in the database (relative to the files root)."""
        return str(path.relative_to(self.root))

    def absolute(self, stored: str) -> Path:
        """Path of a stored file from its database value."""
        return self.root / stored

    def place(self, src: Path, dst: Path) -> None:
        """Rename the fsynced ``src`` to ``dst`` and fsync the directory: durable before commit."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        fsync_dir(dst.parent)

    def write_json(self, data: Any, dst: Path) -> None:
        """Write JSON atomically."""
        write_json_atomic(dst, data)

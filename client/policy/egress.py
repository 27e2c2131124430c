"""The hospital's egress log writer: one keyed, chained record per reply it sends.

The format, the key and `verify` are the contract `protocol.egress_log` (which ``fedsplit
site egress`` reads); this module appends. Several ClientApp processes of one hospital may
reply at once: each append holds the log's lock (``fcntl.flock`` on ``egress.lock``), reads the
last record, writes the new line whole with one ``write`` and fsyncs it, then replaces the head
file atomically. A last line left without its newline (a writer that died mid-write: its head
was never written) is cut before the next append, so the chain goes on from the last complete
record.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedsplit.protocol.atomic import fsync_dir
from fedsplit.protocol.egress_log import (
    FIELDS,
    GENESIS,
    LOG_NAME,
    EgressKey,
    locked,
    record_line,
)
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.keyfile import Head

_CHUNK = 64 * 1024


def _last(path: Path) -> Head:
    """The id and hash of the log's last complete record (cutting an incomplete last line)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return Head(0, GENESIS)
    try:
        size = os.fstat(fd).st_size
        tail, end = b"", size
        while end > 0:  # read backwards until the tail holds a whole last line
            start = max(0, end - _CHUNK)
            tail = os.pread(fd, end - start, start) + tail
            end = start
            if tail.count(b"\n") >= 2 or (end == 0 and b"\n" in tail):
                break
        if not tail:
            return Head(0, GENESIS)
        if not tail.endswith(b"\n"):  # a record never finished: its head was never written
            cut = tail.rfind(b"\n") + 1
            os.ftruncate(fd, end + cut)
            os.fsync(fd)
            tail = tail[:cut]
            if not tail:
                return Head(0, GENESIS)
        line = tail[:-1].rsplit(b"\n", 1)[-1]
    finally:
        os.close(fd)
    try:
        record = json.loads(line)
        return Head(int(record["id"]), str(record["hash"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"The egress log's last line is not a record, so no record can follow "
                          f"it: run `fedsplit site egress --state-dir {path.parent} --verify` "
                          f"and restore the log. Received: {line[:120]!r}") from e


def append(folder: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Append one record (``fields``: `protocol.egress_log.FIELDS` but id, at and prev_hash,
    which are set here) to the egress log in state folder ``folder``; return it sealed."""
    folder = Path(folder)
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ConfigError(f"An egress record holds only {list(FIELDS)}. Received: {unknown}")
    path = folder / LOG_NAME
    with locked(folder):
        key = EgressKey.open(folder, create=True)
        last = _last(path)
        record = key.seal({**fields, "id": last.id + 1,
                           "at": datetime.now(UTC).isoformat(timespec="microseconds"),
                           "prev_hash": last.hash})
        data = (record_line(record) + "\n").encode("ascii")
        new = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            written = os.write(fd, data)
            if written != len(data):  # a short write: finish it (still under the lock)
                view = memoryview(data)[written:]
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            fsync_dir(folder)
        key.write_head(Head(record["id"], record["hash"]))
    return record

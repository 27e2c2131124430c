"""A secret key kept in a file of its own (mode 0600): the admin audit log's and a hospital's
egress log's HMAC keys (`server.admin.auditkey`, `protocol.egress_log`).

`read_key` creates the file on first use (exclusively: of two processes, one makes it, the
other reads it) and refuses, in one line, a file others may read, one it cannot read, and one
that holds no key of the expected length.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from fedsplit.protocol.atomic import fsync_dir
from fedsplit.protocol.errors import ConfigError


def read_key(path: Path, *, create: bool, nbytes: int, name: str, records: str,
             made_by: str, restore: str) -> bytes:
    """The key in ``path`` (``nbytes`` random bytes as hex; created there, 0600, when ``create``
    and it is missing). ``name`` ("The audit log's key file"), ``records`` (what a reader of it
    could forge), ``made_by`` (what creates it and where to point) and ``restore`` (where a
    damaged one comes back from) word the refusals."""
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(nbytes) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(path.parent)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"{name} cannot be read ({e.strerror}): {made_by}. "
                          f"Received: {path}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{name} may be read by other users (mode {stat.S_IMODE(mode):o}); "
                          f"anyone who reads it can forge {records}. Run `chmod 600 {path}`. "
                          f"Received: {path}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < nbytes:
        raise ConfigError(f"{name} does not hold a key ({nbytes * 2} hex digits): {restore}. "
                          f"Received: {path}")
    return secret

"""A secret key kept in a file of its own (mode 0600): the admin audit log's and a hospital's
egress log's HMAC keys (`server.admin.auditkey`, `protocol.egress_log`).

`read_key` creates the file on first use (exclusively: of two processes, one makes it, the
other reads it) and refuses, in one line, a file others may read, one it cannot read, and one
that holds no key of the expected length. `LogKey` is what both logs do with their key: MAC
each record's hash, and keep a *head file* beside the key (the id and hash of the last record
it signed, itself MAC'd), so records deleted from the log's end are caught.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fedsplit.protocol.atomic import atomic_path, fsync_dir
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


@dataclass(frozen=True)
class Head:
    """The last record a key signed: its id and hash."""

    id: int
    hash: str


class LogKey:
    """A log's HMAC key: MACs its records' hashes and keeps its head file."""

    #: how refusals name the head file, e.g. "The audit key's head file"
    head_name: ClassVar[str]

    def __init__(self, path: Path, secret: bytes, head_path: Path) -> None:
        self.path = path
        self.head_path = head_path
        self._secret = secret

    def mac(self, record_hash: str) -> str:
        """HMAC-SHA256 of a record's hash (which covers its fields, its id and the previous
        record's hash)."""
        return hmac.new(self._secret, b"record:" + record_hash.encode("ascii"),
                        hashlib.sha256).hexdigest()

    def valid(self, record_hash: str, mac: object) -> bool:
        """Whether ``mac`` is this key's MAC of ``record_hash``."""
        return isinstance(mac, str) and hmac.compare_digest(self.mac(record_hash), mac)

    def _head_mac(self, head: Head) -> str:
        return hmac.new(self._secret, f"head:{head.id}:{head.hash}".encode("ascii"),
                        hashlib.sha256).hexdigest()

    def read_head(self) -> Head | None:
        """The head file's record; None when there is none; `ConfigError` when it is damaged or
        its MAC is not this key's."""
        try:
            data = json.loads(self.head_path.read_text())
            head = Head(int(data["id"]), str(data["hash"]))
            mac = str(data["mac"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{self.head_name} is damaged ({e}); records deleted from the "
                              f"log's end cannot be told. Received: {self.head_path}") from e
        if not hmac.compare_digest(self._head_mac(head), mac):
            raise ConfigError(f"{self.head_name} was not written with this key (its MAC does not "
                              f"match): it was edited or belongs to another key. "
                              f"Received: {self.head_path}")
        return head

    def write_head(self, head: Head) -> None:
        """Note ``head`` as the last record (atomically; the file is 0600)."""
        with atomic_path(self.head_path) as tmp:
            tmp.write_text(json.dumps({"id": head.id, "hash": head.hash,
                                       "mac": self._head_mac(head)}))

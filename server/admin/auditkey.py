"""The audit log's key: HMAC-SHA256 over each record, with a key the database does not hold.

Anyone who can write the database could append records with recomputed SHA-256 hashes and pass
the unkeyed chain's check, or delete every record and leave "intact: 0 record(s)". With a key
kept outside the database (a file the operator holds, `DEFAULT_KEY_NAME` in the data directory
unless ``--audit-key-file``/``FEDSPLIT_AUDIT_KEY_FILE`` names another place), each record carries
``mac`` = HMAC-SHA256(key, its hash), which nobody without the key can make, and the key's
*head file* (``KEY.head``, beside it) holds the id and hash of the last record the key signed,
itself MAC'd, so records deleted from the end (all of them included) are caught without a head
noted by hand.

`fedsplit admin serve` (or the first command that writes the log) creates the key with mode
0600; a key file others may read is refused. `verify` only reads it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.keyfile import read_key

DEFAULT_KEY_NAME = "audit.key"
KEY_FILE_ENV = "FEDSPLIT_AUDIT_KEY_FILE"
_KEY_BYTES = 32


def key_path(data_dir: Path, configured: Path | None = None) -> Path:
    """Where the key lives: ``configured``, else ``FEDSPLIT_AUDIT_KEY_FILE``, else the data
    directory's `DEFAULT_KEY_NAME`; always absolute."""
    chosen = configured or (Path(os.environ[KEY_FILE_ENV]) if os.environ.get(KEY_FILE_ENV) else None)
    return (chosen or Path(data_dir) / DEFAULT_KEY_NAME).expanduser().resolve()


@dataclass(frozen=True)
class Head:
    """The last record a key signed: its id and hash."""

    id: int
    hash: str


class AuditKey:
    """One key: MACs records and keeps its head file."""

    def __init__(self, path: Path, secret: bytes) -> None:
        self.path = path
        self._secret = secret

    @property
    def head_path(self) -> Path:
        """The head file beside the key."""
        return self.path.with_name(self.path.name + ".head")

    @classmethod
    def open(cls, path: Path, *, create: bool) -> AuditKey:
        """Read the key at ``path`` (creating it, mode 0600, when ``create`` and it is missing)."""
        return cls(path, read_key(
            path, create=create, nbytes=_KEY_BYTES, name="The audit log's key file",
            records="audit records",
            made_by=f"`fedsplit admin serve` creates it on first start; point --audit-key-file "
                    f"(or {KEY_FILE_ENV}) at it",
            restore="restore it from the operator's copy"))

    def mac(self, record_hash: str) -> str:
        """HMAC-SHA256 of a record's hash (which covers every other field, its id and the
        previous record's hash)."""
        return hmac.new(self._secret, b"record:" + record_hash.encode("ascii"), hashlib.sha256).hexdigest()

    def valid(self, record_hash: str, mac: str | None) -> bool:
        """Whether ``mac`` is this key's MAC of ``record_hash``."""
        return mac is not None and hmac.compare_digest(self.mac(record_hash), mac)

    def _head_mac(self, head: Head) -> str:
        message = f"head:{head.id}:{head.hash}".encode("ascii")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def read_head(self) -> Head | None:
        """The head file's record, None when there is no head file; `ConfigError` when it is
        damaged or its MAC is wrong."""
        try:
            data = json.loads(self.head_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise self._damaged(e) from e
        try:
            head = Head(int(data["id"]), str(data["hash"]))
            mac = str(data["mac"])
        except (KeyError, TypeError, ValueError) as e:
            raise self._damaged(e) from e
        if not hmac.compare_digest(self._head_mac(head), mac):
            raise ConfigError(
                f"The audit key's head file was not written with this key (its MAC does not match): "
                f"it was edited or belongs to another key. Received: {self.head_path}")
        return head

    def _damaged(self, error: Exception) -> ConfigError:
        return ConfigError(f"The audit key's head file is damaged ({error}); the audit log cannot be "
                           f"checked for records deleted from its end. Received: {self.head_path}")

    def advance(self, head: Head) -> None:
        """Note ``head`` as the last signed record (atomically, 0600; never moving backwards)."""
        try:
            current = self.read_head()
        except ConfigError:
            current = None
        if current is not None and current.id >= head.id:
            return
        tmp = self.head_path.with_name(f"{self.head_path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"id": head.id, "hash": head.hash, "mac": self._head_mac(head)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.head_path)

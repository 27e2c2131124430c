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

from pathlib import Path

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.keyfile import Head, LogKey, read_key

DEFAULT_KEY_NAME = "audit.key"
KEY_FILE_ENV = "FEDSPLIT_AUDIT_KEY_FILE"
_KEY_BYTES = 32


def key_path(data_dir: Path, configured: Path | None = None) -> Path:
    """Where the key lives: ``configured`` (``--audit-key-file``, or ``FEDSPLIT_AUDIT_KEY_FILE``
    read by the command's option), else the data directory's `DEFAULT_KEY_NAME`; always
    absolute."""
    return (configured or Path(data_dir) / DEFAULT_KEY_NAME).expanduser().resolve()


class AuditKey(LogKey):
    """One key: MACs records and keeps its head file (``KEY.head``, beside it)."""

    head_name = "The audit key's head file"

    @classmethod
    def open(cls, path: Path, *, create: bool) -> AuditKey:
        """Read the key at ``path`` (creating it, mode 0600, when ``create`` and it is missing)."""
        return cls(path, read_key(
            path, create=create, nbytes=_KEY_BYTES, name="The audit log's key file",
            records="audit records",
            made_by=f"`fedsplit admin serve` creates it on first start; point --audit-key-file "
                    f"(or {KEY_FILE_ENV}) at it",
            restore="restore it from the operator's copy"), path.with_name(path.name + ".head"))

    def advance(self, head: Head) -> None:
        """Note ``head`` as the last signed record (atomically, 0600; never moving backwards)."""
        try:
            current = self.read_head()
        except ConfigError:
            current = None
        if current is not None and current.id >= head.id:
            return
        self.write_head(head)

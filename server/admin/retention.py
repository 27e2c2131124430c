"""What the server keeps of replaced uploads, and how much one hospital may store.

A re-upload replaces the hospital's earlier upload of the round: the earlier one's row stays (its
time, sha256, size, count: the history and the audit log keep them), its files are deleted once
the new upload is committed (`prune_files`). Three uploads to one round kept three copies
(3 GiB from a 1 MiB gzip file each) before. At start, files of uploads replaced earlier (by a
server that kept them, or one that crashed before deleting them) are deleted as well
(`prune_replaced`).

`stored_bytes`: what a hospital holds in rounds still open (its current uploads' original and
canonical files), which the per-hospital quota (``--site-quota-mb``) bounds.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fedsplit.protocol.atomic import fsync_dir
from fedsplit.server.admin.storage import FileStore
from fedsplit.server.admin.tables import Round, Upload
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

OPEN = "open"


def upload_paths(files: FileStore, upload: Upload) -> list[Path]:
    """The stored files of one upload, each once: one file since issue 43 (the bytes sent, or a
    Keras file's canonical copy); an older upload's original bytes and canonical copy."""
    return [files.absolute(p) for p in dict.fromkeys((upload.original_file, upload.weights_file)) if p]


def prune_files(files: FileStore, upload: Upload) -> None:
    """Delete a replaced upload's files (its row stays); durable when this returns."""
    folders = set()
    for path in upload_paths(files, upload):
        if path.exists():
            path.unlink(missing_ok=True)
            folders.add(path.parent)
    for folder in folders:
        fsync_dir(folder)


def prune_replaced(files: FileStore, sessions: sessionmaker[Session]) -> int:
    """Delete the files every replaced upload still has; return how many files went."""
    removed = 0
    with sessions() as session:
        for upload in session.scalars(select(Upload).where(Upload.current.is_(False))):
            present = [p for p in upload_paths(files, upload) if p.exists()]
            if present:
                prune_files(files, upload)
                removed += len(present)
    if removed:
        log.info("deleted %d file(s) of replaced uploads", removed)
    return removed


def stored_bytes(session: Session, files: FileStore, site_id: int, *, besides: int | None = None) -> int:
    """Bytes of ``site_id``'s current uploads in open rounds (``besides``: an upload id left out,
    the one being replaced)."""
    total = 0
    uploads = session.scalars(
        select(Upload).join(Round, Upload.round_id == Round.id)
        .where(Upload.site_id == site_id, Upload.current.is_(True), Round.status == OPEN))
    for upload in uploads:
        if upload.id == besides:
            continue
        for path in upload_paths(files, upload):
            try:
                total += path.stat().st_size
            except OSError:
                continue
    return total

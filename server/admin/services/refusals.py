"""Refused uploads: recorded once, by the upload route where it refuses one; listed for the API's
readers and the web view.

The upload route stores nothing of a file it refuses (by design: no partial state). So that an
operator can still see who tried to send what and why, `record_refusal` keeps one
`tables.RefusedUpload` row: who (the site, or "admin"), the round, the file name the client gave,
its size and sha256 (None when reading stopped early, e.g. over the size limit), the HTTP status,
the error class, its ``reason`` code and message. The same call counts the refusal
(``fedsplit_uploads_refused_total``) and writes its audit record.

Only refusals of a known identity reach the route (a request without a valid token is refused
before its body is read and only counted, ``fedsplit_unauthenticated_refused_total``), so
anonymous noise cannot push real refusals out. The table keeps the newest `MAX_ROWS` rows per
identity: one hospital's refusals never evict another's or the admin's.
"""

from __future__ import annotations

import logging

from fedsplit.protocol.errors import FedsplitError
from fedsplit.server.admin.auth import ADMIN, Principal
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.errors import UploadRefusedError, UploadTooLargeError, status_of
from fedsplit.server.admin.receive import ReceiveProgress
from fedsplit.server.admin.tables import RefusedUpload
from sqlalchemy import ColumnElement, delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

#: Refusals kept per identity (each site, and the admin).
MAX_ROWS = 5000
MAX_DETAIL = 2000

log = logging.getLogger(__name__)


def reason_of(error: FedsplitError) -> str:
    """The refusal's reason code: the error's own (`UploadRefusedError`, a weight file's),
    ``too_large``, or the error class without "Error" (``permissiondenied``, ``conflict``, ...)."""
    if isinstance(error, UploadTooLargeError):
        return "too_large"
    own = getattr(error, "reason", None)
    if isinstance(error, UploadRefusedError) or (isinstance(own, str) and own):
        return str(own)
    return type(error).__name__.removesuffix("Error").lower()


def record_refusal(ctx: AdminContext, *, principal: Principal, round_id: int, error: FedsplitError,
                   read: ReceiveProgress, address: str | None) -> None:
    """Record one refused upload: its row, the refusal counter and the audit record.

    Called by the upload route (in a worker thread) with the error it answers. A database
    failure while storing the row is logged, not raised: the refusal was answered, only its
    row is lost (the counter and the audit record are written first)."""
    reason = reason_of(error)
    ctx.metrics.upload_refused(reason, read.size)
    ctx.record("upload_refused", principal, address, round=round_id, reason=reason, size=read.size)
    body_reason = getattr(error, "reason", None)
    who = ADMIN if principal.role == ADMIN else str(principal.site_name)
    try:
        with ctx.sessions() as session:
            session.add(RefusedUpload(
                round_id=round_id, who=who[:128], site_id=principal.site_id,
                filename=read.filename[:256] if read.filename else None,
                size_bytes=read.size or None, sha256=read.sha256, status_code=status_of(error),
                error=type(error).__name__[:64], reason=str(body_reason)[:64] if body_reason else None,
                detail=str(error)[:MAX_DETAIL] or None,
            ))
            session.flush()
            own = _own(principal)
            oldest_kept = session.scalar(select(RefusedUpload.id).where(own)
                                         .order_by(RefusedUpload.id.desc()).offset(MAX_ROWS - 1))
            if oldest_kept is not None:
                session.execute(delete(RefusedUpload).where(own, RefusedUpload.id < oldest_kept))
            session.commit()
    except SQLAlchemyError as e:
        log.error("could not record a refused upload of round %s: %s", round_id, e)


def _own(principal: Principal) -> ColumnElement[bool]:
    return (RefusedUpload.site_id == principal.site_id if principal.site_id is not None
            else RefusedUpload.site_id.is_(None))


def list_refusals(session: Session, principal: Principal, *, round_ids: list[int] | None = None,
                  limit: int = 200) -> list[RefusedUpload]:
    """The newest ``limit`` refusals ``principal`` may see (the admin: all; a site: its own), of
    ``round_ids`` (None: every round), newest first."""
    query = select(RefusedUpload).order_by(RefusedUpload.id.desc()).limit(limit)
    if round_ids is not None:
        query = query.where(RefusedUpload.round_id.in_(round_ids))
    if principal.role != ADMIN:
        query = query.where(RefusedUpload.site_id == principal.site_id)
    return list(session.scalars(query))

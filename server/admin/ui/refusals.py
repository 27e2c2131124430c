"""Refused uploads, recorded for the web view by an ASGI middleware around the upload route.

The upload route stores nothing when it refuses a file (by design: no partial state). So that
an operator can still see who tried to send what and why it was refused, this middleware
watches ``POST /api/v1/rounds/{id}/uploads``: it hashes the multipart ``file`` part as the
route reads it (the same bytes, never a second read), captures the response status and the
JSON error body, and when the status is 4xx/5xx stores one `RefusedUpload` row: who (site name
from the bearer token, "admin", or "unknown token"), the round, the file name the client gave,
its size and sha256 (None when the route stopped reading early, e.g. 413), the error class,
its ``reason`` code and message.

Only refusals of a known identity (the admin or a live site) are stored: a request without a
valid token is refused by `limits.RequestGuard` before its body is read and is only counted
(``fedsplit_unauthenticated_refused_total``), so anonymous noise cannot push real refusals out.
The table keeps the newest `MAX_ROWS` rows per identity: one hospital's refusals never evict
another's or the admin's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from datetime import datetime
from typing import Any

from fedsplit.server.admin.auth import ADMIN, authenticate
from fedsplit.server.admin.errors import AuthenticationError
from fedsplit.server.admin.tables import utcnow
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy import DateTime, Engine, Integer, String, Text, delete, inspect, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UPLOAD_PATH = re.compile(r"^/api/v1/rounds/(\d{1,18})/uploads/?$")
MAX_ROWS = 5000
MAX_BODY_CAPTURE = 64 * 1024
MAX_DETAIL = 2000

log = logging.getLogger(__name__)


class UIBase(DeclarativeBase):
    """Declarative base of the web view's own tables (created beside the admin tables)."""


# One refused upload attempt (the admin tables store accepted uploads only).
class RefusedUpload(UIBase):
    __tablename__ = "ui_refused_uploads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    who: Mapped[str] = mapped_column(String(128), index=True)
    #: the site's row id (None: the admin); hospitals see the rows with their own id
    site_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    filename: Mapped[str | None] = mapped_column(String(256), nullable=True)
    size_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status_code: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(String(64), nullable=True)
    reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


def create_tables(engine: Engine) -> None:
    """Create the web view's tables, adding columns later versions introduced."""
    UIBase.metadata.create_all(engine)
    present = {c["name"] for c in inspect(engine).get_columns(RefusedUpload.__tablename__)}
    if "site_id" not in present:
        with engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {RefusedUpload.__tablename__} ADD COLUMN site_id INTEGER"))


def make_hasher(content_type: str) -> FileHasher | None:
    """A `FileHasher` for a multipart body of ``content_type``; None when it cannot be parsed
    (not multipart, no boundary, or a boundary python-multipart refuses)."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        return None
    try:
        return FileHasher(boundary)
    except (ValueError, MultipartParseError):  # e.g. a boundary over 256 characters
        return None


class FileHasher:
    """Push-parses a multipart body and hashes its ``file`` part (name, size, sha256)."""

    def __init__(self, boundary: bytes) -> None:
        self.digest = hashlib.sha256()
        self.size = 0
        self.filename: str | None = None
        self.complete = False
        self.broken = False
        self._field = b""
        self._value = b""
        self._disposition = b""
        self._in_file = False
        self._files = 0
        callbacks = {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }
        self._parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]

    def feed(self, chunk: bytes, *, last: bool) -> None:
        """Parse the next body chunk."""
        if self.broken:
            return
        try:
            self._parser.write(chunk)
            if last:
                self._parser.finalize()
        except MultipartParseError:
            self.broken = True

    def _part_begin(self) -> None:
        self._disposition, self._in_file = b"", False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._field.strip().lower() == b"content-disposition":
            self._disposition = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if options.get(b"name") == b"file":
            self._files += 1
            self._in_file = self._files == 1
            raw = options.get(b"filename")
            if self._in_file and raw is not None:
                self.filename = raw.decode("utf-8", "replace")[:256]

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.digest.update(data[start:end])
            self.size += end - start

    def _part_end(self) -> None:
        if self._in_file:
            self.complete = True
            self._in_file = False

    @property
    def sha256(self) -> str | None:
        """The file part's digest, when the whole part was read."""
        return self.digest.hexdigest() if self.complete and not self.broken else None


class RefusalRecorder:
    """ASGI middleware: records refused uploads (see the module docstring)."""

    def __init__(self, app: ASGIApp, ctx: Any) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request through; record it afterwards if it was a refused upload."""
        match = UPLOAD_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        hasher = make_hasher(headers.get("content-type", ""))
        seen = {"status": 0, "body": b"", "bytes": 0}

        async def tee_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                seen["bytes"] += len(chunk)
                if hasher is not None:
                    hasher.feed(chunk, last=not message.get("more_body", False))
            return message

        async def capture_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and seen["status"] >= 400:
                seen["body"] = (seen["body"] + message.get("body", b""))[:MAX_BODY_CAPTURE]
            await send(message)

        try:
            await self.app(scope, tee_receive, capture_send)
        finally:
            if seen["status"] >= 400:
                try:
                    await run_in_threadpool(
                        self._record, int(match.group(1)), headers.get("authorization"), hasher, seen
                    )
                except SQLAlchemyError as e:  # the refusal was answered; only its record is lost
                    log.error("could not record a refused upload of round %s: %s", match.group(1), e)

    def _record(self, round_id: int, authorization: str | None, hasher: FileHasher | None,
                seen: dict[str, Any]) -> None:
        try:
            body = json.loads(seen["body"] or b"{}")
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        token = authorization[7:].strip() if authorization and authorization[:7].lower() == "bearer " \
            else None
        with self.ctx.sessions() as session:
            try:
                principal = authenticate(token, session=session,
                                         admin_token_hash=self.ctx.admin_token_hash)
            except AuthenticationError:
                return  # no identity: counted by the request guard, never stored
            who = "admin" if principal.role == ADMIN else str(principal.site_name)
            size = hasher.size if hasher is not None and hasher.size else None
            session.add(RefusedUpload(
                round_id=round_id, who=who, site_id=principal.site_id,
                filename=hasher.filename if hasher is not None else None,
                size_bytes=size, sha256=hasher.sha256 if hasher is not None else None,
                status_code=int(seen["status"]),
                error=str(body.get("error"))[:64] if body.get("error") else None,
                reason=str(body.get("reason"))[:64] if body.get("reason") else None,
                detail=str(body.get("detail"))[:MAX_DETAIL] if body.get("detail") else None,
            ))
            session.flush()
            own = (RefusedUpload.site_id == principal.site_id if principal.site_id is not None
                   else RefusedUpload.site_id.is_(None))
            oldest_kept = session.scalar(select(RefusedUpload.id).where(own)
                                         .order_by(RefusedUpload.id.desc()).offset(MAX_ROWS - 1))
            if oldest_kept is not None:
                session.execute(delete(RefusedUpload).where(own, RefusedUpload.id < oldest_kept))
            session.commit()

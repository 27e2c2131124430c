"""Streams a multipart upload to a temporary file, enforcing the size limit as bytes arrive.

FastAPI's ``UploadFile`` would spool the whole body before the handler runs; this reads
``request.stream()`` chunk by chunk through python-multipart's push parser, hashes and writes
the ``file`` part to a temp file in the files directory and stops at the first byte over the
limit (HTTP 413), so an oversized or endless body never fills the disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fedsplit.server.admin.errors import (
    InsufficientStorageError,
    UploadRefusedError,
    UploadTooLargeError,
)
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

FILE_FIELD = "file"
_FORM_FIELD_MAX = 1024
_MAX_FIELDS = 16
# Multipart framing and small form fields ride on top of the file's bytes.
BODY_OVERHEAD = 64 * 1024
#: Free space an upload must leave on the files directory's disk (the database, the aggregate).
DISK_RESERVE = 256 * 1024 * 1024


@dataclass
class ReceivedUpload:
    """A fully received upload: the temp file, its digest and size, and the other form fields."""

    path: Path
    sha256: str
    size: int
    filename: str | None
    fields: dict[str, str] = field(default_factory=dict)


@dataclass
class ReceiveProgress:
    """What `receive_upload` had read of the ``file`` part when it returned or refused: the
    client's file name, the bytes of file data, and their sha256 once the whole part was read
    (None when reading stopped early, e.g. over the size limit). A refused upload is recorded
    with these (`services.refusals`)."""

    filename: str | None = None
    size: int = 0
    sha256: str | None = None


def too_large(limit: int, received: str) -> UploadTooLargeError:
    """The 413 error."""
    return UploadTooLargeError(
        f"The upload is larger than this server's limit of {limit} bytes "
        f"({limit / 1024 / 1024:g} MiB). Upload the round's model only (no optimizer state), or "
        f"ask the coordinator to raise --max-upload-mb. Received: {received}"
    )


def check_disk_space(folder: Path, needed: int, reserve: int = DISK_RESERVE) -> None:
    """Refuse (HTTP 507) an upload of ``needed`` bytes that would leave less than ``reserve`` free
    on ``folder``'s disk: checked before the body is read, so a full disk costs the sender a
    refusal, not a transfer that fails at its end."""
    free = shutil.disk_usage(folder).free
    if needed + reserve > free:
        raise InsufficientStorageError(
            f"The server has {free} bytes free on its files disk, too few for an upload of "
            f"{needed} bytes (it keeps {reserve} bytes free). Ask the coordinator to free space "
            f"(aggregate or close finished rounds) or to move --data-dir to a larger disk, then "
            f"send it again. Received: {needed} bytes"
        )


class _Collector:
    def __init__(self, tmp_dir: Path, limit: int) -> None:
        self.limit = limit
        self.path = tmp_dir / f"{uuid.uuid4().hex}.part"
        self.digest = hashlib.sha256()
        self.size = 0
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_parts = 0
        self.error: Exception | None = None
        self._fh: IO[bytes] | None = None
        self._header_field = b""
        self._header_value = b""
        self._disposition = b""
        self._name: str | None = None
        self._is_file = False
        self._buffer = bytearray()

    # python-multipart callbacks ---------------------------------------------------------
    def on_part_begin(self) -> None:
        self._disposition = b""
        self._name, self._is_file = None, False
        self._buffer.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_field.strip().lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_field, self._header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        self._name = name.decode("utf-8", "replace") if name is not None else None
        if self._name == FILE_FIELD:
            self._is_file = True
            self.file_parts += 1
            if self.file_parts > 1:
                self._fail(
                    UploadRefusedError(
                        "The upload holds more than one 'file' part; send one weight file per "
                        "request. Received: 2 or more file parts",
                        "bad_request",
                    )
                )
                return
            raw = options.get(b"filename")
            self.filename = raw.decode("utf-8", "replace") if raw is not None else None
            # 0600 whatever the umask: another user of the machine reads no hospital's weights
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self._fh = os.fdopen(fd, "wb")  # (closed in finish/cleanup)
        elif len(self.fields) >= _MAX_FIELDS:
            self._fail(
                UploadRefusedError(
                    f"The upload holds more than {_MAX_FIELDS} form fields; send 'file' and "
                    f"optionally 'num_examples'. Received: > {_MAX_FIELDS} fields",
                    "bad_request",
                )
            )

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        chunk = data[start:end]
        if self._is_file and self._fh is not None:
            self.size += len(chunk)
            if self.size > self.limit:
                self._fail(too_large(self.limit, f"more than {self.limit} bytes of file data"))
                return
            self.digest.update(chunk)
            self._fh.write(chunk)
        else:
            self._buffer += chunk
            if len(self._buffer) > _FORM_FIELD_MAX:
                self._fail(
                    UploadRefusedError(
                        f"Form field {self._name!r} is longer than {_FORM_FIELD_MAX} bytes; only "
                        f"'file' may be large. Received: > {_FORM_FIELD_MAX} bytes",
                        "bad_request",
                    )
                )

    def on_part_end(self) -> None:
        if not self._is_file and self._name is not None and self.error is None:
            self.fields[self._name] = self._buffer.decode("utf-8", "replace")

    # ------------------------------------------------------------------------------------
    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error

    def finish(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def cleanup(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.path.unlink(missing_ok=True)


async def receive_upload(request: Request, tmp_dir: Path, limit: int,
                         progress: ReceiveProgress | None = None) -> ReceivedUpload:
    """Read the multipart body into a temp file; raise 413/422 errors, leaving nothing behind.

    ``progress``, when given, holds what was read of the file part however this ends."""
    progress = progress if progress is not None else ReceiveProgress()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + BODY_OVERHEAD:
        raise too_large(limit, f"Content-Length {declared}")
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise UploadRefusedError(
            "Uploads are multipart/form-data with the weight file in field 'file' (curl -F "
            "file=@model.h5 -F num_examples=1200). Received: Content-Type "
            f"{request.headers.get('content-type', '(none)')!r}",
            "bad_request",
        )
    tmp_dir.mkdir(parents=True, exist_ok=True)
    # the whole upload lands on this disk once (issue 43): room for its declared size, else the limit
    check_disk_space(tmp_dir, int(declared) if declared is not None and declared.isdigit() else limit)
    collector = _Collector(tmp_dir, limit)
    callbacks = {
        name: getattr(collector, name)
        for name in (
            "on_part_begin", "on_header_field", "on_header_value", "on_header_end",
            "on_headers_finished", "on_part_data", "on_part_end",
        )
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    except (ValueError, MultipartParseError) as e:  # e.g. a boundary over 256 characters
        raise UploadRefusedError(
            f"The multipart boundary cannot be used ({e}); send the upload with curl -F or "
            f"`fedsplit upload`, which pick a short boundary. Received: a boundary of "
            f"{len(boundary)} bytes",
            "bad_request",
        ) from None
    body = 0
    try:
        async for chunk in request.stream():
            body += len(chunk)
            parser.write(chunk)
            if collector.error is not None:
                raise collector.error
            if body > limit + BODY_OVERHEAD:
                raise too_large(limit, f"a body of more than {limit + BODY_OVERHEAD} bytes")
        parser.finalize()
        if collector.error is not None:
            raise collector.error
        if collector.file_parts == 0:
            raise UploadRefusedError(
                "The upload has no 'file' field; send the weight file as multipart field 'file' "
                "(curl -F file=@model.h5). Received: fields "
                f"{sorted(collector.fields) or 'none'}",
                "bad_request",
            )
        collector.finish()
    except MultipartParseError as e:
        progress.filename, progress.size = collector.filename, collector.size
        collector.cleanup()
        raise UploadRefusedError(
            f"The multipart body is malformed ({e}); send it with curl -F or `fedsplit upload`. "
            f"Received: {type(e).__name__}",
            "bad_request",
        ) from None
    except BaseException:
        progress.filename, progress.size = collector.filename, collector.size
        collector.cleanup()
        raise
    progress.filename, progress.size = collector.filename, collector.size
    progress.sha256 = collector.digest.hexdigest()
    return ReceivedUpload(
        path=collector.path,
        sha256=collector.digest.hexdigest(),
        size=collector.size,
        filename=collector.filename,
        fields=collector.fields,
    )

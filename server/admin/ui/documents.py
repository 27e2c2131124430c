"""Reading a run folder's JSON document for a page (km.json, cox.json): size-capped, and a note
for the page (never an exception) when it is too large, half-written or not valid."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError


@dataclass(frozen=True)
class ReadDocument:
    """The parsed JSON content, or the note that says why there is none."""

    data: Any = None
    note: str | None = None


def read_document(path: Path, max_bytes: int, usual_size: str) -> ReadDocument | None:
    """``path`` parsed as JSON; None when there is no such file. ``usual_size`` says what such a
    document weighs (e.g. "a published curve is kilobytes") in the too-large note."""
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size > max_bytes:
        return ReadDocument(note=f"{path.name} is too large to show (at most {max_bytes // 2**20} MiB; "
                                 f"{usual_size}). Received: {size:,} bytes")
    try:
        return ReadDocument(data=json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        return ReadDocument(note=f"{path.name} could not be read as JSON; it may still be being "
                                 f"written (the page retries) or be damaged. Received: {type(e).__name__}")


def first_error(error: ValidationError) -> str:
    """Where and what the first validation error is, for a one-line note."""
    first = error.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "the file"
    return f"{where}: {first.get('msg', 'invalid')}"

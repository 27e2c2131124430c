"""The survival analyses' documents beside a run's ``history.json`` (``km.json``: the pooled
Kaplan-Meier curve; ``cox.json``: the federated Cox fit), read for a page through their models
(`protocol.record.survival`: `KMDocument`, `CoxDocument`, the only shape of each file).

``fedsplit km --out DIR`` writes ``DIR/km.json`` (beside its status file ``DIR/history.json``);
``fedsplit simulate --task survival`` writes ``OUT/federation/km.json`` beside the run record;
``fedsplit cox --out DIR`` writes ``DIR/cox.json``.

A file that is missing gives None; one that is too large, half-written, not JSON or not of its
model's shape gives a `DocumentView` with a ``note`` saying what is wrong (the page shows the
note, never an error 500).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from fedsplit.protocol.record.survival import (
    COX_FILE,
    KM_FILE,
    CoxDocument,
    KMDocument,
    SurvivalDocument,
)

__all__ = ["COX_FILE", "KM_FILE", "CoxView", "DocumentView", "KMView", "read_cox", "read_km"]

#: a published curve or a Cox fit is kilobytes: a larger file is not shown
MAX_DOCUMENT_BYTES = 8 * 1024 * 1024

D = TypeVar("D", bound=SurvivalDocument)


@dataclass(frozen=True)
class DocumentView(Generic[D]):
    """What a page shows of a document: the document, or a note why it is not shown."""

    doc: D | None
    note: str | None = None


KMView = DocumentView[KMDocument]
CoxView = DocumentView[CoxDocument]


def read_view(folder: Path, model: type[D]) -> DocumentView[D] | None:
    """``folder``'s file of ``model`` (its ``km.json`` or ``cox.json``) checked
    (`SurvivalDocument.checked`); None when there is no such file."""
    path = folder / model.file_name()
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size > MAX_DOCUMENT_BYTES:
        return DocumentView(None, f"{path.name} is too large to show (at most "
                                  f"{MAX_DOCUMENT_BYTES // 2**20} MiB; a {model.kind()} is "
                                  f"kilobytes). Received: {size:,} bytes")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return DocumentView(None, f"{path.name} could not be read as JSON; it may still be being "
                                  f"written (the page retries) or be damaged. Received: "
                                  f"{type(e).__name__}")
    doc, note = model.checked(data)
    return DocumentView(doc, note)


def read_km(folder: Path) -> KMView | None:
    """``folder/km.json`` checked; None when there is none."""
    return read_view(folder, KMDocument)


def read_cox(folder: Path) -> CoxView | None:
    """``folder/cox.json`` checked; None when there is none."""
    return read_view(folder, CoxDocument)

"""``km.json`` beside a run's ``history.json``: the pooled Kaplan-Meier curve, read and checked.

``fedsplit km --out DIR`` writes ``DIR/km.json`` (beside its status file ``DIR/history.json``);
``fedsplit simulate --task survival`` writes ``OUT/federation/km.json`` beside the run record.
The format is `server.survival.app.fit_km`'s (docs/survival.md, "Outputs"): ``curve`` holds the
published points (``time``, ``at_risk``, ``events``, ``survival``, ``lower_95``, ``upper_95``,
lists of one length) after the minimum-count rule ``min_count``; ``rows`` and ``events`` are
the pooled totals; ``hospitals`` the names that took part. Undeclared keys are ignored.

A file that is missing gives None; one that is too large, not JSON or not of this shape gives a
`KMView` with a ``note`` saying what is wrong (the page shows the note, never an error 500).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from fedsplit.protocol.survival_summary import KM_FILE
from fedsplit.server.admin.ui.documents import first_error, read_document
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["KM_FILE", "KMView", "read_km"]

#: A published curve has one point per group of at least ``min_count`` events: a few hundred.
MAX_POINTS = 20_000
MAX_KM_BYTES = 8 * 1024 * 1024
CURVE_KEYS = ("time", "at_risk", "events", "survival", "lower_95", "upper_95")


class KMCurveData(BaseModel):
    """The published points of the pooled curve, in time order."""

    model_config = ConfigDict(extra="ignore")

    time: list[float] = Field(max_length=MAX_POINTS)
    at_risk: list[int] = Field(max_length=MAX_POINTS)
    events: list[int] = Field(max_length=MAX_POINTS)
    survival: list[float] = Field(max_length=MAX_POINTS)
    lower_95: list[float] = Field(max_length=MAX_POINTS)
    upper_95: list[float] = Field(max_length=MAX_POINTS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        lengths = {key: len(getattr(self, key)) for key in CURVE_KEYS}
        if len(set(lengths.values())) > 1:
            raise ValueError("the curve's lists must have one length; got "
                             + ", ".join(f"{k} {n}" for k, n in lengths.items()))
        if any(not math.isfinite(t) or t < 0 for t in self.time):
            raise ValueError("every time must be a finite number >= 0")
        if any(b < a for a, b in zip(self.time, self.time[1:], strict=False)):
            raise ValueError("times must be in increasing order")
        if any(n < 0 for n in self.at_risk) or any(d < 0 for d in self.events):
            raise ValueError("counts at risk and events must be >= 0")
        for key in ("survival", "lower_95", "upper_95"):
            if any(not 0.0 <= v <= 1.0 for v in getattr(self, key)):
                raise ValueError(f"every {key} value must lie in [0, 1]")
        return self


class KMDocument(BaseModel):
    """``km.json``: the curve, the pooled totals and the minimum-count rule it was published under."""

    model_config = ConfigDict(extra="ignore")

    curve: KMCurveData
    rows: int = Field(ge=0)
    events: int = Field(ge=0)
    min_count: int = Field(ge=1)
    hospitals: list[str] = Field(default_factory=list, max_length=10_000)


@dataclass
class KMView:
    """What the run page shows of ``km.json``: the document, or a note why it is not shown."""

    doc: KMDocument | None
    note: str | None = None


def parse_km(data: Any) -> KMView:
    """Check parsed ``km.json`` content; a note (never an exception) when it is not a curve."""
    if not isinstance(data, dict):
        return KMView(None, f"{KM_FILE} must hold a JSON object (the output of fedsplit km). "
                            f"Received: {type(data).__name__}")
    try:
        return KMView(KMDocument.model_validate(data))
    except ValidationError as e:
        return KMView(None, f"{KM_FILE} is not a Kaplan-Meier curve written by fedsplit km: "
                            f"{first_error(e)}. Write it again with fedsplit km. "
                            f"Received: keys {', '.join(sorted(map(str, data))[:8]) or 'none'}")


def read_km(folder: Path) -> KMView | None:
    """``folder/km.json`` checked (`parse_km`); None when there is none."""
    read = read_document(folder / KM_FILE, MAX_KM_BYTES, "a published curve is kilobytes")
    if read is None:
        return None
    return KMView(None, read.note) if read.note is not None else parse_km(read.data)

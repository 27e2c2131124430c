"""``cox.json`` beside a ``fedsplit cox`` folder's ``history.json``: the federated Cox fit, read
and checked.

The format is `server.survival.app.fit_cox`'s (docs/survival.md, "Outputs"): ``covariates`` maps
each covariate to its coefficient, standard error, hazard ratio with its 95% interval, z and p;
``rows`` and ``events`` are the pooled totals; ``hospitals`` the names that took part;
``log_likelihood`` (and ``log_likelihood_null`` at zero coefficients), ``newton_rounds``,
``concordance`` (Harrell's C within each hospital) and ``per_site`` (each hospital's rows and
concordance); ``penalizer`` the ridge penalty. Undeclared keys are ignored.

A missing file gives None; one that is too large, not JSON or not of this shape gives a
`CoxView` with a ``note`` saying what is wrong (the page shows the note, never an error 500).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsplit.server.admin.ui.documents import first_error, read_document
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

COX_FILE = "cox.json"
MAX_COX_BYTES = 8 * 1024 * 1024
#: A Cox fit has one row per covariate (after one-hot encoding): tens, at most thousands.
MAX_COVARIATES = 5_000


class CoxCovariate(BaseModel):
    """One covariate of the fit: coefficient (log hazard ratio), its standard error, the hazard
    ratio with its 95% interval, the Wald z and p (None where the fit gave no finite value)."""

    model_config = ConfigDict(extra="ignore")

    coef: float
    se: float | None = None
    hazard_ratio: float | None = None
    hr_lower_95: float | None = None
    hr_upper_95: float | None = None
    z: float | None = None
    p: float | None = Field(default=None, ge=0.0, le=1.0)

    @field_validator("coef")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("a coefficient must be a finite number")
        return value

    @field_validator("se", "hazard_ratio", "hr_lower_95", "hr_upper_95", "z", "p", mode="before")
    @classmethod
    def _optional_finite(cls, value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value


class CoxSites(BaseModel):
    """Each hospital's rows and its concordance (within the hospital) at the fit."""

    model_config = ConfigDict(extra="ignore")

    rows: dict[str, int] = Field(default_factory=dict)
    concordance: dict[str, float | None] = Field(default_factory=dict)


class CoxDocument(BaseModel):
    """``cox.json``: the coefficients, pooled totals and fit statistics of ``fedsplit cox``."""

    model_config = ConfigDict(extra="ignore")

    covariates: dict[str, CoxCovariate] = Field(max_length=MAX_COVARIATES)
    rows: int = Field(ge=0)
    events: int = Field(ge=0)
    hospitals: list[str] = Field(default_factory=list, max_length=10_000)
    model: str | None = None
    ties: str | None = None
    penalizer: float | None = Field(default=None, ge=0.0)
    log_likelihood: float | None = None
    log_likelihood_null: float | None = None
    newton_rounds: int | None = Field(default=None, ge=0)
    concordance: float | None = Field(default=None, ge=0.0, le=1.0)
    per_site: CoxSites = Field(default_factory=CoxSites)
    secure_aggregation: str | None = None


@dataclass
class CoxView:
    """What the page shows of ``cox.json``: the document, or a note why it is not shown."""

    doc: CoxDocument | None
    note: str | None = None


def parse_cox(data: Any) -> CoxView:
    """Check parsed ``cox.json`` content; a note (never an exception) when it is not a Cox fit."""
    if not isinstance(data, dict):
        return CoxView(None, f"{COX_FILE} must hold a JSON object (the output of fedsplit cox). "
                             f"Received: {type(data).__name__}")
    try:
        return CoxView(CoxDocument.model_validate(data))
    except ValidationError as e:
        return CoxView(None, f"{COX_FILE} is not a Cox model written by fedsplit cox: "
                             f"{first_error(e)}. Write it again with fedsplit cox. "
                             f"Received: keys {', '.join(sorted(map(str, data))[:8]) or 'none'}")


def read_cox(folder: Path) -> CoxView | None:
    """``folder/cox.json`` checked (`parse_cox`); None when there is none."""
    read = read_document(folder / COX_FILE, MAX_COX_BYTES, "a Cox fit is kilobytes")
    if read is None:
        return None
    return CoxView(None, read.note) if read.note is not None else parse_cox(read.data)

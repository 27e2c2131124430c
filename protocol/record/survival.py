"""The documents of the survival analyses: ``fedsplit km`` / ``fedsplit cox``'s status file
(``history.json``: `SurvivalAnalysisRecord`), the pooled Kaplan-Meier curve (``km.json``:
`KMDocument`, written by `server.survival.app` and by the survival summary after a
``fedsplit simulate --task survival`` run, `server.survival.summary`) and the federated Cox fit
(``cox.json``: `CoxDocument`, written by `server.survival.app` and by the exact Cox path of
``fedsplit simulate``, `server.survival.exact`). Written and read only through these classes:
the coordinator builds the model, the runner (`orchestration.survival.run`), the CLI and the
web view read it back (conventions: `protocol.record.common`; formats: docs/survival.md,
"Outputs").
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Self

from fedsplit.protocol.aggregation_report import RecordPart
from fedsplit.protocol.record.common import HISTORY_FILE, JsonFile, first_error
from pydantic import Field, ValidationError, field_validator, model_validator

KM_FILE = "km.json"
COX_FILE = "cox.json"
#: A published curve has one point per group of at least ``min_count`` events: a few hundred.
MAX_POINTS = 20_000
#: A Cox fit has one row per covariate (after one-hot encoding): tens, at most thousands.
MAX_COVARIATES = 5_000
MAX_HOSPITALS = 10_000


#: The analyses ``fedsplit km`` / ``fedsplit cox`` run (`SurvivalAnalysisRecord.mode`).
SURVIVAL_MODES = ("km", "cox")


class SurvivalAnalysisRecord(JsonFile):
    """``history.json`` of ``fedsplit km`` / ``fedsplit cox`` (`server.survival.app`): the status
    of the analysis whose result lies beside it (``km.json`` / ``cox.json``); no rounds.

    ``kind``: ``survival-km`` or ``survival-cox`` (written since issue 34; older files hold only
    ``status``, ``mode`` and on failure ``error``, and load unchanged); ``mode``: ``km`` or
    ``cox``; times are Unix seconds."""

    _file: ClassVar[str] = HISTORY_FILE
    _kind: ClassVar[str] = "survival analysis status"
    _fix: ClassVar[str] = " Run fedsplit km or fedsplit cox again."

    kind: str | None = None
    status: str
    mode: str
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @model_validator(mode="after")
    def _mode_and_kind_agree(self) -> Self:
        if self.mode not in SURVIVAL_MODES:
            raise ValueError(f"mode is one of {SURVIVAL_MODES}, got {self.mode!r}")
        if self.kind is not None and self.kind != f"survival-{self.mode}":
            raise ValueError(f"kind {self.kind!r} does not match mode {self.mode!r}")
        return self

    @classmethod
    def start(cls, mode: str, *, at: float) -> SurvivalAnalysisRecord:
        """The record of an analysis that has just started (kind, status ``running``, mode)."""
        return cls(kind=f"survival-{mode}", status="running", mode=mode, started_at=at)

    def end(self, status: str, *, at: float, error: str | None = None) -> None:
        """Mark the analysis ``finished`` or ``failed`` (with ``error``) at ``at``."""
        self.status = status
        self.finished_at = at
        if error is not None:
            self.error = error


class KMPoints(RecordPart):
    """The published points of the pooled curve, in time order (`server.survival.km`): the
    time, the number at risk at the first event time the point pools, its events, the
    survival and its exponential-Greenwood 95% band; lists of one length."""

    time: list[float] = Field(max_length=MAX_POINTS)
    at_risk: list[int] = Field(max_length=MAX_POINTS)
    events: list[int] = Field(max_length=MAX_POINTS)
    survival: list[float] = Field(max_length=MAX_POINTS)
    lower_95: list[float] = Field(max_length=MAX_POINTS)
    upper_95: list[float] = Field(max_length=MAX_POINTS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        lengths = {"time": len(self.time), "at_risk": len(self.at_risk),
                   "events": len(self.events), "survival": len(self.survival),
                   "lower_95": len(self.lower_95), "upper_95": len(self.upper_95)}
        if len(set(lengths.values())) > 1:
            raise ValueError("the curve's lists must have one length; got "
                             + ", ".join(f"{k} {n}" for k, n in lengths.items()))
        if any(not math.isfinite(t) or t < 0 for t in self.time):
            raise ValueError("every time must be a finite number >= 0")
        if any(b < a for a, b in zip(self.time, self.time[1:], strict=False)):
            raise ValueError("times must be in increasing order")
        if any(n < 0 for n in self.at_risk) or any(d < 0 for d in self.events):
            raise ValueError("counts at risk and events must be >= 0")
        for name, values in (("survival", self.survival), ("lower_95", self.lower_95),
                             ("upper_95", self.upper_95)):
            if any(not 0.0 <= v <= 1.0 for v in values):
                raise ValueError(f"every {name} value must lie in [0, 1]")
        return self


class SurvivalDocument(JsonFile):
    """A survival analysis's output file (``km.json``, ``cox.json``); ``writer`` names the
    command that writes it, ``mode`` the analysis (`SurvivalAnalysisRecord.mode`)."""

    writer: ClassVar[str]
    mode: ClassVar[str]

    @classmethod
    def kind(cls) -> str:
        """What the file holds, in words (e.g. "Cox model")."""
        return cls._kind

    @classmethod
    def checked(cls, data: Any) -> tuple[Self | None, str | None]:
        """Parsed file content as the document, or (None, a one-line note saying what is wrong
        and how to fix it): never an exception, for a page that shows the note."""
        if not isinstance(data, dict):
            return None, (f"{cls._file} must hold a JSON object (the output of {cls.writer}). "
                          f"Received: {type(data).__name__}")
        try:
            return cls.model_validate(data), None
        except ValidationError as e:
            keys = ", ".join(sorted(map(str, data))[:8]) or "none"
            return None, (f"{cls._file} is not a {cls._kind} written by {cls.writer}: "
                          f"{first_error(e)}. Write it again with {cls.writer}. "
                          f"Received: keys {keys}")


class KMDocument(SurvivalDocument):
    """``km.json``: the pooled Kaplan-Meier curve (`KMPoints`) after the minimum-count rule
    ``min_count``; ``rows`` and ``events`` the pooled totals; ``hospitals`` the names that took
    part; ``secure_aggregation`` (``off`` or the SecAgg+ spec) and ``shared`` (what each
    hospital sent); ``wall_seconds``: the whole ``fedsplit km`` run (added by its runner)."""

    _file: ClassVar[str] = KM_FILE
    _kind: ClassVar[str] = "Kaplan-Meier curve"
    _fix: ClassVar[str] = " Write it again with fedsplit km."
    writer: ClassVar[str] = "fedsplit km"
    mode: ClassVar[str] = "km"

    hospitals: list[str] = Field(default_factory=list, max_length=MAX_HOSPITALS)
    rows: int = Field(ge=0)
    events: int = Field(ge=0)
    min_count: int = Field(ge=1)
    curve: KMPoints
    secure_aggregation: str | None = None
    shared: str | None = None
    wall_seconds: float | None = None


class CoxCovariate(RecordPart):
    """One covariate of the fit (lifelines' columns): coefficient (log hazard ratio), its
    standard error and 95% interval, the hazard ratio with its 95% interval, the Wald z and p
    (None where the fit gave no finite value)."""

    coef: float
    se: float | None = None
    hazard_ratio: float | None = None
    coef_lower_95: float | None = None
    coef_upper_95: float | None = None
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

    @field_validator("se", "hazard_ratio", "coef_lower_95", "coef_upper_95", "hr_lower_95",
                     "hr_upper_95", "z", "p", mode="before")
    @classmethod
    def _optional_finite(cls, value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value

    @property
    def significant(self) -> bool:
        """Whether p < 0.05."""
        return self.p is not None and self.p < 0.05


class CoxSites(RecordPart):
    """Each hospital's rows and its concordance (within the hospital) at the fit; None under
    secure aggregation (only sums are known)."""

    rows: dict[str, int] | None = None
    concordance: dict[str, float | None] | None = None


class NewtonStep(RecordPart):
    """One Newton-Raphson evaluation: its number, the penalized log-likelihood there and the
    norm of the step it gave (`server.survival.newton.newton`)."""

    round: int
    loglik: float
    step_norm: float


class CoxDocument(SurvivalDocument):
    """``cox.json``: the federated Cox fit (`server.survival.newton.summary`): the ``model`` and
    ``ties`` in words, the ridge ``penalizer`` and ``l1_ratio``, the ``hospitals`` that took
    part, the pooled ``rows`` and ``events``, each covariate's `CoxCovariate`, the penalized
    ``log_likelihood`` (and ``log_likelihood_null`` at zero coefficients), the Newton rounds and
    steps, Harrell's C within each hospital (``concordance``, ``concordance_note``), each
    hospital's rows and C (``per_site``), each text column's reference category, the derived
    inputs ``left_out`` (name -> why), the ``schema_warnings``, ``secure_aggregation``,
    ``secure_sums``, ``seconds``, what was ``shared``, which rows were fitted (``rows_used``, on
    the exact path of ``fedsplit simulate``) and ``wall_seconds`` (the whole ``fedsplit cox``
    run, added by its runner)."""

    _file: ClassVar[str] = COX_FILE
    _kind: ClassVar[str] = "Cox model"
    _fix: ClassVar[str] = " Write it again with fedsplit cox."
    writer: ClassVar[str] = "fedsplit cox"
    mode: ClassVar[str] = "cox"

    model: str | None = None
    ties: str | None = None
    penalizer: float | None = Field(default=None, ge=0.0)
    l1_ratio: float | None = None
    hospitals: list[str] = Field(default_factory=list, max_length=MAX_HOSPITALS)
    rows: int = Field(ge=0)
    events: int = Field(ge=0)
    covariates: dict[str, CoxCovariate] = Field(max_length=MAX_COVARIATES)
    log_likelihood: float | None = None
    log_likelihood_null: float | None = None
    newton_rounds: int | None = Field(default=None, ge=0)
    newton_steps: list[NewtonStep] = Field(default_factory=list)
    concordance: float | None = Field(default=None, ge=0.0, le=1.0)
    concordance_note: str | None = None
    per_site: CoxSites | None = None
    reference_categories: dict[str, str] = Field(default_factory=dict)
    left_out: dict[str, str] = Field(default_factory=dict)
    schema_warnings: list[str] = Field(default_factory=list)
    secure_aggregation: str | None = None
    secure_sums: int | None = None
    seconds: float | None = None
    shared: str | None = None
    rows_used: str | None = None
    wall_seconds: float | None = None

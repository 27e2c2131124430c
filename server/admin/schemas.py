"""Request and response bodies of the admin API (never the database tables)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fedsplit.protocol.arrays import ArraySpec
from pydantic import BaseModel, ConfigDict, Field

#: Largest id (and count) the database stores: SQLite's signed 64-bit INTEGER.
MAX_ID = 2**63 - 1


# Input: create a round.
class RoundCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(default="fedavg", description="Registered strategy (`fedsplit strategies`).")
    params: dict[str, Any] = Field(default_factory=dict, description="Strategy parameters.")
    min_uploads: int = Field(
        default=1, ge=1, le=MAX_ID, description="Uploads needed before aggregating."
    )
    deadline: datetime | None = Field(default=None, description="ISO-8601; uploads after it are refused.")
    continues: int | None = Field(
        default=None, ge=1, le=MAX_ID,
        description="Aggregated round whose model is this round's start model.",
    )


# Output: one parameter of a model.
class ParameterPublic(BaseModel):
    name: str
    shape: list[int]
    dtype: str

    @classmethod
    def from_spec(cls, spec: ArraySpec) -> ParameterPublic:
        """The response form of one parameter."""
        return cls(name=spec.name, shape=list(spec.shape), dtype=spec.dtype.name)


# Output: one accepted upload (current or replaced).
class UploadPublic(BaseModel):
    id: int = Field(description="The upload's number among its hospital's uploads (1, 2, ...).")
    site: str
    filename: str | None = Field(
        default=None, description="The file name the hospital's client sent, if any (for people).")
    num_examples: int
    count_source: str
    sha256: str
    size: int
    layout: str
    current: bool
    created_at: datetime
    replaced_at: datetime | None


# Output: the answer to an upload.
class UploadReceipt(UploadPublic):
    round_id: int
    replaced: int | None = Field(description="Id of the earlier upload this one replaced, if any.")
    parameters: list[ParameterPublic]


# Output: a round with its uploads.
class RoundPublic(BaseModel):
    id: int
    strategy: str
    params: dict[str, Any]
    min_uploads: int
    deadline: datetime | None
    continues: int | None
    status: str
    model_source: str | None
    keras_layout: str | None
    parameters: list[ParameterPublic] | None
    has_start_model: bool
    uploads: list[UploadPublic]
    history: list[UploadPublic]
    num_examples: int | None
    aggregation_seconds: float | None
    report: dict[str, Any] | None
    created_at: datetime
    aggregated_at: datetime | None


# Output: a list of rounds.
class RoundsPublic(BaseModel):
    data: list[RoundPublic]
    count: int


# Output: one problem of a request that failed validation.
class ValidationProblem(BaseModel):
    loc: list[str]
    msg: str
    type: str


# Output: the error body of every refusal.
class ErrorPublic(BaseModel):
    detail: str
    error: str
    reason: str | None = None
    errors: list[ValidationProblem] | None = Field(
        default=None, description="Each problem of a request that failed validation (422)."
    )

"""Database tables of the admin API (SQLAlchemy 2.0 ORM). Never returned by a route directly."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fedsplit.protocol.arrays import ArraySpec
from sqlalchemy import JSON, Boolean, DateTime, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base of the admin tables."""


# A hospital that may upload; only the SHA-256 of its token is stored.
class Site(Base):
    __tablename__ = "sites"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    cohort_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    #: set by `fedsplit admin remove-site`: the token matches nothing from then on; the row (and
    #: its name) stays so that past uploads keep their owner
    removed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


# One aggregation round: its strategy, expected model, uploads and, once aggregated, the result.
class Round(Base):
    __tablename__ = "rounds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    strategy: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    min_uploads: Mapped[int] = mapped_column(Integer, default=1)
    deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    continues: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="open")
    # expected parameters [{name, shape, dtype}], fixed by template, continued round or first upload
    model_specs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    model_source: Mapped[str | None] = mapped_column(String(16), nullable=True)
    #: {"kind": "keras3" | "keras-legacy"} once a Keras file fixed the layout (the layout itself:
    #: RoundKerasLayout; rounds stored before issue 33 had it whole here)
    keras_layout: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    template_file: Mapped[str | None] = mapped_column(String(512), nullable=True)
    model_file: Mapped[str | None] = mapped_column(String(512), nullable=True)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    num_examples: Mapped[int | None] = mapped_column(Integer, nullable=True)
    aggregation_seconds: Mapped[float | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    aggregated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    uploads: Mapped[list[Upload]] = relationship(back_populates="round", order_by="Upload.id")

    # The storage boundary of the model layout: JSON dicts in the column, ArraySpec outside.
    @property
    def specs(self) -> tuple[ArraySpec, ...] | None:
        """The round's expected model, or None while no template or upload has fixed it."""
        if self.model_specs is None:
            return None
        return tuple(ArraySpec.from_dict(d) for d in self.model_specs)

    @specs.setter
    def specs(self, specs: tuple[ArraySpec, ...] | None) -> None:
        self.model_specs = None if specs is None else [s.to_dict() for s in specs]


# A round's Keras layout (server.admin.keras_layouts): beside the round's row, not in it.
class RoundKerasLayout(Base):
    __tablename__ = "round_keras_layouts"

    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), primary_key=True)
    layout: Mapped[dict[str, Any]] = mapped_column(JSON)


# One accepted upload. A re-upload sets `current` False on the earlier one, which stays as history.
class Upload(Base):
    __tablename__ = "uploads"
    __table_args__ = (
        Index(
            "one_current_upload_per_site",
            "round_id",
            "site_id",
            unique=True,
            sqlite_where=text("current = 1"),
            postgresql_where=text("current"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id"))
    num_examples: Mapped[int] = mapped_column(Integer)
    count_source: Mapped[str] = mapped_column(String(8))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(Integer)
    layout: Mapped[str] = mapped_column(String(16))
    original_file: Mapped[str] = mapped_column(String(512))
    #: the file name the hospital's client sent (multipart filename), for people; never a path used
    client_filename: Mapped[str | None] = mapped_column(String(255), nullable=True, default=None)
    weights_file: Mapped[str] = mapped_column(String(512))
    #: the upload's number among its site's uploads (1, 2, ...): the id the API shows, so that no
    #: hospital counts the others' uploads from gaps in a global sequence
    site_seq: Mapped[int | None] = mapped_column(Integer, nullable=True, default=None)
    current: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    replaced_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    round: Mapped[Round] = relationship(back_populates="uploads")
    site: Mapped[Site] = relationship()


# One audit-log record (server.admin.audit): append-only, chained by SHA-256, MAC'd with a key.
class AuditRecord(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[str] = mapped_column(String(40), index=True)  # ISO-8601 UTC, microseconds
    event: Mapped[str] = mapped_column(String(32), index=True)
    actor: Mapped[str] = mapped_column(String(160))
    site_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    address: Mapped[str | None] = mapped_column(String(64), nullable=True)
    detail: Mapped[str] = mapped_column(Text)  # canonical JSON, exactly as hashed
    prev_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hash: Mapped[str] = mapped_column(String(64))
    #: HMAC-SHA256 of ``hash`` under the audit key (server.admin.auditkey); None: written before
    #: the log had a key
    mac: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)


# One refused upload attempt (`services.refusals`): the upload route stores nothing of a refused
# file, so this row says who tried to send what and why. The table name predates the row's move
# out of the web view (issue 34): existing databases keep their rows.
class RefusedUpload(Base):
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

"""REST rounds as the web view shows them, read through the admin's services (`services.rounds`
lists rounds and uploads for the API and this view alike; `services.refusals` the refusals).

A site principal sees what `services.isolation` allows, as through the API: its own uploads and
refusals, its own line of each report, no total count, and a model link only for aggregates the
release rule lets it download (`isolation.ReleaseRule`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.server.admin.auth import Principal
from fedsplit.server.admin.errors import NotFoundError
from fedsplit.server.admin.services import isolation, refusals
from fedsplit.server.admin.services import rounds as round_service
from fedsplit.server.admin.tables import RefusedUpload, Round, Upload
from fedsplit.server.admin.timeutil import as_utc
from fedsplit.server.admin.ui.siterows import RoundRows, SiteRow, rows_from_round
from sqlalchemy.orm import Session

#: Rounds listed on the overview (newest first); older ones stay reachable by id.
MAX_ROUNDS_LISTED = 100
MAX_UPLOADS_LISTED = 200
_DEFAULT_RULE = isolation.ReleaseRule()


@dataclass
class UploadItem:
    """One upload: accepted (current or replaced) or refused."""

    round_id: int | None
    site: str
    at: datetime | None
    sha256: str | None
    size: int | None
    file: str | None
    layout: str | None = None
    num_examples: int | None = None
    current: bool = True
    replaced_at: datetime | None = None
    refused: bool = False
    reason: str | None = None
    detail: str | None = None
    status_code: int | None = None
    site_id: int | None = None


@dataclass
class RestRound(RoundRows):
    """One REST round with its hospitals and uploads."""

    id: int
    strategy: str
    params: dict[str, Any]
    status: str
    min_uploads: int
    deadline: datetime | None
    created_at: datetime | None
    aggregated_at: datetime | None
    num_examples: int | None
    aggregation_seconds: float | None
    has_model: bool
    has_keras: bool
    rows: list[SiteRow] = field(default_factory=list)
    uploads: list[UploadItem] = field(default_factory=list)
    sites_uploaded: int = 0


def _visible(principal: Principal, item: UploadItem) -> bool:
    return isolation.sees_site(principal, site_id=item.site_id)


def upload_item(upload: Upload) -> UploadItem:
    """An accepted upload."""
    return UploadItem(
        round_id=upload.round_id, site=upload.site.name, at=as_utc(upload.created_at),
        sha256=upload.sha256, size=upload.size_bytes,
        file=upload.client_filename or (
            upload.original_file.rsplit("/", 1)[-1] if upload.original_file else None),
        layout=upload.layout, num_examples=upload.num_examples, current=upload.current,
        replaced_at=as_utc(upload.replaced_at), site_id=upload.site_id,
    )


def refusal_item(refusal: RefusedUpload) -> UploadItem:
    """A refused upload."""
    return UploadItem(
        round_id=refusal.round_id, site=refusal.who, at=as_utc(refusal.created_at),
        sha256=refusal.sha256, size=refusal.size_bytes, file=refusal.filename, refused=True,
        reason=refusal.reason or refusal.error, detail=refusal.detail, status_code=refusal.status_code,
        site_id=refusal.site_id,
    )


def rest_round(rnd: Round, principal: Principal, refusals: list[RefusedUpload],
               rule: isolation.ReleaseRule = _DEFAULT_RULE) -> RestRound:
    """The view of ``rnd`` for ``principal``."""
    admin = isolation.is_admin(principal)
    current = [u for u in rnd.uploads if u.current]
    names = [u.site.name for u in rnd.uploads]
    report = isolation.stored_report(rnd.report)
    rows = rows_from_round(
        [SiteEntry(site=u.site.name, num_examples=u.num_examples) for u in current
         if isolation.sees_site(principal, site_id=u.site_id)],
        isolation.visible_report(principal, report, names), sent_tag="uploaded",
    )
    items = [upload_item(u) for u in rnd.uploads] + [refusal_item(r) for r in refusals]
    items.sort(key=lambda i: (i.at is None, i.at), reverse=True)
    return RestRound(
        id=rnd.id, strategy=rnd.strategy, params=dict(rnd.params or {}), status=rnd.status,
        min_uploads=rnd.min_uploads, deadline=as_utc(rnd.deadline),
        created_at=as_utc(rnd.created_at), aggregated_at=as_utc(rnd.aggregated_at),
        num_examples=rnd.num_examples if admin else None,
        aggregation_seconds=rnd.aggregation_seconds,
        has_model=rnd.model_file is not None
        and isolation.may_download_model(principal, report, rule),
        has_keras=rnd.keras_layout is not None,
        rows=[r for r in rows if admin or r.site == principal.site_name],
        uploads=[i for i in items if _visible(principal, i)],
        sites_uploaded=len(current) if admin else 0,
    )


def _refusals(session: Session, principal: Principal, round_ids: list[int] | None) -> list[RefusedUpload]:
    return refusals.list_refusals(session, principal, round_ids=round_ids, limit=MAX_UPLOADS_LISTED)


def list_rounds(session: Session, principal: Principal,
                rule: isolation.ReleaseRule = _DEFAULT_RULE) -> list[RestRound]:
    """The newest `MAX_ROUNDS_LISTED` rounds, newest first."""
    rounds = round_service.list_rounds(session, limit=MAX_ROUNDS_LISTED)
    by_round: dict[int | None, list[RefusedUpload]] = {}
    for refusal in _refusals(session, principal, [r.id for r in rounds]):
        by_round.setdefault(refusal.round_id, []).append(refusal)
    return [rest_round(r, principal, by_round.get(r.id, []), rule) for r in rounds]


def get_round(session: Session, principal: Principal, round_id: int,
              rule: isolation.ReleaseRule = _DEFAULT_RULE) -> RestRound | None:
    """One round, or None."""
    try:
        rnd = round_service.get_round(session, round_id)
    except NotFoundError:
        return None
    return rest_round(rnd, principal, _refusals(session, principal, [round_id]), rule)


def recent_uploads(session: Session, principal: Principal) -> list[UploadItem]:
    """The newest uploads and refusals (every round), newest first."""
    items = [upload_item(u) for u in round_service.recent_uploads(session, principal,
                                                                  limit=MAX_UPLOADS_LISTED)]
    items += [refusal_item(r) for r in _refusals(session, principal, None)]
    items.sort(key=lambda i: (i.at is None, i.at), reverse=True)
    return items[:MAX_UPLOADS_LISTED]

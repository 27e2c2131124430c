"""Create, list and describe rounds."""

from __future__ import annotations

from fedsplit.server.admin.auth import Principal
from fedsplit.server.admin.errors import ConflictError, NotFoundError
from fedsplit.server.admin.keras_layouts import get_layout, set_layout
from fedsplit.server.admin.schemas import ParameterPublic, RoundCreate, RoundPublic, UploadPublic
from fedsplit.server.admin.services import isolation
from fedsplit.server.admin.tables import Round, Upload
from fedsplit.server.admin.timeutil import as_utc
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from fedsplit import aggregation

OPEN = "open"
AGGREGATED = "aggregated"


def get_round(session: Session, round_id: int) -> Round:
    """Return round ``round_id`` or raise `NotFoundError`."""
    rnd = session.get(Round, round_id)
    if rnd is None:
        raise NotFoundError(
            f"There is no round {round_id}; list rounds with GET /api/v1/rounds. Received: {round_id}"
        )
    return rnd


def create_round(session: Session, body: RoundCreate) -> Round:
    """Validate the strategy and the continued round, then store a new open round."""
    aggregation.get_strategy(body.strategy, body.params)  # unknown name / bad params -> 422
    rnd = Round(
        strategy=body.strategy,
        params=dict(body.params),
        min_uploads=body.min_uploads,
        deadline=as_utc(body.deadline),
        continues=body.continues,
        status=OPEN,
    )
    if body.continues is not None:
        previous = session.get(Round, body.continues)
        if previous is None:
            raise NotFoundError(
                f"'continues' names round {body.continues}, which does not exist; give the id of an "
                f"aggregated round. Received: {body.continues}"
            )
        if previous.status != AGGREGATED:
            raise ConflictError(
                f"'continues' names round {body.continues}, which is not aggregated yet, so it has no "
                f"model to start from. Aggregate it first. Received: status {previous.status!r}"
            )
        rnd.specs = previous.specs
        rnd.model_source = "continues"
    session.add(rnd)
    session.flush()
    if body.continues is not None and (layout := get_layout(session, previous)) is not None:
        set_layout(session, rnd, layout)
    session.commit()
    return rnd


def list_rounds(session: Session, *, limit: int | None = None) -> list[Round]:
    """Every round (the newest ``limit``), newest first, with their uploads and sites loaded.

    The one round listing: the API (``GET /api/v1/rounds``) and the web view read it."""
    query = (select(Round).options(selectinload(Round.uploads).selectinload(Upload.site))
             .order_by(Round.id.desc()))
    return list(session.scalars(query if limit is None else query.limit(limit)))


def recent_uploads(session: Session, principal: Principal, *, limit: int) -> list[Upload]:
    """The newest ``limit`` uploads ``principal`` may see (the admin: all; a site: its own),
    accepted ones of every round (current and replaced), newest first."""
    query = select(Upload).options(selectinload(Upload.site)).order_by(Upload.id.desc()).limit(limit)
    if not isolation.is_admin(principal):
        query = query.where(Upload.site_id == principal.site_id)
    return list(session.scalars(query))


def public_id(upload: Upload) -> int:
    """The id the API shows for an upload: its number among its site's uploads."""
    return upload.site_seq if upload.site_seq is not None else upload.id


def upload_public(upload: Upload) -> UploadPublic:
    """Response body of one upload."""
    return UploadPublic(
        id=public_id(upload),
        site=upload.site.name,
        filename=upload.client_filename,
        num_examples=upload.num_examples,
        count_source=upload.count_source,
        sha256=upload.sha256,
        size=upload.size_bytes,
        layout=upload.layout,
        current=upload.current,
        created_at=as_utc(upload.created_at),  # type: ignore[arg-type]
        replaced_at=as_utc(upload.replaced_at),
    )


def round_public(rnd: Round, principal: Principal) -> RoundPublic:
    """Response body of one round, as ``principal`` may see it (`isolation`): a hospital gets its
    own uploads and its own line of the report, and no total count."""
    admin = isolation.is_admin(principal)
    mine = [u for u in rnd.uploads if isolation.sees_site(principal, site_id=u.site_id)]
    names = [] if admin else [u.site.name for u in rnd.uploads]
    # a model fixed by another hospital's first upload tells that someone uploaded: a hospital
    # sees it once it has uploaded itself, or once the round is aggregated
    shows_model = (admin or rnd.model_source != "first_upload" or bool(mine)
                   or rnd.status == AGGREGATED)
    return RoundPublic(
        id=rnd.id,
        strategy=rnd.strategy,
        params=rnd.params,
        min_uploads=rnd.min_uploads,
        deadline=as_utc(rnd.deadline),
        continues=rnd.continues,
        status=rnd.status,
        model_source=rnd.model_source if shows_model else None,
        keras_layout=rnd.keras_layout["kind"] if rnd.keras_layout and shows_model else None,
        parameters=[ParameterPublic.from_spec(s) for s in specs]
        if (specs := rnd.specs) and shows_model else None,
        has_start_model=rnd.template_file is not None or rnd.continues is not None,
        uploads=[upload_public(u) for u in mine if u.current],
        history=[upload_public(u) for u in mine if not u.current],
        num_examples=rnd.num_examples if admin else None,
        aggregation_seconds=rnd.aggregation_seconds,
        report=isolation.report_for(principal, rnd.report, names),
        created_at=as_utc(rnd.created_at),  # type: ignore[arg-type]
        aggregated_at=as_utc(rnd.aggregated_at),
    )

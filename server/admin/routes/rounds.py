"""Rounds: create, list, read, template, aggregate, download."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from fedsplit.server.admin.auth import Principal
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.deps import (
    AdminPrincipal,
    ContextDep,
    CurrentPrincipal,
    RoundId,
    SessionDep,
    client_address,
)
from fedsplit.server.admin.errors import PermissionDeniedError
from fedsplit.server.admin.receive import receive_upload
from fedsplit.server.admin.schemas import ErrorPublic, RoundCreate, RoundPublic, RoundsPublic
from fedsplit.server.admin.services import aggregate as aggregate_service
from fedsplit.server.admin.services import downloads
from fedsplit.server.admin.services import rounds as round_service
from fedsplit.server.admin.services import uploads as upload_service

router = APIRouter(prefix="/rounds", tags=["rounds"])

ERRORS = {code: {"model": ErrorPublic} for code in (400, 401, 403, 404, 409, 413, 422, 429)}
MULTIPART_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "Weight file (.h5)."},
                        "num_examples": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "Training rows; required when the file carries none.",
                        },
                    },
                }
            }
        },
    }
}
FormatQuery = Annotated[str, Query(description="fedsplit (default) or keras")]


@router.post("", response_model=RoundPublic, status_code=201, responses=ERRORS)
def create_round(
    body: RoundCreate, request: Request, session: SessionDep, ctx: ContextDep, admin: AdminPrincipal
) -> RoundPublic:
    """Create a round (admin)."""
    rnd = round_service.create_round(session, body)
    ctx.record("round_created", admin, client_address(request), round=rnd.id, strategy=rnd.strategy)
    return round_service.round_public(rnd, admin)


@router.get("", response_model=RoundsPublic, responses=ERRORS)
def read_rounds(session: SessionDep, principal: CurrentPrincipal) -> RoundsPublic:
    """List rounds, newest first (a site sees its own uploads only)."""
    data = [round_service.round_public(r, principal) for r in round_service.list_rounds(session)]
    return RoundsPublic(data=data, count=len(data))


@router.get("/{round_id}", response_model=RoundPublic, responses=ERRORS)
def read_round(round_id: RoundId, session: SessionDep, principal: CurrentPrincipal) -> RoundPublic:
    """Read a round: status, expected model, uploads (current and replaced), report.

    A site sees its own uploads and its own line of the report only (docs/admin-api.md,
    "Isolation")."""
    return round_service.round_public(round_service.get_round(session, round_id), principal)


@router.put(
    "/{round_id}/template", response_model=RoundPublic, responses=ERRORS, openapi_extra=MULTIPART_BODY
)
async def update_template(
    round_id: RoundId, request: Request, ctx: ContextDep, admin: AdminPrincipal
) -> RoundPublic:
    """Upload the round's template weight file (admin): fixes the model, is the start model."""
    received = await receive_upload(request, ctx.files.tmp, ctx.settings.max_upload_bytes)
    try:
        rnd = await run_in_threadpool(
            upload_service.store_template, ctx, round_id=round_id, received=received
        )
    finally:
        received.path.unlink(missing_ok=True)
    await run_in_threadpool(ctx.record, "template", admin, client_address(request), round=round_id,
                            sha256=received.sha256, size=received.size)
    return round_service.round_public(rnd, admin)


@router.post("/{round_id}/aggregate", response_model=RoundPublic, responses=ERRORS)
def create_aggregate(
    round_id: RoundId, request: Request, ctx: ContextDep, admin: AdminPrincipal
) -> RoundPublic:
    """Aggregate the round's current uploads with its strategy (admin)."""
    rnd = aggregate_service.aggregate_round(ctx, round_id)
    ctx.record("aggregate", admin, client_address(request), round=round_id,
               uploads=sum(1 for u in rnd.uploads if u.current), strategy=rnd.strategy)
    return round_service.round_public(rnd, admin)


@router.get("/{round_id}/model", response_class=FileResponse, responses=ERRORS)
def read_model(
    round_id: RoundId, request: Request, session: SessionDep, ctx: ContextDep,
    principal: CurrentPrincipal,
    format: FormatQuery = downloads.FEDSPLIT_FORMAT,
) -> FileResponse:
    """Download the round's aggregate; ?format=keras for the Keras layout. A site may download
    it only when at least --min-model-sites hospitals' updates went into it (403 otherwise)."""
    rnd = round_service.get_round(session, round_id)
    return _download(ctx, request, principal, "model", round_id, format,
                     lambda: downloads.model_file(ctx, rnd, format, principal))


@router.get("/{round_id}/start-model", response_class=FileResponse, responses=ERRORS)
def read_start_model(
    round_id: RoundId, request: Request, session: SessionDep, ctx: ContextDep,
    principal: CurrentPrincipal,
    format: FormatQuery = downloads.FEDSPLIT_FORMAT,
) -> FileResponse:
    """Download the model every site must start from (template or the continued round's
    aggregate; the latter under the same minimum as GET .../model)."""
    rnd = round_service.get_round(session, round_id)
    continued = round_service.get_round(session, rnd.continues) if rnd.continues is not None else None
    return _download(ctx, request, principal, "start model", round_id, format,
                     lambda: downloads.start_model_file(ctx, rnd, continued, format, principal))



def _download(ctx: AdminContext, request: Request, principal: Principal, what: str, round_id: int,
              fmt: str, locate: Callable[[], tuple[Path, str]]) -> FileResponse:
    """The HDF5 file ``locate()`` finds, with an audit record of the download or of its refusal
    (isolation)."""
    try:
        path, name = locate()
    except PermissionDeniedError as e:
        ctx.record("model_download_refused", principal, client_address(request), round=round_id,
                   file=what, reason=str(e)[:200])
        raise
    ctx.record("model_download", principal, client_address(request), round=round_id, file=what,
               format=fmt)
    return FileResponse(path, media_type="application/x-hdf5", filename=name)

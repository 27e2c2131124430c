"""Rounds: create, list, read, template, aggregate, download."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from fedsplit.server.admin.deps import (
    AdminPrincipal,
    ContextDep,
    CurrentPrincipal,
    RoundId,
    SessionDep,
)
from fedsplit.server.admin.receive import receive_upload
from fedsplit.server.admin.schemas import ErrorPublic, RoundCreate, RoundPublic, RoundsPublic
from fedsplit.server.admin.services import aggregate as aggregate_service
from fedsplit.server.admin.services import downloads
from fedsplit.server.admin.services import rounds as round_service
from fedsplit.server.admin.services import uploads as upload_service

router = APIRouter(prefix="/rounds", tags=["rounds"])

ERRORS = {code: {"model": ErrorPublic} for code in (400, 401, 403, 404, 409, 413, 422)}
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
def create_round(body: RoundCreate, session: SessionDep, _: AdminPrincipal) -> RoundPublic:
    """Create a round (admin)."""
    return round_service.round_public(round_service.create_round(session, body))


@router.get("", response_model=RoundsPublic, responses=ERRORS)
def read_rounds(session: SessionDep, _: CurrentPrincipal) -> RoundsPublic:
    """List rounds, newest first."""
    data = [round_service.round_public(r) for r in round_service.list_rounds(session)]
    return RoundsPublic(data=data, count=len(data))


@router.get("/{round_id}", response_model=RoundPublic, responses=ERRORS)
def read_round(round_id: RoundId, session: SessionDep, _: CurrentPrincipal) -> RoundPublic:
    """Read a round: status, expected model, uploads (current and replaced), report."""
    return round_service.round_public(round_service.get_round(session, round_id))


@router.put(
    "/{round_id}/template", response_model=RoundPublic, responses=ERRORS, openapi_extra=MULTIPART_BODY
)
async def update_template(
    round_id: RoundId, request: Request, ctx: ContextDep, _: AdminPrincipal
) -> RoundPublic:
    """Upload the round's template weight file (admin): fixes the model, is the start model."""
    received = await receive_upload(request, ctx.files.tmp, ctx.settings.max_upload_bytes)
    try:
        rnd = await run_in_threadpool(
            upload_service.store_template, ctx, round_id=round_id, received=received
        )
    finally:
        received.path.unlink(missing_ok=True)
    return round_service.round_public(rnd)


@router.post("/{round_id}/aggregate", response_model=RoundPublic, responses=ERRORS)
def create_aggregate(round_id: RoundId, ctx: ContextDep, _: AdminPrincipal) -> RoundPublic:
    """Aggregate the round's current uploads with its strategy (admin)."""
    return round_service.round_public(aggregate_service.aggregate_round(ctx, round_id))


@router.get("/{round_id}/model", response_class=FileResponse, responses=ERRORS)
def read_model(
    round_id: RoundId, session: SessionDep, ctx: ContextDep, _: CurrentPrincipal,
    format: FormatQuery = downloads.FEDSPLIT_FORMAT,
) -> FileResponse:
    """Download the round's aggregate (admin or any site); ?format=keras for the Keras layout."""
    rnd = round_service.get_round(session, round_id)
    path, name = downloads.model_file(ctx, rnd, format)
    return FileResponse(path, media_type="application/x-hdf5", filename=name)


@router.get("/{round_id}/start-model", response_class=FileResponse, responses=ERRORS)
def read_start_model(
    round_id: RoundId, session: SessionDep, ctx: ContextDep, _: CurrentPrincipal,
    format: FormatQuery = downloads.FEDSPLIT_FORMAT,
) -> FileResponse:
    """Download the model every site must start from (template or the continued round's aggregate)."""
    rnd = round_service.get_round(session, round_id)
    continued = round_service.get_round(session, rnd.continues) if rnd.continues is not None else None
    path, name = downloads.start_model_file(ctx, rnd, continued, format)
    return FileResponse(path, media_type="application/x-hdf5", filename=name)


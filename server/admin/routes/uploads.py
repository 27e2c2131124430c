"""A site's weight-file upload for a round."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fedsplit.server.admin.deps import ContextDep, RoundId, SitePrincipal
from fedsplit.server.admin.errors import AdminError, UploadRefusedError, UploadTooLargeError
from fedsplit.server.admin.receive import receive_upload
from fedsplit.server.admin.routes.rounds import ERRORS, MULTIPART_BODY
from fedsplit.server.admin.schemas import UploadReceipt
from fedsplit.server.admin.services import uploads as upload_service

router = APIRouter(prefix="/rounds", tags=["uploads"])


@router.post(
    "/{round_id}/uploads",
    response_model=UploadReceipt,
    status_code=201,
    responses=ERRORS,
    openapi_extra=MULTIPART_BODY,
)
async def create_upload(
    round_id: RoundId, request: Request, ctx: ContextDep, site: SitePrincipal
) -> UploadReceipt:
    """Upload this site's weight file (multipart 'file', optional 'num_examples')."""
    size = 0
    try:
        received = await receive_upload(request, ctx.files.tmp, ctx.settings.max_upload_bytes)
        size = received.size
        try:
            receipt = await run_in_threadpool(
                upload_service.store_upload, ctx, round_id=round_id, principal=site, received=received
            )
        finally:
            received.path.unlink(missing_ok=True)
    except UploadRefusedError as e:
        ctx.metrics.upload_refused(e.reason, size)
        raise
    except UploadTooLargeError:
        ctx.metrics.upload_refused("too_large", size)
        raise
    except AdminError as e:
        ctx.metrics.upload_refused(type(e).__name__.removesuffix("Error").lower(), size)
        raise
    ctx.metrics.upload_accepted(receipt.size)
    return receipt

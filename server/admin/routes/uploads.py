"""A site's weight-file upload for a round."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fedsplit.server.admin.deps import ContextDep, RoundId, SitePrincipal, client_address
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
    address = client_address(request)
    try:
        # at most --site-concurrent-uploads at once per hospital; a 429 here is answered before
        # the body is read (and closes the connection)
        with ctx.upload_slots.hold(int(site.site_id), str(site.site_name)):  # type: ignore[arg-type]
            received = await receive_upload(request, ctx.files.tmp, ctx.settings.max_upload_bytes)
            size = received.size
            try:
                receipt = await run_in_threadpool(
                    upload_service.store_upload, ctx, round_id=round_id, principal=site,
                    received=received
                )
            finally:
                received.path.unlink(missing_ok=True)
    except (UploadRefusedError, UploadTooLargeError, AdminError) as e:
        reason = (e.reason if isinstance(e, UploadRefusedError) else "too_large"
                  if isinstance(e, UploadTooLargeError) else type(e).__name__.removesuffix("Error").lower())
        ctx.metrics.upload_refused(reason, size)
        await run_in_threadpool(ctx.record, "upload_refused", site, address, round=round_id,
                                reason=reason, size=size)
        raise
    ctx.metrics.upload_accepted(receipt.size)
    await run_in_threadpool(ctx.record, "upload", site, address, round=round_id, upload=receipt.id,
                            sha256=receipt.sha256, size=receipt.size, num_examples=receipt.num_examples)
    return receipt

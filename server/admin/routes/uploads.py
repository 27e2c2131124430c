"""A site's weight-file upload for a round."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fedsplit.protocol.errors import FedsplitError
from fedsplit.server.admin.auth import require_site
from fedsplit.server.admin.deps import ContextDep, IdentifiedPrincipal, RoundId, admit, client_address
from fedsplit.server.admin.receive import ReceiveProgress, receive_upload
from fedsplit.server.admin.routes.rounds import ERRORS, MULTIPART_BODY
from fedsplit.server.admin.schemas import UploadReceipt
from fedsplit.server.admin.services import refusals
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
    round_id: RoundId, request: Request, ctx: ContextDep, caller: IdentifiedPrincipal
) -> UploadReceipt:
    """Upload this site's weight file (multipart 'file', optional 'num_examples').

    Every refusal of a known caller (the request rate, the admin's token on this site route, the
    body, the file) is recorded here, once (`services.refusals.record_refusal`)."""
    address = client_address(request)
    read = ReceiveProgress()
    try:
        site = require_site(admit(ctx, caller))
        # at most --site-concurrent-uploads at once per hospital; a 429 here is answered before
        # the body is read (and closes the connection)
        with ctx.upload_slots.hold(int(site.site_id), str(site.site_name)):  # type: ignore[arg-type]
            received = await receive_upload(request, ctx.files.tmp, ctx.settings.max_upload_bytes, read)
            try:
                receipt = await run_in_threadpool(
                    upload_service.store_upload, ctx, round_id=round_id, principal=site,
                    received=received
                )
            finally:
                received.path.unlink(missing_ok=True)
    except FedsplitError as e:  # answered by the app's handler (4xx), recorded here
        await run_in_threadpool(refusals.record_refusal, ctx, principal=caller, round_id=round_id,
                                error=e, read=read, address=address)
        raise
    ctx.metrics.upload_accepted(receipt.size)
    await run_in_threadpool(ctx.record, "upload", site, address, round=round_id, upload=receipt.id,
                            sha256=receipt.sha256, size=receipt.size, num_examples=receipt.num_examples)
    return receipt

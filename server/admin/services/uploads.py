"""Accept a site's weight file (or the admin's template) for a round: check, store, record.

Order of events, so that a crash at any point leaves no visible partial upload and loses no
acknowledged one: the body is streamed to ``files/tmp`` (the files directory's own file system)
and fsynced; the sandbox checks it where it lies (a Keras file: it writes a canonical copy,
fsynced, and the bytes sent are dropped); inside the commit step the site is checked again (a
site removed meanwhile stores nothing) with its quota, the one stored file is renamed into the
round's directory (directory fsynced); only then is the row committed, and only after the commit
is the receipt sent. The upload it replaced keeps its row; its file is deleted after the commit.
An upload costs its own size on disk once (`stored_file`), not a second copy.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from fedsplit.protocol.arrays import layout_difference
from fedsplit.server.admin.auth import Principal
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.errors import (
    AuthenticationError,
    ConflictError,
    PermissionDeniedError,
    UploadRefusedError,
)
from fedsplit.server.admin.inspect_worker import MAX_NUM_EXAMPLES, MISMATCH_HINT
from fedsplit.server.admin.inspection import InspectRequest, Parsed
from fedsplit.server.admin.keras_layouts import set_layout
from fedsplit.server.admin.receive import ReceivedUpload
from fedsplit.server.admin.retention import prune_files, stored_bytes
from fedsplit.server.admin.schemas import ParameterPublic, UploadReceipt
from fedsplit.server.admin.services.rounds import AGGREGATED, get_round, public_id, upload_public
from fedsplit.server.admin.tables import Round, Site, Upload, utcnow
from fedsplit.server.admin.timeutil import as_utc
from sqlalchemy import func, select
from sqlalchemy.orm import Session, object_session

NUM_EXAMPLES_FIELD = "num_examples"


def parse_form_count(raw: str | None) -> int | None:
    """Return the form's ``num_examples`` as an int >= 1, None if absent; refuse anything else."""
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    # ASCII digits only: str.isdigit() also accepts "²" or "①", which int() refuses
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) < 1:
        raise UploadRefusedError(
            "Form field num_examples must be an integer >= 1: the number of training rows behind "
            f"these weights (FedAvg's weight). Received: {raw!r}",
            "num_examples",
        )
    return int(text)


def check_count(count: int, principal: Principal) -> None:
    """Refuse a count above the site's registered cohort size or above 10^9."""
    if count > MAX_NUM_EXAMPLES:
        raise UploadRefusedError(
            f"num_examples {count} is over {MAX_NUM_EXAMPLES}, which no hospital cohort reaches; it "
            f"would swamp every other site in the average. Send the number of training rows. "
            f"Received: {count}",
            "num_examples",
        )
    if principal.cohort_size is not None and count > principal.cohort_size:
        raise UploadRefusedError(
            f"num_examples {count} is above site {principal.site_name!r}'s registered cohort size "
            f"{principal.cohort_size}; a site cannot train on more rows than it has. Send the real "
            f"count, or ask the coordinator to register the site with the right --cohort-size. "
            f"Received: {count}",
            "num_examples",
        )


def _check_open(rnd: Round, now: datetime) -> None:
    if rnd.status == AGGREGATED:
        raise ConflictError(
            f"Round {rnd.id} is already aggregated and takes no more uploads. Upload to the round "
            f"that continues it (GET /api/v1/rounds). Received: status {rnd.status!r}"
        )
    deadline = as_utc(rnd.deadline)
    if deadline is not None and now > deadline:
        raise ConflictError(
            f"Round {rnd.id}'s deadline {deadline.isoformat()} has passed; uploads are closed. Ask "
            f"the coordinator for the next round. Received: upload at {now.isoformat()}"
        )


def _request(ctx: AdminContext, rnd: Round, **fields: Any) -> InspectRequest:
    settings = ctx.settings
    limit_elements = settings.max_upload_bytes // 2  # float16 is the smallest parameter dtype
    expected = rnd.specs
    if expected:  # the round's model: nothing bigger can match it
        limit_elements = min(limit_elements, sum(s.size for s in expected))
        cap_bytes = sum(s.nbytes for s in expected)
        cap_source = f"the size of round {rnd.id}'s model"
    else:  # a first upload (or template) fixes the model: the operator's cap
        cap_bytes = settings.max_model_bytes
        cap_source = f"this server's --max-model-mb {settings.max_model_mb:g} for a round's first upload"
    return InspectRequest(
        max_elements=max(min(limit_elements, cap_bytes), 1),
        max_total_elements=max(min(settings.max_upload_bytes // 2, cap_bytes), 1),
        max_total_bytes=cap_bytes,
        cap_source=cap_source,
        max_depth=settings.max_group_depth,
        expected=expected,
        memory_mb=settings.parse_memory_mb,
        cpu_s=int(settings.parse_timeout_s) + 1,
        max_output_bytes=settings.max_upload_bytes * 4 + 64 * 1024 * 1024,
        round=rnd.id,
        **fields,
    )


def _fix_model(rnd: Round, result: Parsed, source: str) -> None:
    """Fix the round's expected model (first upload or template), or re-check it (races)."""
    expected = rnd.specs
    if expected is None:
        rnd.specs = result.specs
        rnd.model_source = source
    else:
        problem = layout_difference(expected, result.specs, expected_label="the round's model",
                                    got_label="the upload", ordered=False)
        if problem is not None:
            names = [s.name for s in result.specs][:20]
            raise UploadRefusedError(
                f"{problem} {MISMATCH_HINT} Received: parameters {names}", "model_mismatch"
            )
    if rnd.keras_layout is None and result.keras_layout is not None:
        session = object_session(rnd)
        assert session is not None, "the round is read in the commit's session"
        set_layout(session, rnd, result.keras_layout)


def _live_site(session: Session, principal: Principal) -> Site:
    """The uploading site's row, checked inside the upload's commit: a site removed while its
    upload was being parsed stores nothing (its upload was answered 201 and kept before)."""
    site = session.get(Site, principal.site_id)
    if site is None or site.removed_at is not None:
        raise AuthenticationError(
            f"Site {principal.site_name!r} was removed while its upload was being checked, so the "
            f"upload was not stored. A removed site's token no longer works; ask the coordinator. "
            f"Received: an upload from a removed site"
        )
    return site


def _check_quota(ctx: AdminContext, session: Session, principal: Principal, new_bytes: int,
                 replaced: int | None) -> None:
    """Refuse (``quota``) an upload that would take the site past ``--site-quota-mb`` of files
    in open rounds (the upload it replaces does not count: its files are deleted)."""
    quota = ctx.settings.site_quota_bytes
    held = stored_bytes(session, ctx.files, int(principal.site_id), besides=replaced)  # type: ignore[arg-type]
    if held + new_bytes > quota:
        raise UploadRefusedError(
            f"Site {principal.site_name!r} would hold {held + new_bytes} bytes in open rounds with "
            f"this upload, more than the "
            f"{quota} bytes one hospital may hold (--site-quota-mb). Ask the coordinator to "
            f"aggregate or close earlier rounds, or to raise the quota. Received: {new_bytes} bytes",
            "quota",
        )


def stored_file(received: ReceivedUpload, canonical: Path, result: Parsed) -> Path:
    """The one file an accepted upload keeps: the bytes sent (fedsplit layout, checked in place),
    or the sandbox's canonical copy of a Keras file (the bytes sent are deleted now)."""
    if result.rewritten:
        received.path.unlink(missing_ok=True)
        return canonical
    return received.path


def store_upload(
    ctx: AdminContext, *, round_id: int, principal: Principal, received: ReceivedUpload
) -> UploadReceipt:
    """Check and store one site's upload; replace its earlier upload of this round, if any."""
    canonical = ctx.files.tmp / f"{uuid.uuid4().hex}.h5"
    placed: list[Path] = []
    try:
        with ctx.sessions() as session:
            rnd = get_round(session, round_id)
            _check_open(rnd, utcnow())
            form_count = parse_form_count(received.fields.get(NUM_EXAMPLES_FIELD))
            if form_count is not None:
                check_count(form_count, principal)
            request = _request(
                ctx, rnd, num_examples=form_count, require_count=True, site=principal.site_name
            )
        result = ctx.sandbox.inspect(received.path, canonical, request)
        if result.file_site and result.file_site != principal.site_name:
            raise PermissionDeniedError(
                f"The file says it was trained by site {result.file_site!r} but the token belongs to "
                f"site {principal.site_name!r}; a site uploads only its own weights. Upload with that "
                f"site's token, or re-export without --site. Received: site={result.file_site!r}"
            )
        check_count(result.num_examples, principal)
        with ctx.write_lock, ctx.sessions() as session:
            site = _live_site(session, principal)
            rnd = get_round(session, round_id)
            _check_open(rnd, utcnow())
            _fix_model(rnd, result, "first_upload")
            previous = session.scalar(
                select(Upload).where(
                    Upload.round_id == round_id, Upload.site_id == principal.site_id, Upload.current
                )
            )
            kept = stored_file(received, canonical, result)
            _check_quota(ctx, session, principal, kept.stat().st_size,
                         previous.id if previous is not None else None)
            if previous is not None:
                previous.current = False
                previous.replaced_at = utcnow()
                session.flush()
            upload = Upload(
                round_id=round_id,
                site_id=principal.site_id,
                num_examples=result.num_examples,
                count_source=result.count_source,
                sha256=received.sha256,
                size_bytes=received.size,
                layout=result.layout,
                original_file="",
                client_filename=(received.filename or None) and received.filename[-255:],
                weights_file="",
                site_seq=1 + (session.scalar(
                    select(func.max(Upload.site_seq)).where(Upload.site_id == principal.site_id)) or 0),
                current=True,
            )
            session.add(upload)
            session.flush()
            weights = ctx.files.round_dir(round_id) / "uploads" / f"{upload.id}.h5"
            ctx.files.place(kept, weights)
            placed.append(weights)
            # the bytes sent are what is aggregated (fedsplit layout), or are not kept (Keras)
            upload.original_file = "" if result.rewritten else ctx.files.relative(weights)
            upload.weights_file = ctx.files.relative(weights)
            upload.site = site
            session.commit()
            placed.clear()
            if previous is not None:  # replaced: its row stays as history, its files go
                prune_files(ctx.files, previous)
            receipt = UploadReceipt(
                **upload_public(upload).model_dump(),
                round_id=round_id,
                replaced=public_id(previous) if previous is not None else None,
                parameters=[ParameterPublic.from_spec(s) for s in result.specs],
            )
    finally:
        for path in placed:  # committed nothing: remove what was renamed into place
            path.unlink(missing_ok=True)
        canonical.unlink(missing_ok=True)
    return receipt


def store_template(ctx: AdminContext, *, round_id: int, received: ReceivedUpload) -> Round:
    """Store the admin's template: it fixes the round's model and is its start model."""
    canonical = ctx.files.tmp / f"{uuid.uuid4().hex}.h5"
    try:
        with ctx.sessions() as session:
            rnd = get_round(session, round_id)
            _check_open(rnd, utcnow())
            if rnd.specs is not None:
                raise ConflictError(
                    f"Round {round_id}'s model is already fixed (by {rnd.model_source}); a template "
                    f"must come before the first upload. Create a new round for a new model. "
                    f"Received: model_source {rnd.model_source!r}"
                )
            request = _request(
                ctx, rnd, num_examples=parse_form_count(received.fields.get(NUM_EXAMPLES_FIELD)),
                require_count=False, site="template",
            )
        result = ctx.sandbox.inspect(received.path, canonical, request)
        with ctx.write_lock, ctx.sessions() as session:
            rnd = get_round(session, round_id)
            if rnd.specs is not None:
                raise ConflictError(
                    f"Round {round_id}'s model was fixed by {rnd.model_source} while the template "
                    f"was being checked. Create a new round. Received: model_source {rnd.model_source!r}"
                )
            _fix_model(rnd, result, "template")
            template = ctx.files.round_dir(round_id) / "template.h5"
            ctx.files.place(stored_file(received, canonical, result), template)
            rnd.template_file = ctx.files.relative(template)
            session.commit()
            session.refresh(rnd)
            _ = rnd.uploads
    finally:
        canonical.unlink(missing_ok=True)
    return rnd

"""The round's aggregate and start model as files, in fedsplit or Keras layout."""

from __future__ import annotations

from pathlib import Path

from fedsplit.protocol.keras_layout import KERAS3, write_keras
from fedsplit.protocol.weights import read_weights
from fedsplit.server.admin.auth import Principal
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.errors import ConflictError, NotFoundError
from fedsplit.server.admin.keras_layouts import get_layout
from fedsplit.server.admin.services.isolation import check_model_download, release_rule
from fedsplit.server.admin.tables import Round

FEDSPLIT_FORMAT = "fedsplit"
KERAS_FORMAT = "keras"
FORMATS = (FEDSPLIT_FORMAT, KERAS_FORMAT)


def model_file(ctx: AdminContext, rnd: Round, fmt: str, principal: Principal) -> tuple[Path, str]:
    """Return the aggregate's path and download name (a hospital: under the release rule)."""
    if rnd.model_file is None:
        raise NotFoundError(
            f"Round {rnd.id} has no model yet: it is {rnd.status}. The admin aggregates it with POST "
            f"/api/v1/rounds/{rnd.id}/aggregate. Received: status {rnd.status!r}"
        )
    check_model_download(principal, rnd.report, release_rule(ctx.settings), f"Round {rnd.id}'s aggregate")
    return _in_format(ctx, rnd, ctx.files.absolute(rnd.model_file), fmt, f"round-{rnd.id}-model")


def start_model_file(ctx: AdminContext, rnd: Round, continued: Round | None, fmt: str,
                     principal: Principal) -> tuple[Path, str]:
    """Return the start model's path (template, or the continued round's aggregate)."""
    if rnd.template_file is not None:
        source = ctx.files.absolute(rnd.template_file)
    elif continued is not None and continued.model_file is not None:
        check_model_download(principal, continued.report, release_rule(ctx.settings),
                             f"Round {rnd.id}'s start model (round {continued.id}'s aggregate)",
                             contributor=False)
        source = ctx.files.absolute(continued.model_file)
    else:
        raise NotFoundError(
            f"Round {rnd.id} has no start model: the admin has uploaded no template (PUT "
            f"/api/v1/rounds/{rnd.id}/template) and it continues no aggregated round. Sites must "
            f"share one starting point; ask the coordinator for it. Received: round {rnd.id}"
        )
    return _in_format(ctx, rnd, source, fmt, f"round-{rnd.id}-start")


def _in_format(ctx: AdminContext, rnd: Round, source: Path, fmt: str, stem: str) -> tuple[Path, str]:
    if fmt == FEDSPLIT_FORMAT:
        return source, f"{stem}.h5"
    if fmt != KERAS_FORMAT:
        raise NotFoundError(
            f"Unknown download format; use ?format=fedsplit (default) or ?format=keras. "
            f"Received: {fmt!r}"
        )
    with ctx.sessions() as session:
        layout = get_layout(session, rnd)
    if layout is None:
        raise ConflictError(
            f"Round {rnd.id} has no Keras layout: no upload or template of it was a Keras weights "
            f"file. Download ?format=fedsplit instead. Received: format={fmt!r}"
        )
    # rebuilt from the allow-listed layout (keras_layouts); copies an older server cached from the
    # whole layout (``*.keras.h5``, with every hospital-set attribute) are never served
    target = source.with_name(source.stem + ".keras-v2.h5")
    if not target.exists() or target.stat().st_mtime < source.stat().st_mtime:
        update = read_weights(source)
        write_keras(layout, update.arrays, target)
    suffix = ".weights.h5" if layout["kind"] == KERAS3 else ".h5"
    return target, f"{stem}{suffix}"

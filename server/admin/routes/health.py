"""Liveness (no token needed) and Prometheus metrics (the admin token: they show every upload's
size and every refusal's reason as it happens, which no hospital may watch)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from fedsplit.server.admin.deps import AdminPrincipal, ContextDep
from fedsplit.server.admin.schemas import ErrorPublic
from sqlalchemy import text

router = APIRouter(tags=["health"])


@router.get("/healthz")
def read_health(ctx: ContextDep) -> dict[str, str]:
    """Liveness: the database answers."""
    with ctx.sessions() as session:
        session.execute(text("SELECT 1"))
    return {"status": "ok"}


# the refusals are JSON (documented as such), the metrics plain text
METRICS_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"description": "Prometheus text format",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    **{code: {"model": ErrorPublic} for code in (401, 403, 429)},
}


@router.get("/metrics", responses=METRICS_RESPONSES)
def read_metrics(ctx: ContextDep, admin: AdminPrincipal) -> PlainTextResponse:
    """Prometheus metrics (admin token: ``Authorization: Bearer``, e.g. Prometheus's
    ``authorization`` scrape setting): uploads accepted/refused by reason, bytes, aggregation
    time."""
    return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

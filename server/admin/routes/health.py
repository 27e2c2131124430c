"""Liveness and Prometheus metrics (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from fedsplit.server.admin.deps import ContextDep
from sqlalchemy import text

router = APIRouter(tags=["health"])


@router.get("/healthz")
def read_health(ctx: ContextDep) -> dict[str, str]:
    """Liveness: the database answers."""
    with ctx.sessions() as session:
        session.execute(text("SELECT 1"))
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
def read_metrics(ctx: ContextDep) -> PlainTextResponse:
    """Prometheus metrics: uploads accepted/refused by reason, bytes, aggregation time."""
    return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

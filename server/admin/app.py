"""The admin API's FastAPI app factory and its one domain-error handler."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fedsplit.protocol.errors import FedsplitError
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.errors import TooManyRequestsError, status_of
from fedsplit.server.admin.limits import RequestGuard
from fedsplit.server.admin.routes import docs, health, rounds, uploads
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.ui import UI_PATH, install_ui
from fedsplit.server.admin.ui.pages import UIError, handle_ui_error
from starlette.exceptions import HTTPException

API_PREFIX = "/api/v1"

async def handle_fedsplit_error(request: Request, error: Exception) -> JSONResponse:
    """Turn a fedsplit error into ``{"detail", "error", "reason"}`` with its status."""
    assert isinstance(error, FedsplitError)
    status = status_of(error)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 413:
        headers = {"Connection": "close"}  # the rest of the body is not read
    if isinstance(error, TooManyRequestsError):
        headers = {"Retry-After": str(max(1, round(error.retry_after)))}
    body = {"detail": str(error), "error": type(error).__name__, "reason": getattr(error, "reason", None)}
    return JSONResponse(body, status_code=status, headers=headers)


async def handle_validation_error(request: Request, error: Exception) -> JSONResponse:
    """Answer a request FastAPI could not validate with the same body as every refusal (422).

    ``errors`` keeps each problem's location, message and type for API clients.
    """
    assert isinstance(error, RequestValidationError)
    if _under_ui(request):  # a page address: the web view's error page, nothing echoed
        return await handle_ui_error(request, UIError(404, "There is no such page."))
    problems = [
        {"loc": [str(part) for part in e.get("loc", ())], "msg": str(e.get("msg", "")),
         "type": str(e.get("type", ""))}
        for e in error.errors()
    ]
    first = problems[0] if problems else {"loc": [], "msg": "invalid request"}
    received = error.errors()[0].get("input") if error.errors() else None
    text = repr(received)
    if len(text) > 200:
        text = text[:200] + "..."
    detail = (
        f"The request is invalid: {'.'.join(first['loc']) or 'request'}: {first['msg']}"
        f"{f' (and {len(problems) - 1} more problem(s), see errors)' if len(problems) > 1 else ''}"
        f". Send it as the API's schema (GET /openapi.json) describes. Received: {text}"
    )
    body = {"detail": detail, "error": "RequestValidationError", "reason": "validation",
            "errors": problems}
    return JSONResponse(body, status_code=422)


async def handle_http_error(request: Request, error: Exception) -> JSONResponse:
    """Answer FastAPI's own HTTP errors (unparsable body 400, unknown path 404, wrong method
    405) with the same body as every refusal."""
    assert isinstance(error, HTTPException)
    if _under_ui(request):  # the web view's error page; the address is not echoed back
        message = "There is no such page." if error.status_code in (404, 405) else \
            "The request could not be read."
        return await handle_ui_error(request, UIError(error.status_code, message))
    detail = (
        f"{error.detail}. See the API's schema (GET /openapi.json) for its paths, methods and "
        f"bodies. Received: {request.method} {request.url.path}"
    )
    body = {"detail": detail, "error": "HTTPException", "reason": None}
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


def _under_ui(request: Request) -> bool:
    path = request.url.path
    return path == UI_PATH or path.startswith(UI_PATH + "/")


def create_app(settings: AdminSettings, *, sandbox: Sandbox | None = None) -> FastAPI:
    """Return the admin API for ``settings`` (creates the data directory and the database).

    ``sandbox`` shares one upload sandbox between apps (tests); by default the app starts its own.
    """
    ctx = AdminContext.open(settings, sandbox)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.close()

    app = FastAPI(
        title="fedsplit admin API",
        summary="Authenticated HDF5 weight uploads, aggregation rounds and model downloads.",
        version="1",
        lifespan=lifespan,
        docs_url=None,  # served from local files by routes.docs (unless --no-docs)
        redoc_url=None,
    )
    app.state.admin = ctx
    app.add_exception_handler(FedsplitError, handle_fedsplit_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(HTTPException, handle_http_error)
    api = APIRouter(prefix=API_PREFIX)
    api.include_router(rounds.router)
    api.include_router(uploads.router)
    app.include_router(api)
    app.include_router(health.router)
    if settings.docs:
        app.include_router(docs.router)
    install_ui(app, runs=settings.runs)  # the web view at /ui (server/admin/ui)
    app.add_middleware(RequestGuard, ctx=ctx)  # outermost: limits before any work (limits.py)
    return app

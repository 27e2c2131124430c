"""The API's interactive docs at ``/docs``, served from local files (no CDN: works offline).

Swagger UI's script, stylesheet and icon come from the ``swagger-ui-bundle`` package and are
served under ``/docs/assets/``; ``--no-docs`` (``AdminSettings.docs``) leaves ``/docs`` out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fedsplit.server.admin.errors import NotFoundError
from swagger_ui_bundle import swagger_ui_path

router = APIRouter(include_in_schema=False)

ASSETS = Path(swagger_ui_path)
#: The only files served, with their media types.
ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}


@router.get("/docs")
def read_docs() -> HTMLResponse:
    """Swagger UI over GET /openapi.json, its assets from this server."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title="fedsplit admin API - docs",
        swagger_js_url="/docs/assets/swagger-ui-bundle.js",
        swagger_css_url="/docs/assets/swagger-ui.css",
        swagger_favicon_url="/docs/assets/favicon-32x32.png",
    )


@router.get("/docs/assets/{name}")
def read_docs_asset(name: str) -> Response:
    """One of Swagger UI's files (`ASSET_TYPES`)."""
    media = ASSET_TYPES.get(name)
    if media is None:
        raise NotFoundError(f"/docs serves {sorted(ASSET_TYPES)} only. Received: {name[:100]!r}")
    return FileResponse(ASSETS / name, media_type=media, headers={"Cache-Control": "max-age=86400"})

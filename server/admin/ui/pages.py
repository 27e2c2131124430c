"""Page plumbing: templates, security headers, ETags, the signed-in principal, same-origin POSTs."""

from __future__ import annotations

import hashlib
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from fedsplit.server.admin.auth import ADMIN, Principal, live_principal
from fedsplit.server.admin.ui.baselines import metric_label
from fedsplit.server.admin.ui.sessions import COOKIE, SessionStore

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
LIVE_HEADER = "x-fedsplit-live"

#: Everything from this origin only; no inline script or style; no framing; forms post here.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class UIError(Exception):
    """A page that cannot be shown: rendered as an HTML error page (or a redirect), not API JSON."""

    def __init__(self, status: int, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.location = location


async def handle_ui_error(request: Request, error: Exception) -> Response:
    """Answer a `UIError`: redirect, bare 401 for the live poller, or an error page."""
    assert isinstance(error, UIError)
    if error.location is not None:
        return with_headers(RedirectResponse(error.location, status_code=303))
    if request.headers.get(LIVE_HEADER):
        return with_headers(Response(error.message, status_code=error.status, media_type="text/plain"))
    principal = current_principal(request)
    return render(request, "error.html", {
        "title": f"Error {error.status}", "message": error.message, "status": error.status,
        "principal": principal, "admin": principal is not None and principal.role == ADMIN,
    }, status_code=error.status)


def when(value: datetime | None) -> str:
    """A UTC timestamp as 'YYYY-MM-DD HH:MM:SS UTC' ('' for None)."""
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else ""


def number(value: float | int | None, digits: int = 4) -> str:
    """A number for a table cell ('' for None)."""
    if value is None:
        return ""
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def size(value: int | None) -> str:
    """Bytes as B/KiB/MiB."""
    if value is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024  # type: ignore[assignment]
    return str(value)


def make_templates() -> Jinja2Templates:
    """The web view's templates (autoescaping on: names and reasons are untrusted)."""
    templates = Jinja2Templates(directory=str(TEMPLATES))
    env = templates.env
    env.autoescape = True
    env.filters.update(when=when, number=number, size=size, metric=metric_label)
    return templates


def with_headers(response: Response) -> Response:
    """Add the security headers and forbid caching (pages hold federation data)."""
    response.headers.update(SECURITY_HEADERS)
    response.headers["Cache-Control"] = "no-store"
    return response


def render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
    """Render a template with an ETag; answer 304 when the browser's If-None-Match matches."""
    templates: Jinja2Templates = request.app.state.ui.templates
    html = templates.get_template(name).render({"request": request, **context})
    etag = '"' + hashlib.sha256(html.encode()).hexdigest()[:32] + '"'
    if status_code == 200 and request.headers.get("if-none-match") == etag:
        return with_headers(Response(status_code=304, headers={"ETag": etag}))
    response = HTMLResponse(html, status_code=status_code, headers={"ETag": etag})
    return with_headers(response)


def session_store(request: Request) -> SessionStore:
    """The process's sessions."""
    return request.app.state.ui.sessions


def current_principal(request: Request) -> Principal | None:
    """The signed-in principal of this browser, or None.

    Checked against the database on every request: a session whose hospital was removed, or
    whose token was rotated since sign-in, ends here.
    """
    cached = getattr(request.state, "ui_principal", False)
    if cached is not False:
        return cached
    store = session_store(request)
    sid = request.cookies.get(COOKIE)
    session = store.get(sid)
    principal = None
    if session is not None:
        ctx = request.app.state.admin
        with ctx.sessions() as db:
            principal = live_principal(db, session.principal, session.token_hash,
                                       admin_token_hash=ctx.admin_token_hash)
        if principal is None:
            store.end(sid)
    request.state.ui_principal = principal
    return principal


def require_principal(request: Request) -> Principal:
    """The signed-in principal; otherwise 401 for the live poller, a redirect to sign-in for pages."""
    principal = current_principal(request)
    if principal is None:
        if request.headers.get(LIVE_HEADER):
            raise UIError(401, "signed out")
        raise UIError(303, "sign in first", location="/ui/login")
    return principal


def require_admin(request: Request) -> Principal:
    """The signed-in admin; a hospital gets 403."""
    principal = require_principal(request)
    if principal.role != ADMIN:
        raise UIError(403, "Only the admin may open this; a hospital's token sees its own rounds only.")
    return principal


def same_origin(request: Request) -> bool:
    """Whether a POST comes from this site's own pages.

    Browsers send ``Sec-Fetch-Site`` (scripts cannot set it): only ``same-origin`` passes. An
    ``Origin`` header, when sent, must name this scheme and host (``http://`` is not the origin
    of an ``https://`` server); one that does not parse is refused. A request with neither (not
    a browser) passes, since it carries no ambient cookie a forger could ride on.
    """
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site != "same-origin":
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return fetch_site == "same-origin" or fetch_site is None
    try:
        parts = urlsplit(origin)
        netloc = parts.netloc
        _ = parts.port  # raises ValueError on a malformed port
    except ValueError:
        return False
    return (parts.scheme == request.url.scheme and not parts.path.strip("/")
            and netloc.lower() == request.headers.get("host", "").lower())

"""Dependencies of the admin routes, as `Annotated` aliases."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fedsplit.server.admin.auth import Principal, require_admin, require_site
from fedsplit.server.admin.context import AdminContext
from fedsplit.server.admin.schemas import MAX_ID
from sqlalchemy.orm import Session

_bearer = HTTPBearer(auto_error=False, description="Admin token or a site token.")


def get_context(request: Request) -> AdminContext:
    """The process's `AdminContext`."""
    return request.app.state.admin


ContextDep = Annotated[AdminContext, Depends(get_context)]

#: A round id in a path: 1 .. 2**63-1 (what the database can hold), else JSON 422.
RoundId = Annotated[int, Path(ge=1, le=MAX_ID, description="Round id (1 .. 2**63-1).")]


def get_session(ctx: ContextDep) -> Iterator[Session]:
    """A database session for one request."""
    with ctx.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_identity(
    request: Request, ctx: ContextDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Who the caller is, from the bearer token (401 if none or unknown, 429 after repeated
    failures); `admit` is the rest of `get_principal`."""
    token = credentials.credentials if credentials is not None else None
    return ctx.check_bearer(token, client_address(request))


def admit(ctx: AdminContext, principal: Principal) -> Principal:
    """429 when a hospital's requests come faster than ``--site-requests-per-minute``."""
    if principal.site_id is not None:
        ctx.request_rate.take(principal.site_id, str(principal.site_name))
    return principal


def get_principal(ctx: ContextDep, principal: Annotated[Principal, Depends(get_identity)]) -> Principal:
    """The caller, from the bearer token (401 if none or unknown, 429 after repeated failures,
    or when a hospital's requests come faster than ``--site-requests-per-minute``)."""
    return admit(ctx, principal)


def client_address(request: Request) -> str:
    """The client's IP address as the server saw it (a proxy's, behind a proxy)."""
    return request.client.host if request.client is not None else "unknown"


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
#: The caller identified but not yet admitted (`admit`): for a route that records its own refusals.
IdentifiedPrincipal = Annotated[Principal, Depends(get_identity)]


def get_admin(principal: CurrentPrincipal) -> Principal:
    """The caller, who must be the admin (403 otherwise)."""
    return require_admin(principal)


def get_site(principal: CurrentPrincipal) -> Principal:
    """The caller, who must be a site (403 otherwise)."""
    return require_site(principal)


AdminPrincipal = Annotated[Principal, Depends(get_admin)]
SitePrincipal = Annotated[Principal, Depends(get_site)]

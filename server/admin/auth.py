"""Who is calling: the admin, or one registered site, from a bearer token."""

from __future__ import annotations

from dataclasses import dataclass

from fedsplit.server.admin.errors import AuthenticationError, PermissionDeniedError
from fedsplit.server.admin.security import hash_token, same_hash
from fedsplit.server.admin.tables import Site
from sqlalchemy import select
from sqlalchemy.orm import Session

ADMIN = "admin"
SITE = "site"


@dataclass(frozen=True)
class Principal:
    """The caller: ``role`` is "admin" or "site"; sites carry their id, name and cohort size."""

    role: str
    site_id: int | None = None
    site_name: str | None = None
    cohort_size: int | None = None


def authenticate(token: str | None, *, session: Session, admin_token_hash: str) -> Principal:
    """Return the principal of ``token``; raise `AuthenticationError` (401) if there is none."""
    if not token:
        raise AuthenticationError(
            "This endpoint needs a bearer token: send 'Authorization: Bearer <token>' with the admin "
            "token or the site token `fedsplit admin add-site` printed. Received: no token"
        )
    digest = hash_token(token)
    if same_hash(digest, admin_token_hash):
        return Principal(role=ADMIN)
    site = session.scalar(select(Site).where(Site.token_hash == digest, Site.removed_at.is_(None)))
    if site is None or not same_hash(digest, site.token_hash):
        raise AuthenticationError(
            "The bearer token matches no admin and no registered site. Use the token "
            "`fedsplit admin add-site` or `fedsplit admin rotate-token` printed last (a rotated or "
            "removed site's old token is refused). Received: an unknown token"
        )
    return Principal(role=SITE, site_id=site.id, site_name=site.name, cohort_size=site.cohort_size)


def live_principal(session: Session, principal: Principal, token_hash: str, *,
                   admin_token_hash: str) -> Principal | None:
    """``principal`` as it stands now, if ``token_hash`` (the token it signed in with) is still its
    token; None once the site was removed or its token rotated (or the admin token changed)."""
    if principal.role == ADMIN:
        return principal if same_hash(token_hash, admin_token_hash) else None
    site = session.get(Site, principal.site_id)
    if site is None or site.removed_at is not None or not same_hash(token_hash, site.token_hash):
        return None
    return Principal(role=SITE, site_id=site.id, site_name=site.name, cohort_size=site.cohort_size)


def require_admin(principal: Principal) -> Principal:
    """Refuse (403) anyone but the admin."""
    if principal.role != ADMIN:
        raise PermissionDeniedError(
            "Only the admin token may do this; site tokens upload and download only. Use "
            f"FEDSPLIT_ADMIN_TOKEN. Received: the token of site {principal.site_name!r}"
        )
    return principal


def require_site(principal: Principal) -> Principal:
    """Refuse (403) the admin: uploads are made by a site, as itself."""
    if principal.role != SITE:
        raise PermissionDeniedError(
            "Uploads are made by a site with its own token, so the upload is counted for that site; "
            "the admin token cannot upload (use PUT .../template for a template). Received: the "
            "admin token"
        )
    return principal

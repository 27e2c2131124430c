"""Server-side sessions of the web view: a random id in the cookie, the principal in memory.

The browser never holds the token after sign-in: the sign-in form posts it once, the server
checks it like a bearer token and answers with a cookie that carries only a random session id
(HttpOnly, SameSite=Strict, Path=/ui, Secure behind HTTPS). The id maps to the `Principal` in
this process's memory, so a restart signs everyone out and a stolen database holds no session.
Sessions end after `IDLE_S` without a request, `MAX_AGE_S` after sign-in, or at sign-out.

A session belongs to a live identity: it keeps the hash of the token it signed in with, and every
request checks it against the admin token or the hospital's current token (`auth.live_principal`),
so `fedsplit admin remove-site` and `rotate-token` end it at the next request. Signing in again
ends the browser's previous session. Each identity holds at most `MAX_SESSIONS_PER_IDENTITY`
sessions: its own oldest is dropped first, never another identity's.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from fedsplit.server.admin.auth import ADMIN, Principal

COOKIE = "fedsplit_ui"
IDLE_S = 2 * 3600.0
MAX_AGE_S = 12 * 3600.0
MAX_SESSIONS_PER_IDENTITY = 20


def identity_of(principal: Principal) -> str:
    """The identity a session belongs to: the admin, or one hospital (by its row id)."""
    return ADMIN if principal.role == ADMIN else f"site:{principal.site_id}"


@dataclass
class UISession:
    """One signed-in browser."""

    principal: Principal
    token_hash: str
    created: float
    seen: float


class SessionStore:
    """Session id -> principal, bounded per identity and in lifetime; thread-safe."""

    def __init__(self, *, idle_s: float = IDLE_S, max_age_s: float = MAX_AGE_S,
                 per_identity: int = MAX_SESSIONS_PER_IDENTITY) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.per_identity = per_identity
        self._sessions: dict[str, UISession] = {}
        self._by_identity: dict[str, OrderedDict[str, None]] = {}
        self._lock = threading.Lock()

    def create(self, principal: Principal, token_hash: str, *, replaces: str | None = None) -> str:
        """Start a session for ``principal`` (signed in with the token hashing to ``token_hash``)
        and return its id (256 random bits); the session ``replaces`` (the browser's old one) ends."""
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        identity = identity_of(principal)
        with self._lock:
            if replaces:
                self._drop(replaces)
            self._sessions[sid] = UISession(principal, token_hash, now, now)
            own = self._by_identity.setdefault(identity, OrderedDict())
            own[sid] = None
            while len(own) > self.per_identity:
                oldest, _ = own.popitem(last=False)
                self._sessions.pop(oldest, None)
        return sid

    def get(self, sid: str | None) -> UISession | None:
        """A live session, or None (unknown, idle too long or too old)."""
        if not sid:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                return None
            if now - session.seen > self.idle_s or now - session.created > self.max_age_s:
                self._drop(sid)
                return None
            session.seen = now
            return session

    def end(self, sid: str | None) -> None:
        """Sign out: forget the session (a no-op for unknown ids)."""
        if sid:
            with self._lock:
                self._drop(sid)

    def count(self, principal: Principal) -> int:
        """Live sessions of ``principal``'s identity."""
        with self._lock:
            return len(self._by_identity.get(identity_of(principal), ()))

    def _drop(self, sid: str) -> None:
        session = self._sessions.pop(sid, None)
        if session is not None:
            identity = identity_of(session.principal)
            own = self._by_identity.get(identity)
            if own is not None:
                own.pop(sid, None)
                if not own:
                    del self._by_identity[identity]

    def __len__(self) -> int:
        return len(self._sessions)

"""Server-side sessions of the web view: a random id in the cookie, the principal in memory.

The browser never holds the token after sign-in: the sign-in form posts it once, the server
checks it like a bearer token and answers with a cookie that carries only a random session id
(HttpOnly, SameSite=Strict, Path=/ui, Secure behind HTTPS). The id maps to the `Principal` in
this process's memory, so a restart signs everyone out and a stolen database holds no session.
Sessions end after `IDLE_S` without a request, `MAX_AGE_S` after sign-in, or at sign-out; at
most `MAX_SESSIONS` live at once (the oldest is dropped first).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from fedsplit.server.admin.auth import Principal

COOKIE = "fedsplit_ui"
IDLE_S = 2 * 3600.0
MAX_AGE_S = 12 * 3600.0
MAX_SESSIONS = 1000


@dataclass
class UISession:
    """One signed-in browser."""

    principal: Principal
    created: float
    seen: float


class SessionStore:
    """Session id -> principal, bounded in number and lifetime; thread-safe."""

    def __init__(self, *, idle_s: float = IDLE_S, max_age_s: float = MAX_AGE_S,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, UISession] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, principal: Principal) -> str:
        """Start a session for ``principal`` and return its id (256 random bits)."""
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            self._sessions[sid] = UISession(principal, now, now)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return sid

    def get(self, sid: str | None) -> Principal | None:
        """The principal of a live session, or None (unknown, idle too long or too old)."""
        if not sid:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                return None
            if now - session.seen > self.idle_s or now - session.created > self.max_age_s:
                del self._sessions[sid]
                return None
            session.seen = now
            return session.principal

    def end(self, sid: str | None) -> None:
        """Sign out: forget the session (a no-op for unknown ids)."""
        if sid:
            with self._lock:
                self._sessions.pop(sid, None)

    def __len__(self) -> int:
        return len(self._sessions)

"""Limits applied before any route runs: the outermost ASGI middleware of the admin app.

In this order, each refusal answered without reading the request body:

1. headers (names, values, path and query together) over `MAX_HEADER_BYTES`: 431;
2. a ``Host`` header outside ``--allowed-hosts`` (DNS rebinding): 400;
3. a declared ``Content-Length`` over the route's body cap: 413;
4. a write to the API (``POST``/``PUT``/``PATCH``/``DELETE`` under ``/api/``) without a valid
   bearer token: 401 (429 while the address is waiting after failed sign-ins).

Then the body streams through a counter and is cut at the route's cap (413), whatever the
headers said: sign-in and sign-out forms `FORM_BODY_MAX`, uploads and templates the upload limit
plus multipart framing, every other request `JSON_BODY_MAX`. Every refusal here closes the
connection (``Connection: close``), so the rest of the body is never read; so does every other
answer that starts before the request's body was read to its end (a 405, a 401 or 429 of a route,
a 404): otherwise the server would go on reading and discarding a body nobody wants, for as long
as the client sends it. Every response gets ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fedsplit.server.admin.errors import AuthenticationError, TooManyRequestsError
from fedsplit.server.admin.receive import BODY_OVERHEAD
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Request line and headers together, in bytes (uvicorn is started with the same limit).
MAX_HEADER_BYTES = 32 * 1024
#: Sign-in and sign-out forms (a token is at most 1024 characters).
FORM_BODY_MAX = 4 * 1024
#: JSON bodies (round creation) and any other request that is not an upload.
JSON_BODY_MAX = 64 * 1024
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
UPLOAD_ROUTES = re.compile(r"^/api/v1/rounds/[^/]+/(uploads|template)/?$")
FORM_ROUTES = frozenset({"/ui/login", "/ui/logout"})
#: ``--allowed-hosts`` entry that turns the Host check off.
ANY_HOST = "*"


def body_cap(path: str, method: str, max_upload_bytes: int) -> int:
    """The largest body accepted on ``method path``, in bytes."""
    if method in ("POST", "PUT") and UPLOAD_ROUTES.match(path):
        return max_upload_bytes + BODY_OVERHEAD + 64 * 1024  # the route's own 413 comes first
    if path.rstrip("/") in FORM_ROUTES:
        return FORM_BODY_MAX
    return JSON_BODY_MAX


def host_of(header: str) -> str:
    """The host name of a ``Host`` header value, without port or IPv6 brackets, lower-case."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def normalize_hosts(hosts: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``--allowed-hosts`` entries as `host_allowed` compares them."""
    return tuple(h.strip().lower().strip("[]") for h in hosts if h.strip())


WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind: str) -> tuple[str, ...]:
    """``--allowed-hosts`` when not given: the bound address and localhost; for a wildcard bind
    (0.0.0.0, ::) this machine's host name, fully qualified name and their addresses as well."""
    hosts = list(LOCAL_HOSTS)
    if bind.strip().lower() in WILDCARD_BINDS:
        import socket

        names = {socket.gethostname(), socket.getfqdn()}
        hosts += sorted(names)
        for name in sorted(names):
            try:
                hosts += sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
            except OSError:
                continue
    else:
        hosts.append(bind)
    return tuple(dict.fromkeys(h.lower().strip("[]") for h in hosts if h))


def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether ``header`` names an allowed host (``*``: any; ``*.example.org``: its subdomains)."""
    if ANY_HOST in allowed:
        return True
    if not header:
        return False
    host = host_of(header)
    return any(host == a or (a.startswith("*.") and host.endswith(a[1:])) for a in allowed)


def _error(status: int, error: str, detail: str, reason: str | None = None,
           headers: dict[str, str] | None = None) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    body = json.dumps({"detail": detail, "error": error, "reason": reason}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close"), (b"x-content-type-options", b"nosniff")]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    return status, body, raw


async def _respond(send: Send, answer: tuple[int, bytes, list[tuple[bytes, bytes]]]) -> None:
    status, body, headers = answer
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def has_body(scope: Scope) -> bool:
    """Whether the request announces a body (``Transfer-Encoding``, or a ``Content-Length`` other
    than 0)."""
    for key, value in scope.get("headers", []):
        name = key.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization", "")
    if value[:7].lower() == "bearer " and value[7:].strip():
        return value[7:].strip()
    return None


class RequestGuard:
    """The limits above; ``ctx`` is the app's `AdminContext`."""

    def __init__(self, app: ASGIApp, ctx: Any) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse early, or pass the request on with a capped body stream."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.ctx
        answer = await self._refusal(scope)
        if answer is not None:
            await _respond(send, answer)
            return
        cap = body_cap(scope.get("path", ""), scope.get("method", ""), ctx.settings.max_upload_bytes)
        state = {"read": 0, "started": False, "refused": False, "body_done": not has_body(scope)}

        async def capped_receive() -> Message:
            if state["refused"]:
                return {"type": "http.disconnect"}
            if state["read"] > cap:  # the app asks for more than the cap: answer 413 ourselves
                state["refused"] = True
                if not state["started"]:
                    state["started"] = True
                    await _respond(send, _too_large(cap, f"more than {cap} bytes of body"))
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                if not message.get("more_body", False):
                    state["body_done"] = True
                body = message.get("body", b"")
                before = state["read"]
                state["read"] += len(body)
                if state["read"] > cap:
                    # the app gets the bytes up to the cap plus one (a route with its own, smaller
                    # limit answers it with its own message); the next read ends the request
                    message = {"type": "http.request", "body": body[: cap - before + 1],
                               "more_body": True}
            return message

        async def marked_send(message: Message) -> None:
            if state["refused"]:
                return  # our 413 is the answer; the app's reaction to the cut body is dropped
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-content-type-options" for k, _ in headers):
                    headers.append((b"x-content-type-options", b"nosniff"))
                if not state["body_done"] and not any(k.lower() == b"connection" for k, _ in headers):
                    # answered before the body was read: close, or the server would drain it
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, capped_receive, marked_send)
        except Exception:
            if not state["refused"]:
                raise  # a real failure: Starlette's error middleware answers 500

    async def _refusal(self, scope: Scope) -> tuple[int, bytes, list[tuple[bytes, bytes]]] | None:
        ctx = self.ctx
        client = scope.get("client")
        address = client[0] if client else "unknown"
        raw_headers = scope.get("headers", [])
        size = len(scope.get("raw_path", b"") or b"") + len(scope.get("query_string", b""))
        size += sum(len(k) + len(v) + 4 for k, v in raw_headers)
        if size > MAX_HEADER_BYTES:
            await _noise(ctx, "header_too_large", address)
            return _error(431, "RequestHeaderFieldsTooLarge",
                          f"The request's headers are larger than {MAX_HEADER_BYTES} bytes; send "
                          f"a bearer token and the usual headers only. Received: {size} bytes",
                          "header_too_large")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
        if not host_allowed(headers.get("host"), ctx.allowed_hosts):
            await _noise(ctx, "host", address)
            shown = headers.get("host", "(none)")[:100]
            return _error(400, "HostNotAllowed",
                          "The Host header names a host this server does not answer for (it may be "
                          "a DNS-rebinding page). Use the server's own address, or start it with "
                          f"--allowed-hosts naming this host. Received: Host {shown!r}", "host")
        path, method = scope.get("path", ""), scope.get("method", "")
        if method in WRITE_METHODS and path.startswith("/api/"):
            try:
                await run_in_threadpool(ctx.check_bearer, _bearer(headers), address)
            except TooManyRequestsError as e:
                return _error(429, "TooManyRequestsError", str(e), "rate_limited",
                              {"Retry-After": str(max(1, round(e.retry_after)))})
            except AuthenticationError as e:
                return _error(401, "AuthenticationError", str(e), None, {"WWW-Authenticate": "Bearer"})
        cap = body_cap(path, method, ctx.settings.max_upload_bytes)
        declared = headers.get("content-length", "")
        # an upload's declared length is checked by its route (a 413 the refusal log records)
        if (declared.isascii() and declared.isdigit() and int(declared) > cap
                and not UPLOAD_ROUTES.match(path)):
            if not path.startswith("/api/"):
                await _noise(ctx, "too_large", address)
            return _too_large(cap, f"Content-Length {declared[:20]}")
        return None


async def _noise(ctx: Any, kind: str, address: str) -> None:
    if ctx.unauthenticated(kind, address):
        await run_in_threadpool(ctx.audit.flush_noise, force=False)


def _too_large(cap: int, received: str) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    return _error(413, "RequestTooLargeError",
                  f"The request body is larger than this route's limit of {cap} bytes (sign-in "
                  f"forms {FORM_BODY_MAX}, JSON {JSON_BODY_MAX}, uploads the server's "
                  f"--max-upload-mb). Received: {received}", "too_large")

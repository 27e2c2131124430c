"""Drive an ASGI app directly, counting how much of the request body it reads."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_LOCAL = threading.local()


def _runner() -> asyncio.Runner:
    """One event loop per thread, kept between calls, as a server keeps its loop (and its worker
    threads) between requests; a fresh loop per request cost more than the request itself."""
    runner = getattr(_LOCAL, "runner", None)
    if runner is None:
        runner = _LOCAL.runner = asyncio.Runner()
        atexit.register(runner.close)
    return runner


@dataclass
class Answer:
    """The response, and how many body chunks/bytes the app pulled from the client."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks_read: int = 0
    bytes_read: int = 0


def call(app: Any, method: str, path: str, headers: dict[str, str],
         chunks: Iterable[bytes] = (), *, client: str = "203.0.113.9") -> Answer:
    """Send one request to ``app``; ``chunks`` are produced lazily, only as the app asks."""
    answer = Answer()
    source = iter(chunks)
    pending: list[bytes | None] = []

    def next_chunk() -> bytes | None:
        if pending:
            return pending.pop()
        return next(source, None)

    async def receive() -> dict[str, Any]:
        chunk = next_chunk()
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        answer.chunks_read += 1
        answer.bytes_read += len(chunk)
        following = next_chunk()
        if following is not None:
            pending.append(following)
        return {"type": "http.request", "body": chunk, "more_body": following is not None}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": (client, 40000), "server": ("127.0.0.1", 8080),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
    }
    _runner().run(app(scope, receive, send))
    return answer

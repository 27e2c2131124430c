"""Drive an ASGI app directly, counting how much of the request body it reads."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class _ServerLoop:
    """One event loop in a thread of its own, with one long-lived root task, as uvicorn keeps its
    loop between requests: anyio then keeps its worker threads (it stops them with the root
    task), where a fresh loop per request started and joined a thread for every request."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve() -> None:
            self.stop = asyncio.Event()
            started.set()
            await self.stop.wait()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),),
                                       name="asgi-probe-loop", daemon=True)
        self.thread.start()
        started.wait(timeout=30)
        atexit.register(self.close)

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop and wait for it (at most 5 minutes)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=10)


_LOOP: _ServerLoop | None = None
_LOOP_LOCK = threading.Lock()


def _server_loop() -> _ServerLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = _ServerLoop()
        return _LOOP


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
    _server_loop().run(app(scope, receive, send))
    return answer

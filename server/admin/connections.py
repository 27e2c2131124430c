"""How `fedsplit admin serve` runs uvicorn: forwarded headers, header and idle timeouts.

uvicorn does the serving; this module only chooses its settings and adds one deadline it lacks.

- **Forwarded headers** (``X-Forwarded-For``/``-Proto``) are trusted only from the proxies the
  operator names (``--forwarded-allow-ips``, uvicorn's own ``forwarded_allow_ips``); by default
  none, so a client cannot choose the address the rate limits and the audit log see.
- **Idle connections** between requests are closed after uvicorn's ``timeout_keep_alive``
  (``--idle-timeout``).
- **Header deadline** (``--header-timeout``): a connection must send a whole request line and
  headers within this many seconds of opening (or of its previous response). uvicorn restarts its
  keep-alive timer at every byte, so a client trickling one header byte at a time, or one that
  connects and sends nothing, was never closed; `HeaderDeadlineH11Protocol` is uvicorn's h11
  protocol with that one timer added (the header size itself is bounded by h11's
  ``h11_max_incomplete_event_size``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: Seconds a connection has to send a request's line and headers.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds an idle keep-alive connection stays open between requests.
DEFAULT_IDLE_TIMEOUT_S = 5


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose headers do not arrive in time."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole request line and headers arrived
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request's headers get the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with(header_timeout_s: float) -> type[HeaderDeadlineH11Protocol]:
    """The protocol class uvicorn is given (``http=``), with this header deadline."""
    return type("AdminH11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout_s": header_timeout_s})


def forwarded_settings(allow_ips: list[str] | None) -> dict[str, Any]:
    """uvicorn's ``proxy_headers``/``forwarded_allow_ips`` for ``--forwarded-allow-ips``: off
    unless proxies are named (uvicorn would otherwise trust 127.0.0.1, or $FORWARDED_ALLOW_IPS)."""
    named = [ip.strip() for entry in allow_ips or [] for ip in entry.split(",") if ip.strip()]
    if not named:
        return {"proxy_headers": False, "forwarded_allow_ips": ""}
    return {"proxy_headers": True, "forwarded_allow_ips": named}

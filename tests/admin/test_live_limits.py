"""Issue 25 on a real `fedsplit admin serve` (uvicorn, 127.0.0.1 only): what an unauthenticated
400 MB body and a 50 MB header cost the server.

The bodies are generators: httpx sends them chunked, each chunk made only when the socket takes
it, so the test itself never holds more than one 1 MiB chunk. The server's memory (resident set,
sampled every 20 ms, and its peak) and the disk under its data directory and TMPDIR are measured
around each request.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.admin.conftest import ADMIN
from tests.admin.test_live_server import LiveServer

MIB = 1024 * 1024
BODY = 400 * MIB
LIMIT = 10 * MIB  # what an unauthenticated body may cost, memory and disk each


def _rss(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _disk(*folders: Path) -> int:
    return sum(p.stat().st_size for folder in folders for p in folder.rglob("*") if p.is_file())


class Meter:
    """Peak resident memory and disk use of the server while a request runs."""

    def __init__(self, server: LiveServer, tmp: Path) -> None:
        self.pid = server.proc.pid  # type: ignore[union-attr]
        self.folders = (server.data_dir, tmp)
        self.rss0 = _rss(self.pid)
        self.disk0 = _disk(*self.folders)
        self.peak_rss = self.rss0
        self.peak_disk = self.disk0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, _rss(self.pid))
            self.peak_disk = max(self.peak_disk, _disk(*self.folders))

    def __enter__(self) -> Meter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, _rss(self.pid))

    @property
    def memory(self) -> int:
        return self.peak_rss - self.rss0

    @property
    def disk(self) -> int:
        return self.peak_disk - self.disk0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    """One server for the probes, as one long-running server meets them (each probe measures
    its own request: memory and disk from just before it, and the server still answers)."""
    root = tmp_path_factory.mktemp("live")
    tmp = root / "tmp"
    tmp.mkdir()
    server = LiveServer(root / "data", env={"TMPDIR": str(tmp)})
    server.start()
    yield server, tmp
    server.stop()


def _body(head: bytes, sent: list[int]) -> Iterator[bytes]:
    yield head
    sent[0] += len(head)
    chunk = b"\0" * MIB
    for _ in range(BODY // MIB):
        yield chunk
        sent[0] += MIB


@pytest.mark.parametrize(("path", "content_type", "head", "status"), [
    ("/ui/login", "multipart/form-data; boundary=B",
     b'--B\r\nContent-Disposition: form-data; name="token"; filename="t"\r\n\r\n', 413),
    ("/api/v1/rounds", "application/json", b'{"strategy": "', 401),
    ("/api/v1/rounds/1/uploads", "multipart/form-data; boundary=B",
     b'--B\r\nContent-Disposition: form-data; name="file"; filename="x.h5"\r\n\r\n', 401),
])
def test_unauthenticated_400_mb_body_costs_under_10_mb(live, path, content_type, head, status):
    """The probes: 400 MB to POST /ui/login (once spooled to a 397 MB file) and 50+ MB bodies
    without a token to the API (once parsed: +289 MB). Each now costs < 10 MB of memory and disk."""
    server, tmp = live
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/api/v1/rounds", json={}, headers=ADMIN).status_code == 201
    sent = [0]
    started = time.perf_counter()
    with Meter(server, tmp) as meter:
        try:
            response = httpx.post(f"{server.url}{path}", content=_body(head, sent),
                                  headers={"Content-Type": content_type}, timeout=60)
            answered = response.status_code
        except httpx.TransportError as e:  # the server closed the socket: nothing answered
            answered = repr(e)
    seconds = time.perf_counter() - started
    print(f"{path}: answered {answered} after the client sent {sent[0] / MIB:.1f} MiB in "
          f"{seconds:.2f} s; server memory +{meter.memory / MIB:.2f} MiB, disk "
          f"+{meter.disk / MIB:.2f} MiB")
    assert answered == status
    assert meter.memory < LIMIT and meter.disk < LIMIT
    assert sent[0] < BODY  # the server stopped reading: the client could not send it all
    with httpx.Client(base_url=server.url, timeout=30) as http:  # and the server still answers
        assert http.get("/healthz").status_code == 200


def test_50_mb_header_is_refused(live):
    """Probe: a 50 MB header was answered 200. uvicorn (h11, 32 KiB buffer) now refuses it
    before holding it; the app refuses anything over the same limit with 431."""
    server, tmp = live
    sent = 0
    with Meter(server, tmp) as meter, socket.create_connection(("127.0.0.1", server.port), 10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        try:
            for _ in range(50):
                s.sendall(b"a" * MIB)
                sent += MIB
        except OSError:
            pass
        try:
            reply = s.recv(200)
        except OSError:
            reply = b""
    print(f"50 MB header: server stopped it after {sent / MIB:.0f} MiB sent, memory "
          f"+{meter.memory / MIB:.2f} MiB; reply {reply[:40]!r}")
    assert sent < 50 * MIB
    assert reply == b"" or reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431"))
    assert meter.memory < LIMIT


def test_served_hosts_default_and_setting(live, tmp_path):
    """`admin serve --host 127.0.0.1` answers 127.0.0.1 and localhost only (DNS rebinding);
    FEDSPLIT_ALLOWED_HOSTS (or --allowed-hosts) adds names, loopback is always answered.
    The probes' server is started without the setting, so it is the plain case."""
    plain, _ = live
    named = LiveServer(tmp_path / "b", env={"FEDSPLIT_ALLOWED_HOSTS": "fl.hospital.example"})
    named.start()
    try:
        for server, host, status in ((plain, "localhost", 200), (plain, "rebind.attacker.example", 400),
                                     (plain, "fl.hospital.example", 400),
                                     (named, "fl.hospital.example:8443", 200), (named, "localhost", 200),
                                     (named, "rebind.attacker.example", 400)):
            response = httpx.get(f"{server.url}/healthz", headers={"Host": host}, timeout=10)
            assert response.status_code == status, (server.url, host)
    finally:
        named.stop()

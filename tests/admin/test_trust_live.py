"""Issue 33 on a real `fedsplit admin serve` (uvicorn, 127.0.0.1): forwarded addresses, bodies the
app never reads, header and idle timeouts.

One server with the defaults (plus a 1 s header deadline, so the slow-client probes take seconds)
meets the probes, as a long-running server would. The proxy case (--forwarded-allow-ips) is in
test_trust_boundary.py, through uvicorn's own proxy-headers middleware.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fedsplit.server.admin import audit
from fedsplit.server.admin.store import add_site, open_engine

from tests.admin.conftest import ADMIN, ADMIN_TOKEN, bearer, forge_audit_record, verify_audit, write_model
from tests.admin.test_live_server import LiveServer
from tests.admin.test_trust_boundary import chunk_bomb, gzip_bomb

SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`admin serve` with its defaults (no trusted proxy), headers due within 1 s."""
    server = LiveServer(tmp_path_factory.mktemp("plain") / "data", args=("--header-timeout", "1"))
    server.start()
    yield server
    server.stop()


def _audited(data_dir: Path, event: str) -> list[audit.AuditRecord]:
    engine = open_engine(data_dir=data_dir)
    try:
        return audit.query(engine, events=[event], limit=1000)
    finally:
        engine.dispose()


def test_forged_forwarded_for_changes_neither_limit_nor_audit(plain):
    """Issue 33, defect 1: with uvicorn's defaults, X-Forwarded-For from 127.0.0.1 was trusted:
    30 wrong tokens, each with a fresh address, were all 401 (never 429), and a sign-in was
    audited "from 198.51.100.77". Now the header is ignored unless --forwarded-allow-ips names
    the sender."""
    with httpx.Client(base_url=plain.url, timeout=10) as http:
        login = http.post("/ui/login", data={"token": ADMIN_TOKEN},
                          headers={**SAME_ORIGIN, "Origin": plain.url,
                                   "X-Forwarded-For": "198.51.100.77"})
        assert login.status_code == 303
        statuses = [
            http.get("/api/v1/rounds", headers={"Authorization": "Bearer wrong-token-0123456789",
                                                "X-Forwarded-For": f"198.51.100.{i}"}).status_code
            for i in range(30)
        ]
    assert statuses[:6] == [401] * 6 and set(statuses[6:]) == {429}, statuses
    assert [r.address for r in _audited(plain.data_dir, "signin")] == ["127.0.0.1"]
    failed = _audited(plain.data_dir, "signin_failed")
    assert failed and {r.address for r in failed} == {"127.0.0.1"}


def test_never_read_chunked_body_is_cut(plain):
    """Issue 33, defect 5: one unauthenticated chunked POST to /healthz (405) pushed 8.75 GiB
    in 15 s: the answer carried no `Connection: close`, so uvicorn drained the body for as long
    as it came. Now the answer closes the connection and the upload stops within 5 s."""
    sent = 0
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", plain.port), timeout=5) as s:
        s.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"100000\r\n" + b"\0" * MIB + b"\r\n"
        try:
            while time.perf_counter() - started < 15 and sent < 4096 * MIB:  # bounded either way
                s.sendall(chunk)
                sent += MIB
        except OSError:
            pass
        cut = time.perf_counter() - started
        try:
            reply = s.recv(4096)
        except OSError:
            reply = b""
    print(f"never-read body: cut after {cut:.2f} s and {sent / MIB:.0f} MiB; reply {reply[:40]!r}")
    assert cut < 5 and sent < 64 * MIB  # before: 4 GiB accepted in about a second, never cut
    assert reply == b"" or b"405" in reply.split(b"\r\n")[0]


def test_slow_and_silent_clients_are_closed(plain):
    """Also: idle and trickling connections were never timed out (uvicorn restarts its timer at
    every byte). Headers must now arrive within --header-timeout (1 s here)."""
    with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as silent:
        started = time.perf_counter()
        assert silent.recv(100) == b""  # closed without a word
        assert time.perf_counter() - started < 4
    with socket.create_connection(("127.0.0.1", plain.port), timeout=10) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.perf_counter()
        closed = False
        for i in range(40):  # one header line every 0.1 s, at most 4 s
            try:
                slow.sendall(b"X-Slow-%d: a\r\n" % i)
            except OSError:
                closed = True
                break
            time.sleep(0.1)
        if not closed:
            slow.settimeout(1)
            try:
                closed = slow.recv(100) == b""
            except OSError:
                closed = True
        assert closed and time.perf_counter() - started < 4
    with httpx.Client(base_url=plain.url, timeout=10) as http:  # a normal client is served
        assert http.get("/healthz").status_code == 200


def test_attackers_view(plain, tmp_path, capsys):
    """Issue 33's "done when", on the live server: the zero-update trick is refused, the bombs
    are refused before their data is read, /metrics without a token is 401, a valid token is
    served while the address waits after failed sign-ins, and a forged audit
    record appended to the database is caught by `audit verify`."""
    a = add_site(data_dir=plain.data_dir, name="hosp-a")
    b = add_site(data_dir=plain.data_dir, name="hosp-b")
    model = write_model(tmp_path / "real.h5", 0.5)
    with httpx.Client(base_url=plain.url, timeout=60) as http:
        assert http.get("/metrics").status_code == 401
        wrong = [http.get("/api/v1/rounds", headers=bearer("wrong-token-0123456789")).status_code
                 for _ in range(12)]
        assert wrong[-1] == 429  # 127.0.0.1 waits ...
        rnd = http.post("/api/v1/rounds", json={}, headers=ADMIN).json()  # ... valid tokens do not

        def upload(token: str, path: Path, count: int) -> httpx.Response:
            with open(path, "rb") as fh:
                return http.post(f"/api/v1/rounds/{rnd['id']}/uploads", headers=bearer(token),
                                 files={"file": (path.name, fh)}, data={"num_examples": str(count)})

        for label, path, reason in (
            ("256 MiB gzip", gzip_bomb(tmp_path / "gzip.h5", 64 * MIB), "too_large"),
            ("2x10^5 chunks", chunk_bomb(tmp_path / "chunks.h5", 200_000), "chunks"),
        ):
            started = time.perf_counter()
            refused = upload(a, path, 5)
            print(f"live {label}: {refused.status_code} {refused.json()['reason']} in "
                  f"{time.perf_counter() - started:.2f} s")
            assert refused.status_code == 422 and refused.json()["reason"] == reason
        assert upload(a, write_model(tmp_path / "zeros.h5", 0.0), 1).status_code == 201
        assert upload(b, model, 4000).status_code == 201
        assert http.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
        trick = http.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(a))
        assert trick.status_code == 403 and "hosp-b" not in trick.text
    assert verify_audit(plain.data_dir, capsys)[0] == 0
    forge_audit_record(plain.data_dir)
    assert verify_audit(plain.data_dir, capsys)[0] == 1

"""Issue 33, the trust boundary's second pass: each defect's attack, on the app itself.

The live-server probes (forwarded headers, a never-read body on a real socket, slow clients) are
in test_trust_live.py.
"""

from __future__ import annotations

from tests.admin.asgi import call


# 5. Bodies the app never reads were drained forever ---------------------------------------------
def test_answer_before_the_body_closes_the_connection(client):
    """A 405 (and any answer the app makes before reading the body to its end) carries
    `Connection: close`, so the server stops reading; answers to bodiless requests and to bodies
    read to their end keep the connection."""
    endless = (b"x" * 65536 for _ in range(10_000))  # 655 MB if it were read; produced lazily
    refused = call(client.app, "POST", "/healthz",
                   {"host": "testserver", "transfer-encoding": "chunked"}, endless)
    assert refused.status == 405 and refused.headers.get("connection") == "close"
    assert refused.bytes_read < 1024 * 1024
    plain = call(client.app, "GET", "/healthz", {"host": "testserver"})
    assert plain.status == 200 and "connection" not in plain.headers
    read = call(client.app, "POST", "/ui/login", {"host": "testserver", "content-length": "8",
                "content-type": "application/x-www-form-urlencoded"}, [b"token=ab"])
    assert "connection" not in read.headers, read.status

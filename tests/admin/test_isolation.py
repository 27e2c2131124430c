"""Issue 25, defects 1-4: limits before work, refusal log kept, hospital isolation, session caps.

Each test sends the request the probe sent and checks the answer it must now get. Requests
that must be refused before their body is read go straight to the ASGI app with a lazy body
(tests/admin/asgi.py), so the test sees exactly how many chunks the server pulled.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from fedsplit.server.admin.limits import FORM_BODY_MAX, JSON_BODY_MAX
from fedsplit.server.admin.tables import AuditRecord, RefusedUpload
from fedsplit.server.admin.ui.sessions import MAX_SESSIONS_PER_IDENTITY
from sqlalchemy import func, select

from tests.admin.asgi import call
from tests.admin.conftest import (
    ADMIN,
    ADMIN_TOKEN,
    bearer,
    create_round,
    post_file,
    post_not_hdf5,
    write_model,
)

HOST = {"Host": "127.0.0.1:8080"}
MIB = 1024 * 1024
SAME_ORIGIN = {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}


def _chunks(total: int, size: int = MIB, head: bytes = b""):
    """``total`` bytes in ``size`` chunks, made only when asked for."""
    if head:
        yield head
    for _ in range(total // size):
        yield b"\0" * size


# 1. Anyone without a token could fill the disk or the memory ----------------------------------
def test_unauthenticated_json_body_is_refused_before_it_is_read(client):
    """Probe: 50 MB JSON to POST /api/v1/rounds without a token was parsed before the 401."""
    answer = call(client.app, "POST", "/api/v1/rounds",
                  {**HOST, "Content-Type": "application/json", "Content-Length": str(50 * MIB)},
                  _chunks(50 * MIB, head=b'{"strategy": "'))
    assert answer.status == 401 and answer.chunks_read == 0
    assert answer.headers["connection"] == "close" and answer.headers["www-authenticate"] == "Bearer"


def test_unauthenticated_upload_is_refused_before_it_is_read(client, data_dir):
    """The same for an upload and a template, with or without Content-Length, bad token too."""
    rnd = create_round(client)
    for path, method in ((f"/api/v1/rounds/{rnd['id']}/uploads", "POST"),
                         (f"/api/v1/rounds/{rnd['id']}/template", "PUT")):
        for auth in ({}, bearer("fss_not-a-token-at-all")):
            answer = call(client.app, method, path,
                          {**HOST, **auth, "Content-Type": "multipart/form-data; boundary=B"},
                          _chunks(400 * MIB, head=b'--B\r\nContent-Disposition: form-data; '
                                                   b'name="file"; filename="x.h5"\r\n\r\n'))
            assert answer.status == 401 and answer.chunks_read == 0, (path, auth)
    assert list((data_dir / "files" / "tmp").iterdir()) == []


def test_sign_in_form_is_capped_while_it_streams(client):
    """Probe: a 400 MB multipart part to POST /ui/login was spooled to a 397 MB file, then 401.

    Now at most the form cap (4 KiB, plus the one chunk that crossed it) is read: 413."""
    head = (b'--B\r\nContent-Disposition: form-data; name="token"; filename="t"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    answer = call(client.app, "POST", "/ui/login",
                  {**HOST, "Content-Type": "multipart/form-data; boundary=B"},
                  _chunks(400 * MIB, size=1024, head=head))
    assert answer.status == 413
    assert answer.bytes_read <= FORM_BODY_MAX + 1024 + len(head)
    declared = call(client.app, "POST", "/ui/login",
                    {**HOST, "Content-Type": "multipart/form-data; boundary=B",
                     "Content-Length": str(400 * MIB)}, _chunks(400 * MIB, head=head))
    assert declared.status == 413 and declared.chunks_read == 0


def test_admin_json_body_is_capped_too(client):
    """Even with the admin token, a JSON body over the documented cap is cut off: 413."""
    answer = call(client.app, "POST", "/api/v1/rounds",
                  {**HOST, **ADMIN, "Content-Type": "application/json"},
                  _chunks(50 * MIB, size=16 * 1024, head=b'{"strategy": "'))
    assert answer.status == 413 and answer.bytes_read <= JSON_BODY_MAX + 16 * 1024 + 20
    assert b"JSON 65536" in answer.body


# 2. Anyone without a token could wipe the refused-upload log ----------------------------------
@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_unauthenticated_flood_keeps_every_refusal_and_audit_record(client, site_token, tmp_path):
    """Probe: 5,000 empty POST .../uploads without a token evicted every real refusal."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    post_not_hdf5(client, rnd["id"], token, tmp_path / "bad.h5")
    ctx = client.app.state.admin
    with ctx.sessions() as session:
        refusals_before = session.scalar(select(func.count()).select_from(RefusedUpload))
        audit_before = list(session.scalars(select(AuditRecord.hash).order_by(AuditRecord.id)))
    assert refusals_before == 1 and len(audit_before) >= 2
    started = time.perf_counter()
    for i in range(5000):
        auth = {} if i % 2 else bearer(f"fss_guess-{i}")
        answer = call(client.app, "POST", f"/api/v1/rounds/{rnd['id']}/uploads",
                      {**HOST, **auth, "Content-Length": "0"})
        assert answer.status in (401, 429)
    print(f"5000 unauthenticated uploads: {time.perf_counter() - started:.1f} s")
    with ctx.sessions() as session:
        assert session.scalar(select(func.count()).select_from(RefusedUpload)) == 1
        audit_after = list(session.scalars(select(AuditRecord.hash).order_by(AuditRecord.id)))
    assert audit_after[: len(audit_before)] == audit_before  # nothing pushed out or changed
    assert len(audit_after) - len(audit_before) < 20  # a few sign-in failures and noise summaries
    page = client.get(f"/api/v1/rounds/{rnd['id']}", headers=bearer(token))
    assert page.status_code == 200
    metrics = client.get("/metrics", headers=ADMIN).text
    assert 'fedsplit_unauthenticated_refused_total{kind="no_token"} 2500' in metrics


# 3. Hospital isolation through the API --------------------------------------------------------
def _numbers(value):
    """Every number in a JSON value."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield value


def _two_hospital_round(client, site_token, tmp_path: Path):
    a, b = site_token("hospital-a"), site_token("hospital-b")
    rnd = create_round(client)
    files = {}
    for name, token, value, n in (("alpha-secret.h5", a, 1.0, 30), ("beta-secret.h5", b, 3.0, 17)):
        path = write_model(tmp_path / name, value, num_examples=n)
        files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        assert post_file(client, rnd["id"], token, path).status_code == 201
    return a, b, rnd, files


def test_hospital_reads_no_other_hospitals_name_file_count_or_hash(client, site_token, tmp_path):
    """Probe: GET /api/v1/rounds/{id} with one hospital's token listed the other's name, file
    name, count and sha256."""
    _, b, rnd, files = _two_hospital_round(client, site_token, tmp_path)
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    for path in (f"/api/v1/rounds/{rnd['id']}", "/api/v1/rounds"):
        text = client.get(path, headers=bearer(b)).text
        for leak in ("hospital-a", "alpha-secret", files["alpha-secret.h5"]):
            assert leak not in text, (path, leak)
        numbers = set(_numbers(client.get(path, headers=bearer(b)).json()))
        assert not numbers & {30, 47}, path  # hospital-a's count, the total
        assert "hospital-b" in text and files["beta-secret.h5"] in text
    body = client.get(f"/api/v1/rounds/{rnd['id']}", headers=bearer(b)).json()
    assert [u["site"] for u in body["uploads"]] == ["hospital-b"]
    assert body["num_examples"] is None
    assert body["report"]["sites"] == [{"site": "hospital-b", "num_examples": 17,
                                        "claimed_examples": None, "excluded": False,
                                        "reason": None, "flags": []}]
    admin = client.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()
    assert {u["site"] for u in admin["uploads"]} == {"hospital-a", "hospital-b"}
    assert admin["num_examples"] == 47


def test_single_hospital_aggregate_is_refused_to_hospitals(client, site_token, tmp_path):
    """Probe: a round aggregated from one other hospital's upload was downloadable, and the file
    was that hospital's own weights. Now 403 below the minimum (2), for every site token."""
    a, b = site_token("hospital-a"), site_token("hospital-b")
    rnd = create_round(client)
    assert post_file(client, rnd["id"], a, write_model(tmp_path / "a.h5", 1.0)).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    for token in (a, b):
        for fmt in ("fedsplit", "keras"):
            refused = client.get(f"/api/v1/rounds/{rnd['id']}/model?format={fmt}", headers=bearer(token))
            assert refused.status_code == 403, fmt
    assert client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=ADMIN).status_code == 200
    follow = create_round(client, continues=rnd["id"])
    assert client.get(f"/api/v1/rounds/{follow['id']}/start-model", headers=bearer(b)).status_code == 403


def test_minimum_is_a_setting(make_client, site_token, tmp_path):
    """--min-model-sites 3: a two-hospital aggregate is refused to hospitals as well."""
    client = make_client(min_model_sites=3)
    a, _, rnd, _ = _two_hospital_round(client, site_token, tmp_path)
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    refused = client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(a))
    assert refused.status_code == 403 and "at least 3 hospitals" in refused.json()["detail"]


# 4. Any hospital could sign the admin out -----------------------------------------------------
def test_one_identity_never_evicts_another_s_sessions(client, site_token):
    """Probe: 1,001 sign-ins with one hospital's token evicted the admin's live session."""
    token = site_token("hospital-a")
    admin = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=SAME_ORIGIN,
                        follow_redirects=False)
    assert admin.status_code == 303
    admin_cookie = admin.cookies.get("fedsplit_ui")
    client.cookies.clear()
    form = {"Host": "testserver", **SAME_ORIGIN, "Content-Type": "application/x-www-form-urlencoded"}
    body = f"token={token}".encode()
    for _ in range(1001):  # a fresh browser each time: no cookie is sent back
        response = call(client.app, "POST", "/ui/login",
                        {**form, "Content-Length": str(len(body))}, [body])
        assert response.status == 303 and "fedsplit_ui=" in response.headers["set-cookie"]
    store = client.app.state.ui.sessions
    assert len(store) == 1 + MAX_SESSIONS_PER_IDENTITY
    client.cookies.set("fedsplit_ui", admin_cookie, path="/ui")
    page = client.get("/ui", follow_redirects=False)
    assert page.status_code == 200 and "Signed in as <strong>admin</strong>" in page.text

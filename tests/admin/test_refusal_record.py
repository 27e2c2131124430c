"""A refused upload is recorded once, by the upload route (services.refusals), and the web view
reads rounds, uploads and refusals through the same services as the API (issue 34, item 4)."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

from fedsplit.server.admin import store
from fedsplit.server.admin.services import refusals
from fedsplit.server.admin.services import rounds as round_service
from fedsplit.server.admin.tables import AuditRecord, RefusedUpload
from fedsplit.server.admin.ui import rest
from sqlalchemy import func, select

from tests.admin.conftest import (
    ADMIN,
    ADMIN_TOKEN,
    bearer,
    create_round,
    post_file,
    post_not_hdf5,
    write_model,
)

ROOT = Path(__file__).resolve().parents[2]


def _rows(client) -> list[RefusedUpload]:
    with client.app.state.admin.sessions() as session:
        rows = list(session.scalars(select(RefusedUpload).order_by(RefusedUpload.id)))
        session.expunge_all()
    return rows


def _refused_audit_records(client) -> int:
    with client.app.state.admin.sessions() as session:
        return session.scalar(select(func.count()).select_from(AuditRecord)
                              .where(AuditRecord.event == "upload_refused"))


def test_the_view_has_no_middleware_and_no_module_of_its_own_for_refusals(client) -> None:
    """No middleware re-reads upload bodies or authenticates a second time."""
    assert not (ROOT / "server" / "admin" / "ui" / "refusals.py").exists()
    names = [m.cls.__name__ for m in client.app.user_middleware]
    assert names == ["RequestGuard"], names


def test_a_refused_file_is_one_row_one_audit_record_one_count(client, site_token, tmp_path) -> None:
    """The row holds who, the client's file name, size, sha256, status, error, reason and message."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    bad = tmp_path / "bad.h5"
    answer = post_not_hdf5(client, rnd["id"], token, bad)
    (row,) = _rows(client)
    assert (row.who, row.round_id, row.filename, row.size_bytes, row.sha256, row.status_code) == (
        "hospital-a", rnd["id"], "bad.h5", bad.stat().st_size,
        hashlib.sha256(bad.read_bytes()).hexdigest(), 422)
    assert (row.error, row.reason, row.detail) == (
        answer.json()["error"], answer.json()["reason"], answer.json()["detail"])
    assert _refused_audit_records(client) == 1
    metrics = client.get("/metrics", headers=ADMIN).text
    assert f'fedsplit_uploads_refused_total{{reason="{row.reason}"}} 1' in metrics


def test_an_oversized_upload_keeps_its_name_and_bytes_read_but_no_digest(make_client, site_token,
                                                                         tmp_path) -> None:
    client = make_client(max_upload_mb=0.01)
    token = site_token("hospital-a")
    rnd = create_round(client)
    big = tmp_path / "big.h5"
    big.write_bytes(b"x" * 30_000)  # over the 10 KiB limit, under its multipart allowance: read
    answer = post_file(client, rnd["id"], token, big)
    assert answer.status_code == 413
    (row,) = _rows(client)
    assert (row.filename, row.status_code, row.reason, row.sha256) == ("big.h5", 413, None, None)
    assert row.size_bytes is not None and row.size_bytes > 0.01 * 2**20
    assert 'fedsplit_uploads_refused_total{reason="too_large"} 1' in client.get(
        "/metrics", headers=ADMIN).text


def test_the_admin_token_on_the_site_route_is_recorded_as_the_admin(client) -> None:
    rnd = create_round(client)
    answer = client.post(f"/api/v1/rounds/{rnd['id']}/uploads", headers=ADMIN,
                         files={"file": ("t.h5", b"x" * 10)})
    assert answer.status_code == 403
    (row,) = _rows(client)
    assert (row.who, row.site_id, row.error, row.status_code) == ("admin", None, "PermissionDeniedError", 403)


def test_an_unknown_token_is_not_recorded(client) -> None:
    rnd = create_round(client)
    answer = client.post(f"/api/v1/rounds/{rnd['id']}/uploads", headers=bearer("fss_nobody"),
                         files={"file": ("t.h5", b"x" * 10)})
    assert answer.status_code == 401
    assert _rows(client) == [] and _refused_audit_records(client) == 0


def test_each_identity_keeps_its_newest_rows(client, site_token, tmp_path, monkeypatch) -> None:
    """Past MAX_ROWS a hospital's oldest refusals go, never another identity's."""
    monkeypatch.setattr(refusals, "MAX_ROWS", 2)
    token_a, token_b = site_token("hospital-a"), site_token("hospital-b")
    rnd = create_round(client)
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"nope" * 4)
    assert post_file(client, rnd["id"], token_b, bad).status_code == 422
    for _ in range(3):
        assert post_file(client, rnd["id"], token_a, bad).status_code == 422
    rows = _rows(client)
    assert [r.who for r in rows] == ["hospital-b", "hospital-a", "hospital-a"]


def test_the_api_and_the_view_list_rounds_through_one_service(client, site_token, tmp_path,
                                                              monkeypatch) -> None:
    token = site_token("hospital-a")
    rnd = create_round(client)
    assert post_file(client, rnd["id"], token, write_model(tmp_path / "m.h5")).status_code == 201
    calls: list[int | None] = []
    listing = round_service.list_rounds

    def spy(session, *, limit=None):  # type: ignore[no-untyped-def]
        calls.append(limit)
        return listing(session, limit=limit)

    monkeypatch.setattr(round_service, "list_rounds", spy)
    assert [r["id"] for r in client.get("/api/v1/rounds", headers=ADMIN).json()["data"]] == [rnd["id"]]
    signed = client.post("/ui/login", data={"token": ADMIN_TOKEN}, follow_redirects=False,
                         headers={"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"})
    assert signed.status_code == 303, signed.text
    assert "hospital-a" in client.get("/ui").text
    assert calls == [None, rest.MAX_ROUNDS_LISTED]


def test_a_database_from_before_the_site_id_column_gets_it(tmp_path) -> None:
    """Databases written when the view kept the table itself keep their rows and gain site_id."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE ui_refused_uploads (id INTEGER PRIMARY KEY, round_id INTEGER, "
                     "who VARCHAR(128), filename VARCHAR(256), size_bytes INTEGER, sha256 VARCHAR(64), "
                     "status_code INTEGER, error VARCHAR(64), reason VARCHAR(64), detail TEXT, "
                     "created_at DATETIME)")
        conn.execute("INSERT INTO ui_refused_uploads (round_id, who, status_code, created_at) "
                     "VALUES (1, 'hospital-a', 422, '2025-01-01 00:00:00')")
    engine = store.make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT who, site_id FROM ui_refused_uploads").all()
    finally:
        engine.dispose()
    assert rows == [("hospital-a", None)]

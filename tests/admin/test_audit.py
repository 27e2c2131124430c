"""Issue 25: the tamper-evident audit log (events, verify, show, noise, retention of real events)."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta

import pytest
from fedsplit.cli.app import app as fedsplit_app
from fedsplit.cli.errors import run_guarded
from fedsplit.server.admin import audit
from fedsplit.server.admin.store import open_engine

from tests.admin.asgi import call
from tests.admin.conftest import (
    ADMIN,
    ADMIN_TOKEN,
    bearer,
    create_round,
    post_file,
    verify_audit,
    write_model,
)

SAME_ORIGIN = {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}


def _db(data_dir) -> sqlite3.Connection:
    return sqlite3.connect(data_dir / "fedsplit-admin.db")


def _show(data_dir, capsys, *extra: str) -> list[dict]:
    code = run_guarded(fedsplit_app, ["admin", "audit", "show", "--data-dir", str(data_dir),
                                      "--json", *extra])
    assert code == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.fixture
def history(client, data_dir, site_token, tmp_path, capsys):
    """A server history with every kind of event; returns the site tokens."""
    a, b = site_token("hospital-a"), site_token("hospital-b")
    client.post("/ui/login", data={"token": "wrong-token-0000000000"}, headers=SAME_ORIGIN)
    client.post("/ui/login", data={"token": a}, headers=SAME_ORIGIN, follow_redirects=False)
    client.post("/ui/logout", headers=SAME_ORIGIN, follow_redirects=False)
    client.cookies.clear()
    rnd = create_round(client)
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5" * 10)
    assert post_file(client, rnd["id"], a, bad).status_code == 422
    for token, value in ((a, 1.0), (b, 2.0)):
        weights = write_model(tmp_path / f"{value}.h5", value)
        assert post_file(client, rnd["id"], token, weights).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    assert client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(b)).status_code == 200
    lone = create_round(client)
    assert post_file(client, lone["id"], a, write_model(tmp_path / "lone.h5", 1.0)).status_code == 201
    assert client.post(f"/api/v1/rounds/{lone['id']}/aggregate", headers=ADMIN).status_code == 200
    assert client.get(f"/api/v1/rounds/{lone['id']}/model", headers=bearer(b)).status_code == 403
    for command, name in (("rotate-token", "hospital-b"), ("remove-site", "hospital-a")):
        assert run_guarded(fedsplit_app, ["admin", command, name, "--data-dir", str(data_dir)]) == 0
    capsys.readouterr()
    return a, b


def test_every_security_event_is_recorded(history, data_dir, capsys):
    """Sign-in, failure, sign-out; upload, refusal, aggregation, download (and refused one);
    site added, removed, token rotated: each is a record with its actor."""
    records = _show(data_dir, capsys, "--limit", "1000")
    events = [(r["event"], r["actor"]) for r in records]
    for expected in [("site_added", "admin (cli)"), ("signin_failed", "unauthenticated"),
                     ("signin", "hospital-a"), ("signout", "hospital-a"),
                     ("round_created", "admin"), ("upload_refused", "hospital-a"),
                     ("upload", "hospital-a"), ("upload", "hospital-b"), ("aggregate", "admin"),
                     ("model_download", "hospital-b"), ("model_download_refused", "hospital-b"),
                     ("token_rotated", "admin (cli)"), ("site_removed", "admin (cli)")]:
        assert expected in events, expected
    assert [r["id"] for r in records] == list(range(1, len(records) + 1))
    upload = next(r for r in records if r["event"] == "upload")
    assert len(upload["detail"]["sha256"]) == 64 and upload["address"] == "testclient"
    code, out = verify_audit(data_dir, capsys)
    assert code == 0 and f"{len(records)} record(s)" in out


def test_show_filters_by_hospital_and_time(history, data_dir, capsys):
    """--site keeps that hospital's records (removed or not); --since/--until bound the time."""
    mine = _show(data_dir, capsys, "--site", "hospital-a", "--limit", "1000")
    assert mine and {r["site_id"] for r in mine} == {mine[0]["site_id"]}
    assert {"site_added", "signin", "upload", "upload_refused", "site_removed"} <= {r["event"] for r in mine}
    assert all(r["actor"] != "hospital-b" for r in mine)
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert _show(data_dir, capsys, "--since", future) == []
    past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    assert _show(data_dir, capsys, "--until", past) == []
    assert len(_show(data_dir, capsys, "--since", past, "--event", "upload")) == 3
    assert run_guarded(fedsplit_app, ["admin", "audit", "show", "--data-dir", str(data_dir),
                                      "--site", "nobody"]) == 2
    assert "There is no site 'nobody'" in capsys.readouterr().err


def test_verify_finds_an_edited_record(history, data_dir, capsys):
    """Changing one byte of one record's detail: verify names that record."""
    with _db(data_dir) as db:
        db.execute("UPDATE audit_log SET actor = 'hospital-x' "
                   "WHERE id = (SELECT min(id) FROM audit_log WHERE event = 'model_download')")
        bad = db.execute("SELECT min(id) FROM audit_log WHERE event = 'model_download'").fetchone()[0]
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and f"record {bad} was altered" in out


def test_verify_finds_a_deleted_record(history, data_dir, capsys):
    """Deleting a record from the middle leaves a gap; putting one back breaks the chain."""
    assert verify_audit(data_dir, capsys)[0] == 0
    with _db(data_dir) as db:
        db.execute("DELETE FROM audit_log WHERE id = 5")
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and "record 5 is missing" in out
    with _db(data_dir) as db:  # put it back by hand (wrong content): now the chain breaks at 5
        db.execute("INSERT INTO audit_log (id, at, event, actor, detail, prev_hash, hash) VALUES "
                   "(5, '2026-01-01T00:00:00+00:00', 'signin', 'admin', '{}', 'x', 'y')")
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and "record 5 does not follow record 4" in out


def test_verify_with_a_noted_head_finds_records_deleted_from_the_end(history, data_dir, capsys):
    """A head hash noted from an earlier verify catches the last records being deleted."""
    code, out = verify_audit(data_dir, capsys)
    head = out.split("head ")[-1].strip()
    assert verify_audit(data_dir, capsys, "--head", head)[0] == 0
    with _db(data_dir) as db:
        db.execute("DELETE FROM audit_log WHERE id = (SELECT max(id) FROM audit_log)")
    code, out = verify_audit(data_dir, capsys)  # the audit key's head file knows (issue 33) ...
    assert code == 1 and "records after it were deleted" in out
    code, out = verify_audit(data_dir, capsys, "--head", head)
    assert code == 1 and "deleted" in out  # ... and so does a noted head


def test_verify_finds_reordered_records(history, data_dir, capsys):
    """Swapping two records (their content; ids are the order): the chain breaks at the first."""
    columns = "at, event, actor, site_id, address, detail, prev_hash, hash"
    with _db(data_dir) as db:
        six = db.execute(f"SELECT {columns} FROM audit_log WHERE id = 6").fetchone()
        seven = db.execute(f"SELECT {columns} FROM audit_log WHERE id = 7").fetchone()
        db.execute("UPDATE audit_log SET prev_hash = 'tmp-6' WHERE id = 6")
        db.execute("UPDATE audit_log SET prev_hash = 'tmp-7' WHERE id = 7")
        assign = ", ".join(f"{c.strip()} = ?" for c in columns.split(","))
        db.execute(f"UPDATE audit_log SET {assign} WHERE id = 6", seven)
        db.execute(f"UPDATE audit_log SET {assign} WHERE id = 7", six)
    code, out = verify_audit(data_dir, capsys)
    assert code == 1 and "record 6 does not follow record 5" in out


def test_unauthenticated_noise_is_summarised_not_logged_one_by_one(client, data_dir):
    """5,000 requests without a token add one summary record (per minute), never push anything
    out, and the chain stays intact."""
    ctx = client.app.state.admin
    create_round(client)
    engine = open_engine(data_dir=data_dir)
    before = audit.query(engine, limit=10_000)
    for i in range(5000):
        answer = call(client.app, "POST", "/api/v1/rounds", {"Host": "testserver"} if i % 2 else
                      {"Host": "testserver", "Authorization": ""})
        assert answer.status == 401
    assert len(audit.query(engine, limit=10_000)) == len(before)  # counted, not yet written
    ctx.audit.flush_noise()
    after = audit.query(engine, limit=10_000)
    assert [r.hash for r in after[: len(before)]] == [r.hash for r in before]
    summary = after[-1]
    assert summary.event == "unauthenticated" and len(after) == len(before) + 1
    assert audit.parse_detail(summary)["requests"] == 5000
    assert audit.verify(engine, ctx.audit.key).ok
    engine.dispose()


def test_noise_summary_is_written_when_due(make_client, data_dir):
    """Past the interval, the next noisy request writes the summary itself."""
    client = make_client()
    ctx = client.app.state.admin
    ctx.audit.noise_interval_s = 0.0
    assert client.get("/api/v1/rounds").status_code == 401
    engine = open_engine(data_dir=data_dir)
    records = audit.query(engine, events=["unauthenticated"])
    engine.dispose()
    assert len(records) == 1 and audit.parse_detail(records[0])["by_kind"] == {"no_token": 1}


def test_admin_sign_in_is_recorded_without_the_token(client, data_dir):
    client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=SAME_ORIGIN, follow_redirects=False)
    engine = open_engine(data_dir=data_dir)
    records = audit.query(engine)
    engine.dispose()
    assert [(r.event, r.actor) for r in records] == [("signin", "admin")]
    raw = (data_dir / "fedsplit-admin.db").read_bytes()
    assert ADMIN_TOKEN.encode() not in raw

"""The file name a hospital's client sent is kept, and a database from before it gains the column."""

from __future__ import annotations

import sqlite3

from fedsplit.server.admin.store import make_engine
from sqlalchemy import inspect

from tests.admin.conftest import ADMIN, create_round, post_file, write_model


def test_upload_records_the_client_filename(client, site_token, tmp_path) -> None:
    """The receipt and the round listing name the file as the hospital sent it."""
    rnd = create_round(client)
    path = write_model(tmp_path / "hospital-a-round1.h5", 1.0)
    receipt = post_file(client, rnd["id"], site_token("hospital-a"), path)
    assert receipt.status_code == 201, receipt.text
    assert receipt.json()["filename"] == "hospital-a-round1.h5"
    listed = client.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()
    assert [u["filename"] for u in listed["uploads"]] == ["hospital-a-round1.h5"]


def test_an_older_database_gains_the_column_and_keeps_its_rows(tmp_path) -> None:
    """ALTER TABLE ADD COLUMN on an uploads table created without it; existing rows read NULL."""
    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE uploads (id INTEGER PRIMARY KEY, round_id INTEGER, site_id INTEGER, "
                "num_examples INTEGER, count_source VARCHAR(8), sha256 VARCHAR(64), size_bytes INTEGER, "
                "layout VARCHAR(16), original_file VARCHAR(512), weights_file VARCHAR(512), "
                "current BOOLEAN, created_at DATETIME, replaced_at DATETIME)")
    con.execute("INSERT INTO uploads (id, num_examples) VALUES (7, 12)")
    con.commit()
    con.close()
    engine = make_engine(f"sqlite:///{db}")
    assert "client_filename" in {c["name"] for c in inspect(engine).get_columns("uploads")}
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT id, num_examples, client_filename FROM uploads").all() == [
            (7, 12, None)
        ]
    engine.dispose()

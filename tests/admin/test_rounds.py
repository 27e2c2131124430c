"""Rounds: re-upload history, FedAvg numbers, downloads, start models, round states."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import numpy as np
from fedsplit.protocol import read_weights

from tests.admin.conftest import ADMIN, bearer, create_round, post_file, write_model


def test_reupload_replaces_and_keeps_history(client, site_token, data_dir, tmp_path):
    """A second upload by the same site replaces the first, which stays in history (its row: time,
    sha256, size, count); its files are deleted (issue 33: replaced uploads were all kept)."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    first = post_file(client, rnd["id"], token, write_model(tmp_path / "1.h5", 1.0)).json()
    second = post_file(client, rnd["id"], token, write_model(tmp_path / "2.h5", 2.0), num_examples=7)
    assert second.status_code == 201
    assert second.json()["replaced"] == first["id"]
    assert second.json()["num_examples"] == 7
    assert second.json()["count_source"] == "form"
    body = client.get(f"/api/v1/rounds/{rnd['id']}", headers=bearer(token)).json()
    assert [u["id"] for u in body["uploads"]] == [second.json()["id"]]
    assert [(u["id"], u["current"]) for u in body["history"]] == [(first["id"], False)]
    assert body["history"][0]["replaced_at"] is not None
    stored = data_dir / "files" / "rounds" / str(rnd["id"]) / "uploads"
    assert sorted(p.name for p in stored.iterdir()) == ["2.h5"]  # one file per upload (issue 43)


def test_receipt_matches_the_bytes_sent(client, site_token, tmp_path):
    """sha256, size, count and parameter list describe the uploaded file."""
    import hashlib

    token = site_token("hospital-a")
    rnd = create_round(client)
    path = write_model(tmp_path / "m.h5", 0.5, num_examples=42)
    receipt = post_file(client, rnd["id"], token, path).json()
    assert receipt["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert receipt["size"] == path.stat().st_size
    assert receipt["num_examples"] == 42
    assert receipt["count_source"] == "file"
    assert receipt["parameters"] == [
        {"name": "layer.0.weight", "shape": [3, 4], "dtype": "float32"},
        {"name": "layer.0.bias", "shape": [3], "dtype": "float32"},
        {"name": "layer.1.weight", "shape": [2, 3], "dtype": "float32"},
    ]


def test_fedavg_aggregate_is_exact_and_downloadable(client, site_token, tmp_path):
    """(10*1 + 30*2 + 60*4) / 100 = 3.1 in every entry; the report lists every site's weight."""
    rnd = create_round(client, min_uploads=3)
    for name, value, n in (("a", 1.0, 10), ("b", 2.0, 30), ("c", 4.0, 60)):
        token = site_token(name)
        path = write_model(tmp_path / f"{name}.h5", value, num_examples=n)
        assert post_file(client, rnd["id"], token, path).status_code == 201
    response = client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "aggregated"
    assert body["num_examples"] == 100
    assert [(s["site"], s["num_examples"], s["weight"]) for s in body["report"]["sites"]] == [
        ("a", 10, 0.1), ("b", 30, 0.3), ("c", 60, 0.6)
    ]
    download = client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(token))
    assert download.status_code == 200
    assert download.headers["content-disposition"] == f'attachment; filename="round-{rnd["id"]}-model.h5"'
    model = read_weights(io.BytesIO(download.content))
    assert model.num_examples == 100
    expected = np.float32((10 * 1.0 + 30 * 2.0 + 60 * 4.0) / 100)
    for arr in model.arrays.values():
        assert arr.dtype == np.float32
        # float32 products and sums: within 2 ulp of the correctly rounded mean
        np.testing.assert_array_max_ulp(arr, np.full_like(arr, expected), maxulp=2)
    again = client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN)
    assert again.status_code == 409
    assert again.json()["detail"] == (
        f"Round {rnd['id']} is already aggregated; download its model with GET "
        f"/api/v1/rounds/{rnd['id']}/model, or create a round that continues it. Received: status "
        "'aggregated'"
    )
    assert "fedsplit_aggregation_seconds_count 1" in client.get("/metrics", headers=ADMIN).text


def test_aggregate_waits_for_min_uploads(client, site_token, tmp_path):
    """Fewer current uploads than min_uploads: 409."""
    rnd = create_round(client, min_uploads=2)
    post_file(client, rnd["id"], site_token("a"), write_model(tmp_path / "a.h5"))
    response = client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN)
    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"Round {rnd['id']} has 1 upload(s) but needs 2 (min_uploads) before it can be aggregated. "
        "Wait for more sites. Received: 1 upload(s)"
    )


def test_aggregated_round_and_past_deadline_refuse_uploads(client, site_token, tmp_path):
    """Closed rounds answer 409 and name the way forward."""
    token = site_token("a")
    past = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
    late = create_round(client, deadline=past.isoformat())
    response = post_file(client, late["id"], token, write_model(tmp_path / "a.h5"))
    assert response.status_code == 409
    assert response.json()["detail"].startswith(
        f"Round {late['id']}'s deadline {past.isoformat()} has passed; uploads are closed. Ask the "
        "coordinator for the next round. Received: upload at "
    )
    done = create_round(client)
    post_file(client, done["id"], token, write_model(tmp_path / "a.h5"))
    client.post(f"/api/v1/rounds/{done['id']}/aggregate", headers=ADMIN)
    response = post_file(client, done["id"], token, write_model(tmp_path / "a.h5"))
    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"Round {done['id']} is already aggregated and takes no more uploads. Upload to the round "
        "that continues it (GET /api/v1/rounds). Received: status 'aggregated'"
    )


def test_unknown_strategy_and_bad_params_are_refused(client):
    """Round creation validates the strategy through the aggregation registry."""
    response = client.post("/api/v1/rounds", json={"strategy": "nope"}, headers=ADMIN)
    assert response.status_code == 422
    assert response.json()["error"] == "UnknownStrategyError"
    assert response.json()["detail"].startswith("No aggregation strategy is called 'nope'. Available: ")
    response = client.post(
        "/api/v1/rounds", json={"strategy": "fedavg", "params": {"beta": 1}}, headers=ADMIN
    )
    assert response.status_code == 422
    assert response.json()["error"] == "StrategyParamsError"


def test_template_is_the_start_model_and_fixes_the_shape(client, site_token, tmp_path):
    """The admin's template fixes names and shapes and is what sites download to start from."""
    token = site_token("a")
    rnd = create_round(client)
    missing = client.get(f"/api/v1/rounds/{rnd['id']}/start-model", headers=bearer(token))
    assert missing.status_code == 404
    with open(write_model(tmp_path / "t.h5", 0.25, hidden=5), "rb") as fh:
        response = client.put(
            f"/api/v1/rounds/{rnd['id']}/template", files={"file": ("t.h5", fh)}, headers=ADMIN
        )
    assert response.status_code == 200
    assert response.json()["model_source"] == "template"
    start = client.get(f"/api/v1/rounds/{rnd['id']}/start-model", headers=bearer(token))
    assert start.status_code == 200
    assert np.all(read_weights(io.BytesIO(start.content)).arrays["layer.0.weight"] == 0.25)
    wrong = post_file(client, rnd["id"], token, write_model(tmp_path / "a.h5", hidden=3))
    assert wrong.status_code == 422
    assert wrong.json()["reason"] == "model_mismatch"


def test_continued_round_starts_from_the_previous_aggregate(client, site_token, tmp_path):
    """'continues' makes the previous round's aggregate the start model and fixes the shape."""
    token = site_token("a")
    first = create_round(client)
    post_file(client, first["id"], token, write_model(tmp_path / "a.h5", 3.0))
    premature = client.post("/api/v1/rounds", json={"continues": first["id"]}, headers=ADMIN)
    assert premature.status_code == 409
    client.post(f"/api/v1/rounds/{first['id']}/aggregate", headers=ADMIN)
    second = create_round(client, continues=first["id"])
    assert second["model_source"] == "continues"
    start = client.get(f"/api/v1/rounds/{second['id']}/start-model", headers=ADMIN)
    assert np.all(read_weights(io.BytesIO(start.content)).arrays["layer.0.bias"] == 3.0)
    # one hospital's aggregate is its own weights: no site token may fetch it as a start model
    alone = client.get(f"/api/v1/rounds/{second['id']}/start-model", headers=bearer(token))
    assert alone.status_code == 403 and "too few hospitals' updates" in alone.json()["detail"]
    wrong = post_file(client, second["id"], token, write_model(tmp_path / "b.h5", hidden=4))
    assert wrong.status_code == 422
    assert wrong.json()["reason"] == "model_mismatch"


def test_restart_keeps_rounds_uploads_and_models(make_client, site_token, tmp_path):
    """A new app over the same data directory sees everything the old one acknowledged."""
    first_app = make_client()
    token = site_token("a")
    rnd = create_round(first_app)
    receipt = post_file(first_app, rnd["id"], token, write_model(tmp_path / "a.h5", 1.5)).json()
    first_app.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN)
    restarted = make_client()
    body = restarted.get(f"/api/v1/rounds/{rnd['id']}", headers=bearer(token)).json()
    assert body["status"] == "aggregated"
    assert body["uploads"][0]["sha256"] == receipt["sha256"]
    model = restarted.get(f"/api/v1/rounds/{rnd['id']}/model", headers=ADMIN)
    assert np.all(read_weights(io.BytesIO(model.content)).arrays["layer.0.bias"] == 1.5)

"""Auth matrix: 401 without or with an unknown token, 403 for the wrong role or site."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.admin.conftest import ADMIN, ADMIN_TOKEN, bearer, create_round, post_file, write_model

NO_TOKEN = (
    "This endpoint needs a bearer token: send 'Authorization: Bearer <token>' with the admin token or "
    "the site token `fedsplit admin add-site` printed. Received: no token"
)
BAD_TOKEN = (
    "The bearer token matches no admin and no registered site. Use the token `fedsplit admin "
    "add-site` or `fedsplit admin rotate-token` printed last (a rotated or removed site's old "
    "token is refused). Received: an unknown token"
)
SITE_ON_ADMIN = (
    "Only the admin token may do this; site tokens upload and download only. Use "
    "FEDSPLIT_ADMIN_TOKEN. Received: the token of site 'hospital-a'"
)
ADMIN_UPLOADS = (
    "Uploads are made by a site with its own token, so the upload is counted for that site; the "
    "admin token cannot upload (use PUT .../template for a template). Received: the admin token"
)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/api/v1/rounds"),
        ("get", "/api/v1/rounds"),
        ("get", "/api/v1/rounds/1"),
        ("post", "/api/v1/rounds/1/uploads"),
        ("post", "/api/v1/rounds/1/aggregate"),
        ("get", "/api/v1/rounds/1/model"),
        ("get", "/api/v1/rounds/1/start-model"),
        ("put", "/api/v1/rounds/1/template"),
    ],
)
@pytest.mark.parametrize(
    ("headers", "detail"),
    [({}, NO_TOKEN), (bearer("not-a-token"), BAD_TOKEN), ({"Authorization": "Basic YWI6Y2Q="}, NO_TOKEN)],
)
def test_every_api_route_refuses_missing_and_unknown_tokens(client, method, path, headers, detail):
    """Every /api/v1 route answers 401 with the fix before doing anything."""
    response = client.request(method, path, headers=headers)
    assert response.status_code == 401
    assert response.json()["detail"] == detail
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/api/v1/rounds"),
        ("post", "/api/v1/rounds/1/aggregate"),
        ("put", "/api/v1/rounds/1/template"),
    ],
)
def test_site_token_is_refused_on_admin_routes(client, site_token, method, path):
    """Admin routes answer 403 to a valid site token."""
    token = site_token("hospital-a")
    response = client.request(method, path, headers=bearer(token), json={"strategy": "fedavg"})
    assert response.status_code == 403
    assert response.json() == {"detail": SITE_ON_ADMIN, "error": "PermissionDeniedError", "reason": None}


def test_admin_token_cannot_upload(client, tmp_path: Path):
    """Uploads are a site's: the admin token gets 403."""
    rnd = create_round(client)
    response = post_file(client, rnd["id"], ADMIN_TOKEN, write_model(tmp_path / "m.h5"))
    assert response.status_code == 403
    assert response.json()["detail"] == ADMIN_UPLOADS


def test_site_cannot_upload_another_sites_weights(client, site_token, tmp_path: Path):
    """A file that names another site is refused with 403, nothing stored."""
    token = site_token("hospital-a")
    site_token("hospital-b")
    rnd = create_round(client)
    response = post_file(client, rnd["id"], token, write_model(tmp_path / "m.h5", site="hospital-b"))
    assert response.status_code == 403
    assert response.json()["detail"] == (
        "The file says it was trained by site 'hospital-b' but the token belongs to site 'hospital-a'; a "
        "site uploads only its own weights. Upload with that site's token, or re-export without "
        "--site. Received: site='hospital-b'"
    )
    assert client.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()["uploads"] == []


def test_sites_and_admin_may_read_and_download(client, site_token, tmp_path: Path):
    """Reads take any valid token; a site downloads an aggregate only when it was built from at
    least two hospitals (issue 25: a one-hospital aggregate is that hospital's own weights)."""
    a, b = site_token("hospital-a"), site_token("hospital-b")
    alone = create_round(client)
    assert post_file(client, alone["id"], a, write_model(tmp_path / "a.h5", 1.0)).status_code == 201
    assert client.post(f"/api/v1/rounds/{alone['id']}/aggregate", headers=ADMIN).status_code == 200
    both = create_round(client)
    for token, value in ((a, 1.0), (b, 2.0)):
        upload = post_file(client, both["id"], token, write_model(tmp_path / f"{value}.h5", value))
        assert upload.status_code == 201
    assert client.post(f"/api/v1/rounds/{both['id']}/aggregate", headers=ADMIN).status_code == 200
    for headers in (ADMIN, bearer(a), bearer(b)):
        assert client.get("/api/v1/rounds", headers=headers).status_code == 200
        assert client.get(f"/api/v1/rounds/{both['id']}/model", headers=headers).status_code == 200
    assert client.get(f"/api/v1/rounds/{alone['id']}/model", headers=ADMIN).status_code == 200
    for headers in (bearer(a), bearer(b)):
        refused = client.get(f"/api/v1/rounds/{alone['id']}/model", headers=headers)
        assert refused.status_code == 403
        detail = refused.json()["detail"]
        assert "too few hospitals' updates went into it" in detail and "1 hospital" not in detail


def test_tokens_are_stored_hashed(client, site_token, data_dir: Path):
    """The database never holds a token in clear."""
    token = site_token("hospital-a")
    db = (data_dir / "fedsplit-admin.db").read_bytes()
    assert token.encode() not in db
    assert ADMIN_TOKEN.encode() not in db


def test_health_needs_no_token_metrics_the_admin_token(client):
    """Liveness works without a token; Prometheus scrapes with the admin token (issue 33)."""
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/metrics").status_code == 401
    assert "fedsplit_uploads_accepted_total 0" in client.get("/metrics", headers=ADMIN).text
    assert client.get("/docs").status_code == 200

"""Integer ids outside what the database holds are JSON 422; unknown ids are JSON 404."""

from __future__ import annotations

import pytest

from tests.admin.conftest import ADMIN, bearer

TOO_BIG = 2**63
LARGEST = 2**63 - 1
ROUTES = [
    ("GET", "/api/v1/rounds/{id}"),
    ("PUT", "/api/v1/rounds/{id}/template"),
    ("POST", "/api/v1/rounds/{id}/aggregate"),
    ("GET", "/api/v1/rounds/{id}/model"),
    ("GET", "/api/v1/rounds/{id}/start-model"),
    ("POST", "/api/v1/rounds/{id}/uploads"),
]


@pytest.mark.parametrize(("method", "route"), ROUTES)
@pytest.mark.parametrize("round_id", [TOO_BIG, 0, -1, 10**30])
def test_out_of_range_id_is_json_422(client, site_token, method, route, round_id) -> None:
    """Above 2**63-1 (SQLite would overflow) or below 1: refused before any lookup."""
    token = site_token("hospital-a") if route.endswith("uploads") else None
    headers = bearer(token) if token else ADMIN
    response = client.request(method, route.format(id=round_id), headers=headers)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "RequestValidationError" and body["reason"] == "validation"
    assert body["errors"][0]["loc"] == ["path", "round_id"]
    assert body["detail"].startswith("The request is invalid: path.round_id:")
    assert f"Received: '{round_id}'" in body["detail"]


@pytest.mark.parametrize(("method", "route"), [r for r in ROUTES if r[0] != "PUT"
                                              and not r[1].endswith("uploads")])
def test_largest_unknown_id_is_json_404(client, method, route) -> None:
    """The largest storable id is looked up and, being unknown, answers 404."""
    response = client.request(method, route.format(id=LARGEST), headers=ADMIN)
    assert response.status_code == 404, response.text
    assert response.json()["error"] == "NotFoundError"
    assert response.json()["detail"].endswith(f"Received: {LARGEST}")


def test_continues_out_of_range_is_json_422(client) -> None:
    """A round body naming a round id SQLite cannot hold is refused, not a 500."""
    response = client.post("/api/v1/rounds", json={"continues": TOO_BIG}, headers=ADMIN)
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "continues"]
    response = client.post("/api/v1/rounds", json={"min_uploads": TOO_BIG}, headers=ADMIN)
    assert response.status_code == 422


def test_fastapi_errors_carry_the_refusal_body(client) -> None:
    """Bad JSON (422), bytes that are not text (400) and unknown paths (404): one body form."""
    json_headers = {**ADMIN, "Content-Type": "application/json"}
    response = client.post("/api/v1/rounds", content=b"{not json", headers=json_headers)
    assert response.status_code == 422
    assert response.json()["reason"] == "validation"
    response = client.post("/api/v1/rounds", content=b"\xff\xfe:ju", headers=json_headers)
    assert response.status_code == 400
    assert response.json()["detail"].startswith("There was an error parsing the body.")
    response = client.get("/api/v1/nowhere", headers=ADMIN)
    assert response.status_code == 404
    assert response.json()["error"] == "HTTPException"
    assert response.json()["detail"].endswith("Received: GET /api/v1/nowhere")

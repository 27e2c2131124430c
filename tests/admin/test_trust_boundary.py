"""Issue 33, the trust boundary's second pass: each defect's attack, on the app itself.

The live-server probes (forwarded headers, a never-read body on a real socket, slow clients) are
in test_trust_live.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from fedsplit.protocol import Update, read_weights, write_weights

from tests.admin.asgi import call
from tests.admin.conftest import ADMIN, bearer, create_round, model_arrays, post_file, write_model

SAME_ORIGIN = {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}


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


# 2. A hospital read another hospital's weights ----------------------------------------------------
def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _flat(path: Path) -> np.ndarray:
    update = read_weights(path)
    return np.concatenate([update.arrays[k].ravel() for k in sorted(update.arrays)]).astype(np.float64)


def test_zero_update_trick_is_refused(client, site_token, tmp_path):
    """Probe: hosp-a uploaded all-zero weights with num_examples=1, hosp-b its real weights with
    4000; hosp-a downloaded the aggregate (2 hospitals >= the minimum of 2) and got hosp-b's
    weights to cosine 1.000000. Now one other hospital holding more than 60% of the aggregate's
    weight keeps it from hosp-a; the refusal names and counts no one."""
    a, b = site_token("hosp-a"), site_token("hosp-b")
    rnd = create_round(client)
    rng = np.random.default_rng(7)
    real = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in model_arrays().items()}
    b_file = write_weights(Update(arrays=real, num_examples=4000), tmp_path / "b.h5")
    assert post_file(client, rnd["id"], a, write_model(tmp_path / "zeros.h5", 0.0),
                     num_examples=1).status_code == 201
    assert post_file(client, rnd["id"], b, b_file).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    admin_copy = tmp_path / "aggregate.h5"
    admin_copy.write_bytes(client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=ADMIN).content)
    assert _cosine(_flat(admin_copy), _flat(b_file)) > 0.999999  # what hosp-a would have read
    refused = client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(a))
    assert refused.status_code == 403
    detail = refused.json()["detail"]
    assert "one other hospital holds more than 60%" in detail
    assert "hosp-b" not in detail and "4000" not in detail and not re.search(r"\b2 hospital", detail)
    assert client.get(f"/api/v1/rounds/{rnd['id']}/model", headers=bearer(b)).status_code == 200
    sign_in = TestClient(client.app)
    assert sign_in.post("/ui/login", data={"token": a}, headers=SAME_ORIGIN,
                        follow_redirects=False).status_code == 303
    page = sign_in.get(f"/ui/rounds/{rnd['id']}").text
    assert f"/ui/rounds/{rnd['id']}/model" not in page  # no link either
    assert sign_in.get(f"/ui/rounds/{rnd['id']}/model").status_code == 403


def test_dominance_and_own_share_are_settings(make_client, site_token, tmp_path):
    """Balanced hospitals get the aggregate; a hospital whose own share is negligible does not
    (--min-own-share, a fraction of an equal share); --max-site-share moves the dominance line."""
    client = make_client(max_site_share=0.9)
    tokens = [site_token(f"hosp-{c}") for c in "abc"]
    rnd = create_round(client)
    for token, n, value in zip(tokens, (1, 500, 700), (0.0, 1.0, 2.0), strict=True):
        assert post_file(client, rnd["id"], token, write_model(tmp_path / f"{n}.h5", value),
                         num_examples=n).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    model = f"/api/v1/rounds/{rnd['id']}/model"
    small = client.get(model, headers=bearer(tokens[0]))
    assert small.status_code == 403 and "negligible share" in small.json()["detail"]
    assert client.get(model, headers=bearer(tokens[1])).status_code == 200  # c holds 58%
    strict = make_client(max_site_share=0.5)
    assert strict.get(model, headers=bearer(tokens[1])).json()["reason"] is None
    assert "more than 50%" in strict.get(model, headers=bearer(tokens[1])).json()["detail"]

"""The web view over HTTP (TestClient, real app and database): sign-in, pages, scoping, files."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient
from fedsplit.server.admin.ui.sessions import COOKIE

from tests.admin.conftest import ADMIN, ADMIN_TOKEN, bearer, create_round, post_file, write_model
from tests.ui.conftest import sign_in
from tests.ui.rundata import HOSTILE, write_hostile_run

SAME_ORIGIN = {"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "same-origin"}


def _run_ids(html: str) -> list[str]:
    return sorted(set(re.findall(r'href="/ui/runs/([0-9a-f]{12})"', html)))


def test_sign_in_page_and_cookie(client: TestClient) -> None:
    """A form with a password field named token; the cookie holds a session id, HttpOnly, Strict."""
    assert client.get("/ui", follow_redirects=False).headers["location"] == "/ui/login"
    page = client.get("/ui/login")
    assert page.status_code == 200
    assert re.search(r'<input[^>]*name="token"[^>]*type="password"', page.text)
    assert "default-src 'none'" in page.headers["content-security-policy"]
    bad = client.post("/ui/login", data={"token": "wrong-token-000000000"}, headers=SAME_ORIGIN)
    assert bad.status_code == 401 and "matches no admin" in bad.text and "wrong-token" not in bad.text
    response = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=SAME_ORIGIN,
                           follow_redirects=False)
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert ADMIN_TOKEN not in cookie and ADMIN_TOKEN not in response.headers["location"]
    overview = client.get("/ui")
    assert overview.status_code == 200 and ADMIN_TOKEN not in overview.text
    assert "Signed in as <strong>admin</strong>" in overview.text


def test_cross_site_sign_in_is_refused(client: TestClient) -> None:
    """A form posted from another site (login CSRF) sets no session."""
    for headers in ({"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
                    {"Origin": "http://evil.example"}):
        response = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=headers,
                               follow_redirects=False)
        assert response.status_code == 403 and "set-cookie" not in response.headers


def test_sign_out_ends_the_session_on_the_server(client: TestClient) -> None:
    """After sign-out the old cookie no longer opens a page, even if a browser kept it."""
    sign_in(client, ADMIN_TOKEN)
    sid = client.cookies.get(COOKIE)
    out = client.post("/ui/logout", headers=SAME_ORIGIN, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/ui/login"
    client.cookies.set(COOKIE, sid, path="/ui")
    assert client.get("/ui", follow_redirects=False).status_code == 303
    assert client.get("/ui", headers={"X-Fedsplit-Live": "1"}).status_code == 401


def test_admin_sees_rest_round_hospitals_and_site_sees_only_itself(
    client: TestClient, make_client: Callable[..., TestClient], site_token: Callable[..., str], tmp_path: Path
) -> None:
    """Admin: both hospitals, counts, weights, sha256; hospital-a: itself only, model link."""
    a, b = site_token("hospital-a"), site_token("hospital-b")
    rnd = create_round(client)
    for token, value, n in ((a, 1.0, 30), (b, 3.0, 10)):
        weights = write_model(tmp_path / f"{n}.h5", value, num_examples=n)
        assert post_file(client, rnd["id"], token, weights).status_code == 201
    assert client.post(f"/api/v1/rounds/{rnd['id']}/aggregate", headers=ADMIN).status_code == 200
    sha_a = hashlib.sha256((tmp_path / "30.h5").read_bytes()).hexdigest()
    admin = sign_in(make_client(), ADMIN_TOKEN)
    page = admin.get(f"/ui/rounds/{rnd['id']}").text
    assert "hospital-a" in page and "hospital-b" in page and sha_a in page
    assert "0.75" in page and "0.25" in page  # count-weighted FedAvg weights
    assert 'tag-aggregated' in page and f'href="/ui/rounds/{rnd["id"]}/model"' in page
    model = admin.get(f"/ui/rounds/{rnd['id']}/model")
    assert model.status_code == 200 and model.content[:8] == b"\x89HDF\r\n\x1a\n"
    site = sign_in(make_client(), a)
    for path in ("/ui", f"/ui/rounds/{rnd['id']}", "/ui/uploads"):
        html = site.get(path).text
        assert "hospital-a" in html and "hospital-b" not in html, path
    assert site.get(f"/ui/rounds/{rnd['id']}/model").status_code == 200


def test_refused_upload_is_shown_with_reason_size_and_sha(
    client: TestClient, make_client: Callable[..., TestClient], site_token: Callable[..., str]
) -> None:
    """The upload route stores nothing on refusal; the view still lists who, what and why.

    A request without a valid token is refused before its body is read and is not listed (it
    has no identity; issue 25: such noise once evicted every real refusal)."""
    token = site_token("hospital-x")
    rnd = create_round(client)
    body = b"this is not an HDF5 file" * 10
    refused = client.post(f"/api/v1/rounds/{rnd['id']}/uploads", headers=bearer(token),
                          files={"file": ("bad<name>.h5", body, "application/x-hdf5")},
                          data={"num_examples": "5"})
    assert refused.status_code == 422
    reason = refused.json()["reason"]
    unknown = client.post(f"/api/v1/rounds/{rnd['id']}/uploads", headers=bearer("nobody-" * 4),
                          files={"file": ("x.h5", b"x", "application/x-hdf5")})
    assert unknown.status_code == 401
    admin = sign_in(make_client(), ADMIN_TOKEN)
    html = admin.get("/ui/uploads").text
    assert hashlib.sha256(body).hexdigest() in html and f"{len(body):,} B" in html
    assert "bad&lt;name&gt;.h5" in html and reason in html and "unknown token" not in html
    assert "hospital-x" in admin.get(f"/ui/rounds/{rnd['id']}").text
    other = sign_in(make_client(), site_token("hospital-y"))
    assert "hospital-x" not in other.get("/ui/uploads").text


def test_flower_run_pages_escape_names_and_scope_models(
    runs_dir: Path, make_client: Callable[..., TestClient], site_token: Callable[..., str]
) -> None:
    """Rounds, statuses and reasons from the out-dir; names escaped; models admin-only."""
    write_hostile_run(runs_dir / "krum")
    admin = sign_in(make_client(), ADMIN_TOKEN)
    overview = admin.get("/ui").text
    (run_id,) = _run_ids(overview)
    assert "runs/krum/federation" in overview and "round 3</a>:" in overview
    run = admin.get(f"/ui/runs/{run_id}").text
    assert HOSTILE not in run and "&lt;script&gt;" in run
    assert "<svg" in run and "Privacy budget" in run and "global model unchanged" in run
    assert re.search(r"Round 1</a></th>\s*<td>3 of 6 \(1 used\)</td>", run)
    rnd = admin.get(f"/ui/runs/{run_id}/rounds/1").text
    for text in ("tag-selected", "tag-not-selected", "tag-capped", "tag-late", "tag-failed",
                 "tag-excluded", "round-timeout", "CUDA out of memory", "Krum score", "(sent 80)"):
        assert text in rnd, text
    model = admin.get(f"/ui/runs/{run_id}/rounds/1/model")
    assert model.status_code == 200 and model.content[:4] == b"\x89HDF"
    assert admin.get(f"/ui/runs/{run_id}/rounds/3/model").status_code == 404  # error round: none saved
    assert admin.get("/ui/runs/0123456789ab").status_code == 404
    assert admin.get("/ui/runs/..%2F..%2Fetc").status_code in (404, 422)
    site = sign_in(make_client(), site_token("hospital-a"))
    mine = site.get(f"/ui/runs/{run_id}/rounds/1").text
    assert "hospital-a" in mine and "hospital-b" not in mine and "hospital-c" not in mine
    assert site.get(f"/ui/runs/{run_id}/rounds/1/model").status_code == 403
    outsider = sign_in(make_client(), site_token("hospital-z"))
    assert _run_ids(outsider.get("/ui").text) == []
    assert outsider.get(f"/ui/runs/{run_id}").status_code == 404


def test_polling_gets_304_until_something_changes(
    client: TestClient, site_token: Callable[..., str], tmp_path: Path
) -> None:
    """The live script's request: same ETag -> 304; a new upload -> 200 with a new ETag."""
    sign_in(client, ADMIN_TOKEN)
    rnd = create_round(client)
    first = client.get("/ui", headers={"X-Fedsplit-Live": "1"})
    etag = first.headers["etag"]
    again = client.get("/ui", headers={"X-Fedsplit-Live": "1", "If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    post_file(client, rnd["id"], site_token("hospital-q"), write_model(tmp_path / "q.h5"))
    changed = client.get("/ui", headers={"X-Fedsplit-Live": "1", "If-None-Match": etag})
    assert changed.status_code == 200 and "hospital-q" in changed.text
    assert changed.headers["cache-control"] == "no-store"


def test_assets_are_local_and_pages_name_no_other_origin(client: TestClient, runs_dir: Path) -> None:
    """Every src/href is a path on this server; the two static files are served."""
    write_hostile_run(runs_dir / "r")
    sign_in(client, ADMIN_TOKEN)
    pages = [client.get("/ui").text, client.get("/ui/login").text]
    pages.append(client.get(f"/ui/runs/{_run_ids(pages[0])[0]}").text)
    for html in pages:
        for url in re.findall(r'(?:src|href|action)="([^"]*)"', html):
            assert url.startswith(("/", "#", "data:")), url
    css = client.get("/ui/static/app.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert "url(" not in css.text and "@import" not in css.text
    assert client.get("/ui/static/live.js").status_code == 200
    assert client.get("/ui/static/../app.py").status_code == 404

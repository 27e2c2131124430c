"""Issue 25, defects 5-10: each probe's request, and the answer it must now get."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from fedsplit.cli.app import app as fedsplit_app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.admin.limits import MAX_HEADER_BYTES
from fedsplit.server.admin.ratelimit import MAX_DELAY_S, SignInLimiter
from fedsplit.server.admin.store import add_site, remove_site

from tests.admin.asgi import call
from tests.admin.conftest import ADMIN, ADMIN_TOKEN, bearer, create_round, post_file, write_model

SAME_ORIGIN = {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}


def sign_in(client: TestClient, token: str) -> str:
    """Sign in through the form; return the session cookie."""
    response = client.post("/ui/login", data={"token": token}, headers=SAME_ORIGIN,
                           follow_redirects=False)
    assert response.status_code == 303, response.text
    return response.cookies["fedsplit_ui"]


def signed_in(client: TestClient) -> bool:
    return client.get("/ui", follow_redirects=False).status_code == 200


# 5. Flower round errors named the other hospitals ----------------------------------------------
def _failed_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    history = {
        "status": "failed", "error": "round 1: too few replies: hospital-b late",
        "config": {"num-server-rounds": 1, "strategy": "fedavg"},
        "rounds": [{"round": 1, "error": "too few replies: hospital-b late (needs 2 of 2)",
                    "train": {"sites": [
                        {"site": "hospital-a", "num_examples": 10, "metrics": {"train-loss": 0.5}},
                        {"site": "hospital-b", "excluded": True, "late": True,
                         "reason": "no train reply within round-timeout (30 s)"}]}}],
    }
    (folder / "history.json").write_text(json.dumps(history))


def test_round_error_is_rewritten_for_hospitals(make_client, tmp_path, site_token):
    """Probe: a hospital read 'too few replies: X late' naming another hospital."""
    _failed_run(tmp_path / "runs" / "failed")
    token = site_token("hospital-a")
    hospital = make_client(runs=(tmp_path / "runs",))
    sign_in(hospital, token)
    overview = hospital.get("/ui").text
    run_id = re.findall(r'href="/ui/runs/([0-9a-f]{12})"', overview)[0]
    for page in ("/ui", f"/ui/runs/{run_id}", f"/ui/runs/{run_id}/rounds/1"):
        html = hospital.get(page).text
        assert "hospital-b" not in html, page
    round_page = hospital.get(f"/ui/runs/{run_id}/rounds/1").text
    assert "too few hospitals replied in time" in round_page
    admin = make_client(runs=(tmp_path / "runs",))
    sign_in(admin, ADMIN_TOKEN)
    assert "too few replies: hospital-b late" in admin.get(f"/ui/runs/{run_id}/rounds/1").text


# 6. Five server errors --------------------------------------------------------------------------
@pytest.mark.parametrize("origin", ["http://[::1", "http://[zz]:80", "http://host:port", "null"])
@pytest.mark.parametrize("path", ["/ui/login", "/ui/logout"])
def test_malformed_origin_is_refused_not_a_server_error(client, origin, path):
    """Probe: sign-in and sign-out with Origin http://[::1 or http://[zz]:80 answered 500."""
    response = client.post(path, data={"token": ADMIN_TOKEN}, headers={"Origin": origin},
                           follow_redirects=False)
    assert response.status_code == 403 and "set-cookie" not in response.headers


def _long_boundary_body(boundary: bytes) -> bytes:
    return (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="a.h5"'
            b"\r\n\r\nxx\r\n--" + boundary + b"--\r\n")


def test_long_multipart_boundary_is_a_clear_422(client, site_token):
    """Probe: an upload (no token needed) and PUT .../template with a boundary over 256
    characters answered 500 (the crash was in the refusal recorder)."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    boundary = b"b" * 300
    headers = {"Content-Type": "multipart/form-data; boundary=" + boundary.decode()}
    body = _long_boundary_body(boundary)
    for auth, status in (({}, 401), (bearer(token), 422)):
        response = client.post(f"/api/v1/rounds/{rnd['id']}/uploads", content=body,
                               headers={**headers, **auth})
        assert response.status_code == status, auth
    assert "boundary cannot be used" in response.json()["detail"]
    template = client.put(f"/api/v1/rounds/{rnd['id']}/template", content=body,
                          headers={**headers, **ADMIN})
    assert template.status_code == 422 and template.json()["reason"] == "bad_request"


@pytest.mark.parametrize("count", ["²", "①", "٣", "12³"])
def test_unicode_digit_count_is_refused(client, site_token, tmp_path, count):
    """Probe: num_examples=² or ① reached int() and answered 500."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    response = post_file(client, rnd["id"], token, write_model(tmp_path / "a.h5"), num_examples=count)
    assert response.status_code == 422 and response.json()["reason"] == "num_examples"


# 7. Sessions were never re-checked against the hospitals table ---------------------------------
def test_removed_hospital_loses_sessions_and_api_access_at_once(client, data_dir, site_token, tmp_path):
    """Probe: a deleted hospital's session still loaded pages and downloaded models."""
    token = site_token("hospital-a")
    site_token("hospital-b")
    rnd = create_round(client)
    browser = TestClient(client.app)
    sign_in(browser, token)
    assert signed_in(browser)
    assert client.get("/api/v1/rounds", headers=bearer(token)).status_code == 200
    assert run_guarded(fedsplit_app, ["admin", "remove-site", "hospital-a",
                                      "--data-dir", str(data_dir)]) == 0
    assert not signed_in(browser)
    assert browser.get(f"/ui/rounds/{rnd['id']}/model", follow_redirects=False).status_code == 303
    assert client.get("/api/v1/rounds", headers=bearer(token)).status_code == 401
    upload = post_file(client, rnd["id"], token, write_model(tmp_path / "a.h5"))
    assert upload.status_code == 401
    # the name is not handed to someone else (its old sessions and uploads stay with it)
    with pytest.raises(ConfigError, match="was removed"):
        add_site(data_dir=data_dir, name="hospital-a")
    with pytest.raises(ConfigError, match="no registered site 'hospital-a' \\(it was removed\\)"):
        remove_site(data_dir=data_dir, name="hospital-a")


def test_rotated_token_ends_old_sessions_and_old_token(client, data_dir, site_token, capsys):
    """`fedsplit admin rotate-token` prints a new token; the old one and its sessions stop."""
    old = site_token("hospital-a")
    browser = TestClient(client.app)
    sign_in(browser, old)
    assert run_guarded(fedsplit_app, ["admin", "rotate-token", "hospital-a",
                                      "--data-dir", str(data_dir)]) == 0
    new = capsys.readouterr().out.strip().splitlines()[-1]
    assert new.startswith("fss_") and new != old
    assert not signed_in(browser)
    assert client.get("/api/v1/rounds", headers=bearer(old)).status_code == 401
    assert client.get("/api/v1/rounds", headers=bearer(new)).status_code == 200
    sign_in(browser, new)
    assert signed_in(browser)
    assert run_guarded(fedsplit_app, ["admin", "rotate-token", "nobody",
                                      "--data-dir", str(data_dir)]) == 2
    assert "There is no registered site 'nobody'" in capsys.readouterr().err


# 8. A hospital could be registered as 'admin' ---------------------------------------------------
@pytest.mark.parametrize("name", ["admin", "Admin", "ADMINISTRATOR", "template", "unknown-token"])
def test_reserved_names_are_refused(data_dir, name, capsys):
    """Probe: a hospital registered as 'admin' saw the admin's refusals."""
    assert run_guarded(fedsplit_app, ["admin", "add-site", name, "--data-dir", str(data_dir)]) == 2
    assert "is reserved" in capsys.readouterr().err


def test_hospital_sees_only_refusals_of_its_own_identity(client, site_token, tmp_path):
    """Refusals are kept by identity (site id), not by name: the admin's refusal (who='admin')
    is never shown to a hospital."""
    token = site_token("hospital-a")
    rnd = create_round(client)
    admin_refused = client.post(f"/api/v1/rounds/{rnd['id']}/uploads", headers=ADMIN,
                                files={"file": ("admin-secret.h5", b"x" * 10)})
    assert admin_refused.status_code == 403
    browser = TestClient(client.app)
    sign_in(browser, ADMIN_TOKEN)
    assert "PermissionDenied" in browser.get("/ui/uploads").text
    sign_in(browser, token)
    assert "PermissionDenied" not in browser.get("/ui/uploads").text


# 9. Signing in again left the previous session valid -------------------------------------------
def test_sign_in_rotates_the_session(client):
    """The old session id stops working when the same browser signs in again."""
    first = sign_in(client, ADMIN_TOKEN)
    second = sign_in(client, ADMIN_TOKEN)
    assert first != second
    stale = TestClient(client.app)
    stale.cookies.set("fedsplit_ui", first, path="/ui")
    assert not signed_in(stale)
    assert signed_in(client)


# 10. Smaller points ----------------------------------------------------------------------------
def test_oversized_headers_are_refused_with_431(client):
    """Probe: a 50 MB header was answered 200 (the live server test sends the 50 MB; here the
    app's own check, for any server in front of it)."""
    answer = call(client.app, "GET", "/healthz",
                  {"Host": "testserver", "X-Big": "a" * (MAX_HEADER_BYTES + 1)})
    assert answer.status == 431
    assert call(client.app, "GET", "/healthz", {"Host": "testserver"}).status == 200


def test_unknown_host_is_refused(client, make_client):
    """Probe: the Host header was not checked (DNS rebinding)."""
    rebound = TestClient(client.app, base_url="http://attacker.example")
    response = rebound.get("/healthz")
    assert response.status_code == 400 and response.json()["reason"] == "host"
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080"):
        assert call(client.app, "GET", "/healthz", {"Host": host}).status == 200, host
    wildcard = make_client(allowed_hosts=("*.hospital.example",))
    assert call(wildcard.app, "GET", "/healthz", {"Host": "fl.hospital.example"}).status == 200
    assert call(wildcard.app, "GET", "/healthz", {"Host": "hospital.example.evil"}).status == 400


def test_origin_check_compares_the_scheme(client):
    """Probe: Origin was compared by host and port only, not the scheme."""
    for origin in ("https://testserver", "http://testserver.evil", "http://testserver/path"):
        response = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers={"Origin": origin},
                               follow_redirects=False)
        assert response.status_code == 403, origin
    ok = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers={"Origin": "http://testserver"},
                     follow_redirects=False)
    assert ok.status_code == 303


@pytest.mark.parametrize("path", ["/ui/rounds/<script>alert(1)</script>", "/ui/no-such-<b>page</b>",
                                  "/ui/runs/zz%3Cimg%3E"])
def test_ui_errors_do_not_echo_the_path_and_carry_nosniff(client, path):
    """Probe: JSON 404/422 answers under /ui echoed the decoded path without nosniff."""
    sign_in(client, ADMIN_TOKEN)
    response = client.get(path)
    assert response.status_code in (404, 422)
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["content-type"].startswith("text/html")
    assert "<script>alert" not in response.text and "<b>page" not in response.text
    assert "<img>" not in response.text and "script" not in response.text.split("</head>")[-1].lower()
    api = client.get("/api/v1/no-such-<b>", headers=ADMIN)
    assert api.headers["x-content-type-options"] == "nosniff"


def test_sign_in_brute_force_meets_a_growing_delay_and_is_logged(client, caplog):
    """Probe: 300 wrong tokens in 0.7 s met no delay and nothing was logged."""
    caplog.set_level(logging.WARNING, logger="fedsplit.admin.security")
    statuses = []
    for i in range(300):
        response = client.post("/ui/login", data={"token": f"wrong-token-{i:04d}-xxxxxxxx"},
                               headers=SAME_ORIGIN)
        statuses.append(response.status_code)
    refused = statuses.count(401)  # tokens actually checked; the rest waited (429)
    assert statuses[:6] == [401] * 6 and statuses[6] == 429  # the 6th failure starts the wait
    assert refused <= 10 and statuses.count(429) == 300 - refused
    waiting = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=SAME_ORIGIN,
                          follow_redirects=False)
    assert waiting.status_code == 303  # issue 33: only failures wait; a valid token is served
    api = client.get("/api/v1/rounds", headers=bearer("still-guessing-0000000000"))
    assert api.status_code == 429 and "Retry-After" in api.headers
    failures = [r for r in caplog.records if "sign-in failure" in r.getMessage()]
    assert len(failures) == refused and "testclient" in failures[-1].getMessage()
    metrics = client.get("/metrics", headers=ADMIN).text
    assert f'fedsplit_unauthenticated_refused_total{{kind="bad_token"}} {refused}' in metrics
    assert f'fedsplit_unauthenticated_refused_total{{kind="rate_limited"}} {301 - refused}' in metrics


def test_sign_in_delay_doubles_per_address():
    """Five free failures, then 1, 2, 4 ... s, capped; other addresses are not affected."""
    limiter = SignInLimiter()
    delays = [limiter.failed("198.51.100.7")[1] for _ in range(20)]
    assert delays[:5] == [0.0] * 5 and delays[5:9] == [1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == MAX_DELAY_S
    assert limiter.wait_s("198.51.100.7") > 0 and limiter.wait_s("198.51.100.8") == 0


def test_docs_are_served_from_local_files(client, make_client):
    """Probe: /docs loaded its scripts from a CDN, which an offline hospital network cannot reach."""
    page = client.get("/docs")
    assert page.status_code == 200
    assert "cdn." not in page.text and "https://" not in page.text
    assert "/docs/assets/swagger-ui-bundle.js" in page.text
    script = client.get("/docs/assets/swagger-ui-bundle.js")
    assert script.status_code == 200 and len(script.content) > 100_000
    assert client.get("/docs/assets/swagger-ui.css").status_code == 200
    assert client.get("/docs/assets/..%2Fconfig.py").status_code == 404
    off = make_client(docs=False)
    assert off.get("/docs").status_code == 404

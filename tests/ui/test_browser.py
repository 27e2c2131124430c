"""The web view in a real Chromium (Debian's chromium + chromedriver, driven by selenium).

One live admin API (uvicorn in a thread on 127.0.0.1, a free port) serves the whole module, with
``--runs`` pointing at a real ``fedsplit simulate`` out-dir (2 hospitals, 2 rounds). Set
FEDSPLIT_SCREENSHOTS=DIR to save the screenshots docs/web-view.md shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fedsplit.server.admin.app import create_app
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.store import add_site

from tests.admin.conftest import ADMIN_TOKEN, write_model
from tests.ui.browser import chromium, page_text, requested_urls, serve, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("need_browser")]

SHOTS = os.environ.get("FEDSPLIT_SCREENSHOTS")


@pytest.fixture(scope="module")
def flower_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one real simulate out-dir (2 hospitals, 2 rounds)."""
    runs = tmp_path_factory.mktemp("runs")
    fedsplit = Path(sys.executable).with_name("fedsplit")
    subprocess.run(
        [str(fedsplit), "simulate", "--dataset", "breast-cancer", "--sites", "2", "--rounds", "2",
         "--out", str(runs / "sim")],
        check=True, timeout=300, capture_output=True,
    )
    return runs


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, flower_runs: Path) -> Iterator[dict[str, Any]]:
    """The admin API with its web view, live on 127.0.0.1; three registered hospitals."""
    data = tmp_path_factory.mktemp("admin")
    app = create_app(AdminSettings(data_dir=data, admin_token=ADMIN_TOKEN, runs=(flower_runs,)))
    with serve(app) as base:
        tokens = {name: add_site(data_dir=data, name=name)
                  for name in ("hospital-a", "hospital-b", "hospital-c")}
        yield {"base": base, "tokens": tokens}


@pytest.fixture(scope="module")
def api(server: dict[str, Any]) -> Iterator[httpx.Client]:
    """A plain HTTP client for the REST API (what hospitals and the admin's scripts use)."""
    with httpx.Client(base_url=server["base"], timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def seen_urls() -> list[str]:
    """Every URL any browser of this module requested."""
    return []


@pytest.fixture
def browser(seen_urls: list[str]) -> Iterator[Any]:
    """A fresh headless Chromium (fresh profile); its requests are collected for the origin test."""
    with chromium() as driver:
        yield driver
        seen_urls.extend(requested_urls(driver))






def _sign_in(driver: Any, base: str, token: str) -> None:
    driver.get(f"{base}/ui")
    wait_for(driver, lambda d: d.current_url.endswith("/ui/login"), "the sign-in page")
    field = driver.find_element("css selector", "input[name='token']")
    assert field.get_attribute("type") == "password"
    field.send_keys(token)
    driver.find_element("css selector", "main form button[type='submit']").click()
    wait_for(driver, lambda d: "Signed in as" in page_text(d), "the signed-in overview")


def _upload(api: httpx.Client, token: str, round_id: int, path: Path) -> None:
    with open(path, "rb") as fh:
        response = api.post(f"/api/v1/rounds/{round_id}/uploads",
                            headers={"Authorization": f"Bearer {token}"},
                            files={"file": (path.name, fh, "application/x-hdf5")})
    assert response.status_code == 201, response.text


def _shot(driver: Any, name: str, height: int | None = None) -> None:
    if not SHOTS:
        return
    Path(SHOTS).mkdir(parents=True, exist_ok=True)
    if height is None:
        height = driver.execute_script("return document.documentElement.scrollHeight") + 20
    width = driver.execute_script("return window.innerWidth")
    # headless windows cannot grow past the virtual screen: emulate a taller viewport instead
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": min(max(height, 400), 2400), "deviceScaleFactor": 1, "mobile": False})
    time.sleep(0.5)
    driver.save_screenshot(str(Path(SHOTS) / name))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_sign_in_and_sign_out(browser: Any, server: dict[str, Any]) -> None:
    """The token goes in once; the browser keeps only an HttpOnly session cookie; sign-out ends it."""
    base = server["base"]
    _sign_in(browser, base, ADMIN_TOKEN)
    assert "Signed in as admin" in page_text(browser)
    (cookie,) = browser.get_cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["value"] != ADMIN_TOKEN
    assert ADMIN_TOKEN not in browser.page_source and ADMIN_TOKEN not in browser.current_url
    storage = browser.execute_script(
        "return [document.cookie, window.localStorage.length, window.sessionStorage.length]")
    assert storage == ["", 0, 0]
    browser.find_element("css selector", "header form button").click()
    wait_for(browser, lambda d: d.current_url.endswith("/ui/login"), "the sign-in page after sign-out")
    browser.get(f"{base}/ui")
    assert browser.current_url.endswith("/ui/login") and "Signed in as" not in page_text(browser)


def test_rest_round_live_updates_and_aggregation(
    browser: Any, server: dict[str, Any], api: httpx.Client, tmp_path: Path
) -> None:
    """Two uploads shown; a third appears without a reload; then the round shows as aggregated."""
    base, tokens = server["base"], server["tokens"]
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    created = api.post("/api/v1/rounds", headers=admin, json={"strategy": "fedavg", "min_uploads": 2})
    round_id = created.json()["id"]
    for name, value, n in (("hospital-a", 1.0, 40), ("hospital-b", 2.0, 20)):
        _upload(api, tokens[name], round_id, write_model(tmp_path / f"{name}.h5", value, num_examples=n))
    _sign_in(browser, base, ADMIN_TOKEN)
    browser.get(f"{base}/ui/rounds/{round_id}")
    table = browser.find_element("id", "round-sites").text
    assert "hospital-a" in table and "hospital-b" in table and "hospital-c" not in table
    browser.execute_script("window.__noReload = 'still here';")
    _upload(api, tokens["hospital-c"], round_id, write_model(tmp_path / "c.h5", 3.0, num_examples=20))
    wait_for(browser, lambda d: "hospital-c" in d.find_element("id", "round-sites").text,
          "the third upload to appear on the open page")
    assert browser.execute_script("return window.__noReload") == "still here"
    assert api.post(f"/api/v1/rounds/{round_id}/aggregate", headers=admin).status_code == 200
    wait_for(browser, lambda d: d.find_element("css selector", "#round-head h1 .tag").text == "aggregated",
          "the round to show as aggregated")
    assert browser.execute_script("return window.__noReload") == "still here"
    sites = browser.find_element("id", "round-sites").text
    assert "0.5" in sites and "0.25" in sites  # FedAvg weights 40/80, 20/80, 20/80
    browser.find_element("css selector", f"a[href='/ui/rounds/{round_id}/model']")
    _shot(browser, "web-view-round.png")
    browser.get(f"{base}/ui")
    done = f"REST round {round_id} aggregated: 3 of 3 hospitals returned"
    wait_for(browser, lambda d: done in page_text(d), "the aggregation in the activity feed")
    _shot(browser, "web-view-admin.png")


def test_hospital_sees_only_itself(browser: Any, server: dict[str, Any], api: httpx.Client,
                                   tmp_path: Path) -> None:
    """A hospital's token: its own uploads and rows, no other hospital's name anywhere."""
    base, tokens = server["base"], server["tokens"]
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    round_id = api.post("/api/v1/rounds", headers=admin, json={"strategy": "median"}).json()["id"]
    for name in ("hospital-a", "hospital-b"):
        _upload(api, tokens[name], round_id, write_model(tmp_path / f"{name}.h5", 1.0, num_examples=10))
    _sign_in(browser, base, tokens["hospital-b"])
    assert "Signed in as hospital hospital-b" in page_text(browser)
    for path in ("/ui", f"/ui/rounds/{round_id}", "/ui/uploads"):
        browser.get(f"{base}{path}")
        text = page_text(browser)
        assert "hospital-b" in text and "hospital-a" not in text and "hospital-c" not in text, path
    browser.get(f"{base}/ui/rounds/{round_id}")
    _shot(browser, "web-view-hospital.png")


def test_flower_simulation_from_its_out_dir(browser: Any, server: dict[str, Any]) -> None:
    """The simulate run's rounds and hospitals, curves and model links, from --runs."""
    base = server["base"]
    _sign_in(browser, base, ADMIN_TOKEN)
    runs = browser.find_element("id", "flower-runs")
    assert "sim/federation" in runs.text and "finished" in runs.text and "site-0, site-1" in runs.text
    runs.find_element("partial link text", "sim/federation").click()
    wait_for(browser, lambda d: "Curves" in page_text(d), "the run page")
    rounds = browser.find_element("id", "run-rounds").text
    assert "Round 1" in rounds and "Round 2" in rounds and "2 of 2" in rounds
    assert len(browser.find_elements("css selector", "#run-charts svg.chart")) >= 2
    _shot(browser, "web-view-run.png")
    browser.find_element("link text", "Round 2").click()
    wait_for(browser, lambda d: "round 2" in d.find_element("tag name", "h1").text, "the round page")
    table = browser.find_element("css selector", "#run-round table").text
    assert "site-0" in table and "site-1" in table and "replied" in table
    href = browser.find_element("partial link text", "round-002.h5").get_attribute("href")
    assert urlsplit(href).path.endswith("/rounds/2/model")


def test_keyboard_and_phone_width(server: dict[str, Any], seen_urls: list[str]) -> None:
    """Tab reaches the skip link first; at 390 px the page itself does not scroll sideways."""
    with chromium(390, 844) as driver:
        _sign_in(driver, server["base"], ADMIN_TOKEN)
        from selenium.webdriver.common.keys import Keys

        driver.find_element("tag name", "body").send_keys(Keys.TAB)
        focused = driver.switch_to.active_element
        assert focused.text == "Skip to content" and focused.get_attribute("href").endswith("#main")
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 1
        seen_urls.extend(requested_urls(driver))


def test_no_request_to_another_origin(server: dict[str, Any], seen_urls: list[str]) -> None:
    """Every page, stylesheet, script and poll the browsers made went to this server only."""
    base = server["base"]
    with chromium() as driver:
        _sign_in(driver, base, ADMIN_TOKEN)
        links = [a.get_attribute("href") for a in driver.find_elements("css selector", "main a[href]")]
        for href in [f"{base}/ui/uploads", *links[:12]]:
            if "/model" not in href:
                driver.get(href)
        time.sleep(3)  # at least one live poll
        seen_urls.extend(requested_urls(driver))
    web = [u for u in seen_urls if urlsplit(u).scheme in ("http", "https", "ws", "wss")]
    assert any(u.endswith("/ui/static/live.js") for u in web) and any("/ui/runs/" in u for u in web)
    others = [u for u in web if urlsplit(u).netloc != urlsplit(base).netloc]
    assert others == []

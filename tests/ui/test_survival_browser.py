"""A survival run in a real Chromium: the C-index curve, then the Kaplan-Meier curve appearing on
the open page when km.json is written beside the run (the live poll), drawn under the page's CSP
(the band's fill comes from the stylesheet), readable at phone width, nothing fetched elsewhere.

Marked like tests/ui/test_browser.py (``browser``, ``slow``; skipped with the reason when
Chromium is missing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from fedsplit.server.admin.app import create_app
from fedsplit.server.admin.config import AdminSettings

from tests.admin.conftest import ADMIN_TOKEN
from tests.ui.browser import chromium, page_text, requested_urls, serve, wait_for
from tests.ui.test_survival import km_document, write_survival_run

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("need_browser")]



@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The admin API on 127.0.0.1 with ``--runs`` holding one survival run (no km.json yet)."""
    runs = tmp_path_factory.mktemp("runs")
    fed = write_survival_run(runs / "surv")
    app = create_app(AdminSettings(data_dir=tmp_path_factory.mktemp("admin"),
                                   admin_token=ADMIN_TOKEN, runs=(runs,)))
    with serve(app) as base:
        yield {"base": base, "federation": fed}






def test_km_curve_appears_live_and_renders_offline(live: dict[str, Any]) -> None:
    base = live["base"]
    with chromium(390, 844) as driver:
        driver.get(f"{base}/ui")
        wait_for(driver, lambda d: d.current_url.endswith("/ui/login"), "the sign-in page")
        driver.find_element("css selector", "input[name='token']").send_keys(ADMIN_TOKEN)
        driver.find_element("css selector", "main form button[type='submit']").click()
        wait_for(driver, lambda d: "Signed in as" in page_text(d), "the signed-in overview")
        assert "C-index" in driver.find_element("id", "flower-runs").text
        driver.find_element("partial link text", "surv/federation").click()
        wait_for(driver, lambda d: "Global C-index per round" in page_text(d), "the run page")
        assert "Baselines per hospital" in page_text(driver)
        assert not driver.find_elements("css selector", "svg.chart.km")

        (live["federation"] / "km.json").write_text(json.dumps(km_document()))
        wait_for(driver, lambda d: d.find_elements("css selector", "#run-results svg.chart.km"),
              "the Kaplan-Meier curve on the open page")
        svg = driver.find_element("css selector", "svg.chart.km")
        assert svg.get_attribute("role") == "img" and svg.size["height"] > 100
        band = driver.find_element("css selector", "svg.chart.km polygon.band")
        opacity = driver.execute_script("return getComputedStyle(arguments[0]).fillOpacity", band)
        assert float(opacity) == pytest.approx(0.18)  # the stylesheet applied (no inline style)
        assert "Minimum-count rule, K = 5" in page_text(driver)
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 1
        urls = [u for u in requested_urls(driver) if urlsplit(u).scheme in ("http", "https")]
    assert urls and all(urlsplit(u).netloc == urlsplit(base).netloc for u in urls)


"""Every run kind from the real commands, served by the real `fedsplit admin serve --runs DIR`
(issue 34, item 3): a horizontal `fedsplit simulate` run, a `fedsplit vertical simulate` run, a
`fedsplit km` analysis and a `fedsplit cox` fit, all written into one DIR, each listed on the
overview with its own page; then the vertical run's page in a real Chromium: its task, rounds,
kept round, and the fused model against the centralized one and each site alone, with the numbers
of its own summary.json; a hospital's token does not see it.

Marked ``slow`` (the four commands take about 100 s on two quiet cores); the browser test also
``browser`` (skipped with the reason when Chromium is missing, as tests/ui/test_browser.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fedsplit.protocol.record.kinds import run_kind
from fedsplit.protocol.record.vertical import VerticalRunRecord, VerticalSummary
from fedsplit.server.admin.store import add_site
from fedsplit.server.admin.ui.baselines import metric_label
from fedsplit.server.admin.ui.pages import number
from fedsplit.server.admin.ui.runs import run_id_of

from tests.admin.conftest import ADMIN_TOKEN
from tests.admin.test_live_server import LiveServer
from tests.ui.browser import chromium, page_text, requested_urls, wait_for

pytestmark = [pytest.mark.slow]

FEDSPLIT = str(Path(sys.executable).with_name("fedsplit"))
#: each run's folder below DIR and the command that writes it (small data, few rounds)
COMMANDS: dict[str, list[str]] = {
    "sim": ["simulate", "--dataset", "breast-cancer", "--sites", "2", "--rounds", "2"],
    "vert": ["vertical", "simulate", "--dataset", "breast-cancer", "--sites", "2", "--rounds", "2",
             "--steps", "5"],
    "km": ["km", "--dataset", "tcga-brca"],
    "cox": ["cox", "--dataset", "tcga-brca", "--penalizer", "0.01"],
}
#: where each command's history.json lands below its --out
HISTORY_FOLDER = {"sim": "sim/federation", "vert": "vert/federation", "km": "km", "cox": "cox"}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DIR, holding one run of every kind, each written by its real command."""
    root = tmp_path_factory.mktemp("kinds")
    for folder, args in COMMANDS.items():
        done = subprocess.run([FEDSPLIT, *args, "--out", str(root / folder)], capture_output=True,
                              text=True, timeout=420, check=False)
        assert done.returncode == 0, f"fedsplit {' '.join(args)}: {done.stderr[-3000:]}"
    return root


@pytest.fixture(scope="module")
def served(runs_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`fedsplit admin serve --runs DIR` in a subprocess; one hospital registered (site-0, a
    name both the horizontal and the vertical run use)."""
    server = LiveServer(tmp_path_factory.mktemp("admin"), args=("--runs", str(runs_root)))
    try:
        server.start()
        yield {"base": server.url, "site_token": add_site(data_dir=server.data_dir, name="site-0")}
    finally:
        server.stop()


def _signed_in(base: str, token: str) -> httpx.Client:
    client = httpx.Client(base_url=base, timeout=30)
    response = client.post("/ui/login", data={"token": token}, follow_redirects=False,
                           headers={"Origin": base, "Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 303, response.text
    return client


def test_serve_lists_every_run_kind_each_with_its_own_page(runs_root: Path,
                                                           served: dict[str, Any]) -> None:
    kinds = {folder: run_kind(json.loads((runs_root / path / "history.json").read_text()))
             for folder, path in HISTORY_FOLDER.items()}
    # every writer saved its kind through its model
    assert kinds == {"sim": "horizontal", "vert": "vertical", "km": "survival-km",
                     "cox": "survival-cox"}
    for folder in ("vert", "km", "cox"):
        assert json.loads((runs_root / HISTORY_FOLDER[folder] / "history.json").read_text())["kind"]
    ids = {folder: run_id_of(runs_root / path) for folder, path in HISTORY_FOLDER.items()}
    admin = _signed_in(served["base"], ADMIN_TOKEN)
    try:
        overview = admin.get("/ui").text
        pages = {folder: admin.get(f"/ui/runs/{run_id}") for folder, run_id in ids.items()}
    finally:
        admin.close()
    for folder, run_id in ids.items():
        assert f'href="/ui/runs/{run_id}"' in overview, folder
    for label in ("vertical fusion", "Kaplan-Meier curve (fedsplit km)", "Cox model (fedsplit cox)"):
        assert label in overview, label
    assert all(p.status_code == 200 for p in pages.values())
    sim, vert, km, cox = (pages[k].text for k in ("sim", "vert", "km", "cox"))
    assert "Flower run" in sim and "Round 2" in sim and 'class="chart' in sim
    assert "Vertical run" in vert and "Fused model, centralized and each site alone" in vert
    assert 'class="chart km"' in km and "Minimum-count rule, K = 5" in km
    covariates = json.loads((runs_root / "cox" / "cox.json").read_text())["covariates"]
    table = cox.split('id="cox-coefficients"')[1].split("</table>")[0]
    assert table.count('<th scope="row">') == len(covariates) and "age_at_index" in table
    # each page is its own kind's: no page shows another kind's sections
    assert 'id="cox-h"' not in km and 'id="km-h"' not in cox and 'id="fused-h"' not in sim
    assert 'id="curves-h"' not in vert and 'id="curves-h"' not in km and 'id="rounds-h"' not in cox


def _sign_in(driver: Any, base: str, token: str) -> None:
    driver.get(f"{base}/ui")
    wait_for(driver, lambda d: d.current_url.endswith("/ui/login"), "the sign-in page")
    driver.find_element("css selector", "input[name='token']").send_keys(token)
    driver.find_element("css selector", "main form button[type='submit']").click()
    wait_for(driver, lambda d: "Signed in as" in page_text(d), "the signed-in overview")


def _cells(row: Any) -> list[str]:
    return [c.text.strip() for c in row.find_elements("css selector", "th, td")]


@pytest.mark.browser
def test_vertical_page_in_a_browser(need_browser: None, runs_root: Path,
                                    served: dict[str, Any]) -> None:
    base = served["base"]
    history = VerticalRunRecord.load(runs_root / "vert" / "federation" / "history.json")
    summary = VerticalSummary.load(runs_root / "vert" / "summary.json")
    assert history.selection is not None and summary.federated is not None
    kept, metric = history.selection.rounds_kept, history.selection.metric
    assert kept is not None and metric is not None
    vertical_id = run_id_of(runs_root / "vert" / "federation")
    with chromium() as driver:
        _sign_in(driver, base, ADMIN_TOKEN)
        runs = driver.find_element("id", "flower-runs")
        assert "vert/federation" in runs.text and "vertical fusion" in runs.text
        runs.find_element("partial link text", "vert/federation").click()
        wait_for(driver, lambda d: "Vertical run" in page_text(d), "the vertical run's page")
        assert urlsplit(driver.current_url).path == f"/ui/runs/{vertical_id}"
        facts = {dt.text: dd.text for dt, dd in zip(
            driver.find_elements("css selector", "#run-head dl.facts dt"),
            driver.find_elements("css selector", "#run-head dl.facts dd"), strict=True)}
        assert facts["Task"] == history.task == "classification"
        assert facts["Rounds"] == "2 of 2"
        assert facts["Kept round"].startswith(f"Round {kept} ({history.selection.keep}")
        assert facts["Sites"] == "site-0, site-1"
        # fused vs centralized vs each site alone, with summary.json's numbers
        table = driver.find_element("css selector", "section[aria-labelledby='fused-h'] table")
        header = _cells(table.find_element("css selector", "thead tr"))
        column = header.index(metric_label(metric))
        rows = [_cells(r) for r in table.find_elements("css selector", "tbody tr")]
        expected = [("Fused (federation)", summary.federated),
                    ("Centralized (all columns pooled)", summary.centralized),
                    *((f"{a.site} alone", a) for a in summary.local_only)]
        assert [r[0] for r in rows] == [label for label, _ in expected]
        for row, (label, scores) in zip(rows, expected, strict=True):
            assert scores is not None
            assert row[column] == number(scores.metrics[metric]), label
            assert row[-1] == str(scores.rounds_kept), label
        # every round, the kept one marked once
        rounds = driver.find_elements("css selector", "section[aria-labelledby='vrounds-h'] tbody tr")
        assert [_cells(r)[0].split()[:2] for r in rounds] == [["Round", "1"], ["Round", "2"]]
        marked = [r for r in rounds if r.find_elements("css selector", ".tag-kept")]
        assert len(marked) == 1 and _cells(marked[0])[0] == f"Round {kept} kept"
        loss = [_cells(r)[1] for r in rounds]
        assert loss == [number(r.train_loss, 4) for r in history.rounds]
        urls = [u for u in requested_urls(driver) if urlsplit(u).scheme in ("http", "https")]
        assert urls and all(urlsplit(u).netloc == urlsplit(base).netloc for u in urls)

    # a hospital (site-0 took part in the horizontal run) does not see the vertical run
    with chromium() as driver:
        _sign_in(driver, base, served["site_token"])
        runs = driver.find_element("id", "flower-runs").text
        assert "sim/federation" in runs and "vert/federation" not in runs
        driver.get(f"{base}/ui/runs/{vertical_id}")
        text = page_text(driver)
        assert "No Flower run has the id" in text and "Fused" not in text and "Vertical run" not in text

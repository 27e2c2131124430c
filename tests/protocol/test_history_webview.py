"""A run written before protocol/record/ existed still shows in the web view.

The run folder is laid out as ``fedsplit simulate --out RUN`` leaves it: ``RUN/summary.json``
and ``RUN/federation/history.json`` (the v1 files in data/) with the rounds' models; the web
view's ``--runs`` points at the folder holding it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from fedsplit.protocol.update import Update
from fedsplit.protocol.weights import write_weights
from fedsplit.server.admin.app import create_app
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.ui.curves import privacy_of, run_charts
from fedsplit.server.admin.ui.runs import RunCatalog, load_run

from tests.admin.conftest import ADMIN_TOKEN

DATA = Path(__file__).parent / "data"
SAME_ORIGIN = {"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "same-origin"}


def v1_run(runs: Path, name: str, *, dp: bool) -> Path:
    """``runs/name``: a simulate out-dir holding the v1 history and summary; returns federation/."""
    suffix = "-dp" if dp else ""
    fed = runs / name / "federation"
    (fed / "models").mkdir(parents=True)
    shutil.copyfile(DATA / f"history-v1{suffix}.json", fed / "history.json")
    shutil.copyfile(DATA / f"summary-v1{suffix}.json", runs / name / "summary.json")
    for number in (1, 2):
        write_weights(Update(arrays={"w": np.zeros(2, np.float32)}, num_examples=364, round=number),
                      fed / "models" / f"round-{number:03d}.h5")
    return fed


@pytest.mark.parametrize("dp", [False, True])
def test_v1_run_loads_with_rows_baselines_and_privacy(tmp_path: Path, dp: bool) -> None:
    """Every hospital's row per round, the curves against the baselines, and (DP) the budget."""
    run = load_run("v1", v1_run(tmp_path, "v1", dp=dp))
    assert run is not None and run.status == "finished" and run.strategy == "fedavg"
    assert [r.number for r in run.rounds] == [1, 2] and run.total_rounds == 2
    assert run.sites == ["site-0", "site-1"]
    for rnd in run.rounds:
        assert [row.tags for row in rnd.rows] == [["replied"], ["replied"]]
        assert rnd.has_model and rnd.num_examples == 364 and rnd.strategy == "fedavg"
        assert all(row.weight == 0.5 and "train-loss" in row.metrics and "accuracy" in row.eval_metrics
                   for row in rnd.rows)
        assert "accuracy" in rnd.test_metrics and "accuracy" in rnd.metrics
    titles = [c.title for c in run_charts(run)]
    assert titles[:3] == ["Global accuracy per round",
                          "Each hospital's accuracy on its own held-out rows",
                          "Each hospital's training loss"]
    glob = run_charts(run)[0]
    assert [label for label, _, _ in glob.legend][2:] == [
        "centralized (pooled data)", "site-0 alone", "site-1 alone"]
    privacy = privacy_of(run)
    if dp:
        assert privacy is not None and privacy.budget == 5.0
        assert set(privacy.spent) == {"site-0", "site-1"}
        assert all(0 < eps <= 5.0 for eps in privacy.spent.values())
        assert "Privacy spent (epsilon) per hospital" in titles
    else:
        assert privacy is None and len(titles) == 3


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[TestClient]:
    """The web view over ``tmp_path/runs`` (two v1 runs), signed in as the admin."""
    runs = tmp_path / "runs"
    v1_run(runs, "plain", dp=False)
    v1_run(runs, "private", dp=True)
    settings = AdminSettings(data_dir=tmp_path / "admin", admin_token=ADMIN_TOKEN,
                             max_upload_mb=1.0, runs=(runs,))
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8080") as client:
        response = client.post("/ui/login", data={"token": ADMIN_TOKEN}, headers=SAME_ORIGIN,
                               follow_redirects=False)
        assert response.status_code == 303, response.text
        yield client


def test_v1_runs_render_in_the_web_view(admin: TestClient, tmp_path: Path) -> None:
    """The overview lists both old runs; run and round pages render their hospitals and charts."""
    overview = admin.get("/ui")
    assert overview.status_code == 200
    assert "runs/plain/federation" in overview.text and "runs/private/federation" in overview.text
    ids = {name: run.run_id for run in RunCatalog([tmp_path / "runs"]).runs()
           for name in [run.name.split("/")[1]]}
    assert set(re.findall(r'href="/ui/runs/([0-9a-f]{12})"', overview.text)) == set(ids.values())
    for name, run_id in ids.items():
        page = admin.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200
        assert "site-0" in page.text and "site-1" in page.text and "<svg" in page.text
        assert ("Privacy budget" in page.text) == (name == "private")
        rnd = admin.get(f"/ui/runs/{run_id}/rounds/2")
        assert rnd.status_code == 200 and "site-0" in rnd.text and "tag-replied" in rnd.text
        model = admin.get(f"/ui/runs/{run_id}/rounds/2/model")
        assert model.status_code == 200 and model.content[:4] == b"\x89HDF"

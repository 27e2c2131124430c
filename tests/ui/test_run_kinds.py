"""``fedsplit km`` / ``fedsplit cox`` folders as run kinds (issue 34, item 3): their status file is a
`protocol.record.survival.SurvivalAnalysisRecord` (files written before its ``kind`` load unchanged), and
a ``cox`` folder's page shows the fit of its ``cox.json`` (coefficients, hazard ratios, intervals,
p, concordance, each hospital's patients), to the coordinator only."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.kinds import load_run_record, run_kind
from fedsplit.protocol.record.survival import CoxDocument, SurvivalAnalysisRecord
from fedsplit.server.admin.ui.runs import RunCatalog, load_run, run_id_of

from tests.admin.conftest import ADMIN_TOKEN
from tests.ui.conftest import sign_in


def cox_document() -> dict[str, Any]:
    """A cox.json of the shape `server.survival.app.fit_cox` writes (three covariates)."""
    def covariate(coef: float, se: float) -> dict[str, float]:
        return {"coef": coef, "se": se, "hazard_ratio": math.exp(coef),
                "coef_lower_95": coef - 1.96 * se, "coef_upper_95": coef + 1.96 * se,
                "hr_lower_95": math.exp(coef - 1.96 * se), "hr_upper_95": math.exp(coef + 1.96 * se),
                "z": coef / se, "p": 0.0134}
    return {
        "model": "Cox proportional hazards, stratified by hospital (each its own baseline hazard)",
        "ties": "efron", "penalizer": 0.01, "l1_ratio": 0.0, "hospitals": ["north", "south"],
        "rows": 866, "events": 119,
        "covariates": {"age_at_index": covariate(0.018728, 0.007574),
                       "<b>stage</b> IIA": covariate(-0.3125, 0.25),
                       "gender_male": covariate(0.4260, 0.5339)},
        "log_likelihood": -418.1621, "log_likelihood_null": -472.2848, "newton_rounds": 6,
        "newton_steps": [{"round": 1, "loglik": -472.28, "step_norm": 1.1}],
        "concordance": 0.7917, "concordance_note": "Harrell's C ...",
        "per_site": {"rows": {"north": 500, "south": 366},
                     "concordance": {"north": 0.8245, "south": 0.7045}},
        "secure_aggregation": "off", "wall_seconds": 16.9,
    }


def write_analysis(folder: Path, status: dict[str, Any], out: dict[str, Any] | str | None = None,
                   name: str = "cox.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "history.json").write_text(json.dumps(status))
    if out is not None:
        (folder / name).write_text(out if isinstance(out, str) else json.dumps(out))
    return folder


def test_old_status_files_load_unchanged_and_new_ones_carry_their_kind(tmp_path: Path) -> None:
    for old in ({"status": "finished", "mode": "km"},
                {"status": "failed", "mode": "cox", "error": "CollinearError: ..."}):
        path = write_analysis(tmp_path / old["mode"], old) / "history.json"
        record = load_run_record(path)
        assert isinstance(record, SurvivalAnalysisRecord) and record.mode == old["mode"]
        assert record.to_json() == old  # read and written back unchanged: no key added
    record = SurvivalAnalysisRecord.start("km", at=1_700_000_000.0)
    record.end("finished", at=1_700_000_009.5)
    record.save(tmp_path / "new.json")
    data = json.loads((tmp_path / "new.json").read_text())
    assert data == {"kind": "survival-km", "status": "finished", "mode": "km",
                    "started_at": 1_700_000_000.0, "finished_at": 1_700_000_009.5}
    assert run_kind(data) == "survival-km"
    for bad in ({"status": "finished", "mode": "cox", "kind": "survival-km"},
                {"status": "finished", "mode": "survival"}):
        with pytest.raises(ConfigError, match="survival analysis status"):
            SurvivalAnalysisRecord.from_json(bad)


def test_a_cox_folder_shows_its_fit_to_the_coordinator(make_client: Callable[..., TestClient],
                                                       runs_dir: Path,
                                                       site_token: Callable[..., str]) -> None:
    folder = write_analysis(runs_dir / "cox", {"kind": "survival-cox", "status": "finished",
                                               "mode": "cox", "started_at": 1_700_000_000.0,
                                               "finished_at": 1_700_000_017.0}, cox_document())
    run = load_run("cox", folder)
    assert run is not None and run.kind == "survival-cox" and run.cox is not None
    assert run.cox.doc is not None and next(iter(run.cox.doc.covariates)) == "age_at_index"
    admin = sign_in(make_client(), ADMIN_TOKEN)
    overview = admin.get("/ui").text
    run_id = run_id_of(folder)
    assert f"/ui/runs/{run_id}" in overview and "Cox model (fedsplit cox)" in overview
    page = admin.get(f"/ui/runs/{run_id}").text
    table = page.split('id="cox-coefficients"')[1].split("</table>")[0]
    rows = re.findall(r"<tr><th scope=\"row\">(.*?)</th>(.*?)</tr>", table, re.S)
    assert [name for name, _ in rows] == ["age_at_index", "&lt;b&gt;stage&lt;/b&gt; IIA", "gender_male"]
    first = re.findall(r'<td class="num">(.*?)</td>', rows[0][1], re.S)
    assert first == ["0.01873", "0.007574", "1.019", "1.004 – 1.034", "0.0134"]
    assert "› Survival analysis</p>" in page and "Flower run" not in page
    for shown in ("866", "119 events", "-418.1621", "-472.2848", "0.7917", "efron",
                  "<dt>Hospitals</dt><dd>north, south</dd>"):
        assert shown in page, shown
    sites = page.split('id="cox-sites"')[1].split("</table>")[0]
    assert "north" in sites and "0.8245" in sites and "366" in sites
    hospital = sign_in(make_client(), site_token("north"))
    assert "fedsplit cox" not in hospital.get("/ui").text
    assert hospital.get(f"/ui/runs/{run_id}").status_code == 404


@pytest.mark.parametrize("content", [
    "not json", "[1, 2]", json.dumps({"rows": 3}),
    json.dumps({**cox_document(), "covariates": {"x": {"coef": "high"}}}),
    json.dumps({**cox_document(), "concordance": 1.5}),
])
def test_a_malformed_cox_json_gives_a_note_never_an_error(make_client: Callable[..., TestClient],
                                                          runs_dir: Path, content: str) -> None:
    folder = write_analysis(runs_dir / "cox", {"status": "finished", "mode": "cox"}, content)
    page = sign_in(make_client(), ADMIN_TOKEN).get(f"/ui/runs/{run_id_of(folder)}")
    assert page.status_code == 200
    [note] = re.findall(r'<p class="error" role="note">(.*?)</p>', page.text, re.S)
    assert note.startswith("The Cox model is not shown: cox.json") and str(runs_dir) not in note


def test_parse_cox_keeps_what_the_fit_could_not_estimate_as_missing() -> None:
    doc = cox_document()
    doc["covariates"]["gender_male"].update(se=float("nan"), p=float("nan"), z=float("inf"))
    fit, note = CoxDocument.checked(doc)
    assert fit is not None and note is None
    gender = fit.covariates["gender_male"]
    assert gender.se is None and gender.p is None and gender.z is None and gender.coef == 0.4260


def test_a_failed_or_running_analysis_says_so(make_client: Callable[..., TestClient],
                                              runs_dir: Path) -> None:
    failed = write_analysis(runs_dir / "cox", {"status": "failed", "mode": "cox",
                                               "error": "CollinearError: covariates are collinear"})
    running = write_analysis(runs_dir / "km", {"kind": "survival-km", "status": "running",
                                               "mode": "km", "started_at": 1_700_000_000.0})
    admin = sign_in(make_client(), ADMIN_TOKEN)
    page = admin.get(f"/ui/runs/{run_id_of(failed)}").text
    assert "CollinearError: covariates are collinear" in page and "the fit failed" in page
    page = admin.get(f"/ui/runs/{run_id_of(running)}").text
    assert "No <code>km.json</code> yet: the analysis is running" in page
    # a cox.json written later appears (the catalog re-reads a folder when cox.json changes)
    catalog = RunCatalog([runs_dir])
    assert {r.name: r.cox for r in catalog.runs()}["runs/cox"] is None
    (failed / "cox.json").write_text(json.dumps(cox_document()))
    stamp = (failed / "history.json").stat().st_mtime + 5
    os.utime(failed / "cox.json", (stamp, stamp))
    [cox] = [r for r in catalog.runs() if r.name == "runs/cox"]
    assert cox.cox is not None and cox.cox.doc is not None

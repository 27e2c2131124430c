"""The web view of survival runs: the C-index wherever other runs show accuracy, the pooled
Kaplan-Meier curve from ``km.json`` beside a run, ``fedsplit km`` / ``fedsplit cox`` folders,
malformed ``km.json`` files, and what a hospital's token sees of all of it."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from fedsplit.protocol.record.survival import KMDocument
from fedsplit.server.admin.ui.baselines import baseline_table
from fedsplit.server.admin.ui.curves import km_chart, primary_metric, run_charts
from fedsplit.server.admin.ui.runs import RunCatalog, load_run
from fedsplit.server.survival.km import apply_min_count

from tests.admin.conftest import ADMIN_TOKEN
from tests.ui.conftest import sign_in

SITES = ("northeast", "south", "west")
#: The model id `fedsplit simulate --task survival` records (a recipe id; selection: c_index).
COX_ID = ('recipe:{"input_shape":[39],"name":"cox","num_outputs":1,"params":{"event":"E",'
          '"hidden":[],"id_column":"pid","ignore":[],"penalizer":0.01,"time":"T"},'
          '"selection":"c_index","task":"survival","version":"1"}')
TEST_ROWS = {"northeast": 63, "south": 40, "west": 42}


def _scores(base: float) -> dict[str, Any]:
    per_site = {s: {"loss": 2.0 + i / 10, "c_index": round(base + i / 50, 4)}
                for i, s in enumerate(SITES)}
    return {"metrics": {"loss": 3.5, "c_index": base + 0.01}, "per_site": per_site,
            "mean_per_site": {k: float(np.mean([m[k] for m in per_site.values()]))
                              for k in ("loss", "c_index")}}


def write_survival_run(out: Path, *, rounds: int = 3) -> Path:
    """A `fedsplit simulate --task survival` out-dir in the layout the coordinator and simulate
    write (FLamby TCGA-BRCA, fedavg, as bench/flamby_tcga.py leaves it); returns the run folder."""
    fed = out / "federation"
    (fed / "models").mkdir(parents=True, exist_ok=True)
    history: dict[str, Any] = {
        "status": "finished", "model_id": COX_ID, "started_at": 1_790_000_000.0,
        "finished_at": 1_790_000_060.0,
        "config": {"num-server-rounds": rounds, "strategy": "fedavg", "strategy-params": "{}",
                   "task": "survival", "recipe": "cox", "keep": "last"},
        "selection": {"keep": "last", "metric": "c_index", "rounds_kept": rounds,
                      "val_score": 0.64, "val_metric": [
                          {"round": n, "score": 0.6 + n / 100, "examples": 174}
                          for n in range(1, rounds + 1)]},
        "rounds": [],
    }
    for n in range(1, rounds + 1):
        train = [{"site": s, "num_examples": 100 + 10 * i,
                  "metrics": {"num-examples": 100.0 + 10 * i, "train-loss": 2.0 - n / 10,
                              "on-gpu": 0.0},
                  "info": {"device": "cpu", "parallel-mode": "none"}}
                 for i, s in enumerate(SITES)]
        report = {"strategy": "fedavg", "params": {}, "num_examples": 330, "sites": [
            {"site": s, "num_examples": 100 + 10 * i, "weight": (100 + 10 * i) / 330,
             "excluded": False, "reason": None, "claimed_examples": None, "flags": [],
             "trimmed_fraction": None, "trimmed_most": False, "selected": None, "score": None,
             "l2_to_aggregate": 0.25} for i, s in enumerate(SITES)],
            "memory_budget": None, "working_bytes": None}
        evaluate = {"sites": [{"site": s, "num_examples": 30,
                               "metrics": {"num-examples": 30.0, "loss": 2.5,
                                           "c_index": 0.55 + i / 20 + n / 100}}
                              for i, s in enumerate(SITES)],
                    "metrics": {"c_index": 0.6 + n / 100, "loss": 2.5 - n / 10}}
        history["rounds"].append({"round": n, "train": {"sites": train, "metrics": {
            "train-loss": 2.0 - n / 10}}, "evaluate": evaluate, "aggregation": report,
            "model": f"models/round-{n:03d}.h5", "train_seconds": 0.5, "seconds": 0.7})
    (fed / "history.json").write_text(json.dumps(history))
    summary = {
        "task": "survival", "metric_names": ["loss", "c_index"], "selection_metric": "c_index",
        "strategy": "fedavg", "strategy_params": {}, "model_id": COX_ID, "sites": len(SITES),
        "site_names": list(SITES), "test_examples": sum(TEST_ROWS.values()),
        "test_examples_per_site": TEST_ROWS,
        "centralized": {"num_examples": 692, "steps": 180, "rounds_kept": 3, **_scores(0.84)},
        "local_only": [{"site": s, "num_examples": 100, "steps": 30, "rounds_kept": 2,
                        **_scores(0.7 + i / 100)} for i, s in enumerate(SITES)],
        "federated": {"num_examples": 330, "keep": "last", "rounds_kept": rounds,
                      "model": "federation/global.h5", **_scores(0.88)},
        "personalized": None,
        "rounds": [{"round": n, "metrics": {"loss": 3.6, "c_index": 0.87 + n / 1000},
                    "per_site": {}, "mean_per_site": {}} for n in range(1, rounds + 1)],
    }
    (out / "summary.json").write_text(json.dumps(summary))
    return fed


def km_document(min_count: int = 5, hospitals: tuple[str, ...] = SITES) -> dict[str, Any]:
    """A km.json as `fedsplit km` writes it: the pooled counts through the real minimum-count rule."""
    rng = np.random.default_rng(0)
    times = np.sort(rng.choice(np.arange(1, 4000), size=80, replace=False)).astype(float)
    events = rng.integers(0, 3, size=80)
    at_risk = 400 - np.concatenate([[0], np.cumsum(events + 2)[:-1]])
    curve = apply_min_count(times, at_risk, events, min_count).points().to_json()
    return {"hospitals": list(hospitals), "rows": 400, "events": int(events.sum()),
            "min_count": min_count, "curve": curve, "secure_aggregation": "off",
            "shared": "per hospital: its distinct event times ...", "wall_seconds": 20.3}


def write_km_analysis(folder: Path, doc: dict[str, Any] | None = None, *, mode: str = "km",
                      status: str = "finished") -> Path:
    """A `fedsplit km --out folder` (or `fedsplit cox`) folder: the status file and its output."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "history.json").write_text(json.dumps({"status": status, "mode": mode}))
    if doc is not None:
        (folder / "km.json").write_text(json.dumps(doc))
    return folder


def _run_ids(page: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r'href="/ui/runs/([0-9a-f]{12})"', page)))


def _svgs(page: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", page, re.S)]


# --- the C-index ---------------------------------------------------------------------------------
def test_survival_run_is_judged_by_the_c_index_in_curves_and_baselines(tmp_path: Path) -> None:
    """The recipe id's selection metric (c_index) drives the curves and the baseline table."""
    run = load_run("surv", write_survival_run(tmp_path / "surv"))
    assert run is not None and run.summary is not None
    assert primary_metric(run) == "c_index"
    charts = {c.title: c for c in run_charts(run)}
    glob = charts["Global C-index per round"]
    labels = [label for label, _, _ in glob.legend]
    assert labels[:2] == ["federated, held-out test split",
                          "federated evaluation on the hospitals' held-out rows"]
    assert "centralized (pooled data)" in labels and "south alone" in labels
    assert "Each hospital's C-index on its own held-out rows" in charts

    table = baseline_table(run.summary, "c_index")
    assert table is not None and table.columns == ["centralized", "alone", "federated"]
    rows = {r.label: r for r in table.rows}
    assert rows["south"].examples == 40
    assert rows["south"].cells == pytest.approx([0.86, 0.71 + 0.02, 0.9])  # per_site[south]
    assert rows["mean per hospital"].cells[2] == pytest.approx(0.9)
    assert rows["pooled test rows"].examples == 145
    assert rows["pooled test rows"].cells == [pytest.approx(0.85), None, pytest.approx(0.89)]
    # a hospital: its own row, no centralized column, no mean or pooled row
    own = baseline_table(run.summary, "c_index", {"west"})
    assert own is not None and own.columns == ["alone", "federated"]
    assert [r.label for r in own.rows] == ["west"]


def test_run_page_and_overview_show_the_c_index(make_client: Callable[..., TestClient],
                                                runs_dir: Path) -> None:
    write_survival_run(runs_dir / "surv")
    client = sign_in(make_client(), ADMIN_TOKEN)
    overview = client.get("/ui").text
    assert "C-index 0.873" in overview  # the last round's score on the test split
    [run_id] = _run_ids(overview)
    page = client.get(f"/ui/runs/{run_id}").text
    for text in ("Global C-index per round", "C-index (test split)", "C-index (federated eval)",
                 "Baselines per hospital", "Test C-index on each hospital's own test patients",
                 "south (40)", "pooled test rows (145)"):
        assert text in page, text
    assert "c_index" not in page.replace(COX_ID.replace('"', "&#34;"), "")
    assert "Kaplan-Meier" not in page  # no km.json beside it, but its live region is there:
    assert '<div id="run-results" data-live>' in page  # a km.json written later appears
    round_page = client.get(f"/ui/runs/{run_id}/rounds/2").text
    assert "C-index (held-out test split)" in round_page and "C-index (own rows)" in round_page


# --- the Kaplan-Meier curve beside a run -----------------------------------------------------------
def test_km_curve_beside_a_run_is_an_accessible_inline_svg(make_client: Callable[..., TestClient],
                                                           runs_dir: Path) -> None:
    doc = km_document()
    fed = write_survival_run(runs_dir / "surv")
    (fed / "km.json").write_text(json.dumps(doc))
    client = sign_in(make_client(), ADMIN_TOKEN)
    [run_id] = _run_ids(client.get("/ui").text)
    response = client.get(f"/ui/runs/{run_id}")
    assert response.status_code == 200
    page = response.text
    km = [s for s in _svgs(page) if "km" in s.get("class", "")]
    assert len(km) == 1
    svg = km[0]
    ns = "{http://www.w3.org/2000/svg}"
    assert svg.get("role") == "img"
    assert svg.get("aria-label", "").startswith("Kaplan-Meier: pooled survival of 400 patients")
    band = svg.find(f"{ns}polygon")
    assert band is not None and "band" in band.get("class", "")
    line = svg.find(f"{ns}polyline")
    points = line.get("points", "").split() if line is not None else []
    n = len(doc["curve"]["time"])
    assert len(points) == 1 + 2 * n  # (0, 1), then a horizontal and a vertical step per point
    ys = [float(p.split(",")[1]) for p in points]
    assert ys == sorted(ys)  # survival never rises: y in SVG only goes down the page
    dots = svg.findall(f"{ns}circle")
    assert len(dots) == n
    first = dots[0].findtext(f"{ns}title") or ""
    assert f"{doc['curve']['at_risk'][0]} at risk" in first and "95%" in first
    # stated under it: the rule, the totals; the points as a table; nothing fetched from elsewhere
    assert "Minimum-count rule, K = 5" in page and "each published point pools at least 5 events" in page
    assert f"The published points ({n})" in page
    assert f"{doc['events']} events" in page and "400 patients at northeast, south, west" in page
    assert not re.search(r'(src|href)="(https?:)?//', page)


def test_km_rule_off_and_empty_curve_are_said(make_client: Callable[..., TestClient],
                                              runs_dir: Path) -> None:
    write_km_analysis(runs_dir / "k1", km_document(min_count=1))
    empty = km_document()
    empty["curve"] = {k: [] for k in empty["curve"]}
    write_km_analysis(runs_dir / "k0", empty)
    client = sign_in(make_client(), ADMIN_TOKEN)
    pages = [client.get(f"/ui/runs/{i}").text for i in _run_ids(client.get("/ui").text)]
    assert any("Minimum-count rule off (K = 1)" in p for p in pages)
    assert any("no event time had at least 5 patients at risk" in p for p in pages)


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"rows": 10, "events": 2, "min_count": 5}),  # no curve
    json.dumps({**km_document(), "min_count": 0}),
    json.dumps({**km_document(), "curve": {**km_document()["curve"], "time": [1.0]}}),
    json.dumps({**km_document(), "curve": {**km_document()["curve"],
                                           "survival": [1.5] * len(km_document()["curve"]["time"])}}),
    json.dumps({**km_document(), "curve": {**km_document()["curve"],
                                           "time": list(reversed(km_document()["curve"]["time"]))}}),
])
def test_malformed_km_json_shows_a_note_never_a_500(make_client: Callable[..., TestClient],
                                                    runs_dir: Path, content: str) -> None:
    fed = write_survival_run(runs_dir / "surv")
    (fed / "km.json").write_text(content)
    folder = write_km_analysis(runs_dir / "km")
    (folder / "km.json").write_text(content)
    client = sign_in(make_client(), ADMIN_TOKEN)
    ids = _run_ids(client.get("/ui").text)
    assert len(ids) == 2  # both still listed
    for run_id in ids:
        response = client.get(f"/ui/runs/{run_id}")
        assert response.status_code == 200
        [note] = re.findall(r'<p class="error" role="note">(.*?)</p>', response.text, re.S)
        assert note.startswith("The Kaplan-Meier curve is not shown: km.json")
        assert "Received:" in note and str(runs_dir) not in note  # no path: hospitals read it too
        assert not [s for s in _svgs(response.text) if "km" in s.get("class", "")]


def test_parse_km_names_what_is_wrong(tmp_path: Path) -> None:
    assert KMDocument.checked(km_document())[0] is not None
    bad = km_document()
    bad["curve"]["at_risk"] = bad["curve"]["at_risk"][:-1]
    doc, note = KMDocument.checked(bad)
    assert doc is None and note is not None
    assert "one length" in note and "fedsplit km" in note
    run = load_run("surv", write_survival_run(tmp_path / "surv"))
    assert run is not None and run.km is None and km_chart(run) is None


def test_changed_km_json_is_read_again(tmp_path: Path) -> None:
    fed = write_survival_run(tmp_path / "surv")
    catalog = RunCatalog([tmp_path])
    [run] = catalog.runs()
    assert run.km is None
    (fed / "km.json").write_text(json.dumps(km_document()))
    stamp = (fed / "history.json").stat().st_mtime + 5
    os.utime(fed / "km.json", (stamp, stamp))
    [run] = catalog.runs()
    assert run.km is not None and run.km.doc is not None and run.km.doc.min_count == 5


# --- fedsplit km / cox folders ---------------------------------------------------------------------
def test_km_folder_is_listed_as_a_survival_analysis(make_client: Callable[..., TestClient],
                                                    runs_dir: Path) -> None:
    write_km_analysis(runs_dir / "km", km_document())
    write_km_analysis(runs_dir / "cox", mode="cox")
    client = sign_in(make_client(), ADMIN_TOKEN)
    overview = client.get("/ui").text
    assert "Kaplan-Meier curve (fedsplit km)" in overview and "Cox model (fedsplit cox)" in overview
    assert "started (?, ? rounds)" not in overview  # not a Flower run in the feed
    pages = {i: client.get(f"/ui/runs/{i}").text for i in _run_ids(overview)}
    km_page = next(p for p in pages.values() if "fedsplit km)" in p.split("<h2")[0])
    assert 'role="img"' in km_page and "Minimum-count rule, K = 5" in km_page
    assert "Rounds" not in km_page and "No metric recorded yet" not in km_page
    cox_page = next(p for p in pages.values() if "fedsplit cox)" in p.split("<h2")[0])
    assert "No <code>cox.json</code> yet" in cox_page and "Kaplan-Meier" not in cox_page.split("<h2")[1]


# --- what a hospital sees --------------------------------------------------------------------------
def test_hospital_sees_its_row_and_the_pooled_curve_only(make_client: Callable[..., TestClient],
                                                         runs_dir: Path,
                                                         site_token: Callable[..., str]) -> None:
    fed = write_survival_run(runs_dir / "surv")
    (fed / "km.json").write_text(json.dumps(km_document()))
    write_km_analysis(runs_dir / "km", km_document())
    write_km_analysis(runs_dir / "other-km", km_document(hospitals=("northeast", "west")))
    write_km_analysis(runs_dir / "cox", mode="cox")
    token = site_token("south")
    admin_ids = _run_ids(sign_in(make_client(), ADMIN_TOKEN).get("/ui").text)
    client = sign_in(make_client(), token)
    overview = client.get("/ui").text
    ids = _run_ids(overview)
    assert len(ids) == 2 and len(admin_ids) == 4  # the run and the km analysis it took part in
    for other in ("northeast", "west"):
        assert not re.search(rf"\b{other}\b", overview), other
    doc = km_document()
    for run_id in ids:
        page = client.get(f"/ui/runs/{run_id}").text
        assert 'class="chart km"' in page and "Minimum-count rule, K = 5" in page
        # the curve and band, never a pooled count (two hospitals: total less own = the other's)
        assert "shown to the coordinator only" in page and "At risk" not in page
        assert "400 patients" not in page and f"{doc['events']} events" not in page
        assert f"{doc['curve']['at_risk'][0]} at risk" not in page
        for other in ("northeast", "west", "centralized", "mean per hospital", "pooled test rows"):
            assert not re.search(rf"\b{other}\b", page), other
    for run_id in set(admin_ids) - set(ids):  # another federation's curve, the Cox folder
        assert client.get(f"/ui/runs/{run_id}").status_code == 404

"""``fedsplit cox`` and ``fedsplit km`` end to end in Flower's simulation engine (slow), checked
against lifelines on the pooled rows; and their bad-input refusals before Flower starts (fast)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.client.survival.tcga import load_tcga_brca
from fedsplit.orchestration.survival.run import run_survival
from fedsplit.protocol.record.survival import CoxDocument, KMDocument
from fedsplit.protocol.survival import SurvivalDataError, SurvivalRun
from lifelines import CoxPHFitter, KaplanMeierFitter
from typer.testing import CliRunner

from tests._helpers.survival import assert_km_is_lifelines

TIGHT = {"precision": 1e-12, "r_precision": 1e-14}


def write_sites(folder, seed=0, sizes=(70, 90, 60)):
    """Hospital tables as they come: text categories, yes/no flags, TRUE/FALSE events, ties."""
    rng = np.random.default_rng(seed)
    paths, frames = [], {}
    for k, n in enumerate(sizes):
        age = rng.normal(60, 10, n).round(1)
        stage = rng.choice(["I", "II", "III"], n, p=[0.4, 0.4, 0.2])
        smoker = rng.random(n) < 0.3
        risk = 0.04 * (age - 60) + (stage == "III") * 0.8 + smoker * 0.5
        t = np.ceil(rng.exponential(200 * np.exp(-risk)) / 10) * 10  # 10-day steps: ties
        e = rng.random(n) < 0.65
        frame = pd.DataFrame({"pid": [f"h{k}-{i}" for i in range(n)], "age": age, "stage": stage,
                              "smoker": np.where(smoker, "yes", "no"), "days": t + 5,
                              "died": np.where(e, "TRUE", "FALSE")})
        path = folder / f"hosp{k}.csv"
        frame.to_csv(path, index=False)
        paths.append(f"hosp{k}={path}")
        frames[f"hosp{k}"] = frame
    return paths, frames


def test_bad_tables_are_refused_before_flower_with_counts(tmp_path):
    paths, frames = write_sites(tmp_path)
    bad = frames["hosp1"].astype(str).copy()
    bad.loc[:2, "died"] = "maybe"
    bad.loc[5, "days"] = "unknown"
    bad.loc[6, "days"] = "-3"
    bad.to_csv(tmp_path / "hosp1.csv", index=False)
    run = SurvivalRun(mode="cox", time="days", event="died", out_dir="", id_column="pid")
    with pytest.raises(SurvivalDataError) as err:
        run_survival(run, CoxDocument, dataset=None, site_files=paths, out=tmp_path / "out")
    text = str(err.value)
    assert "hosp1: event column 'died' holds ['maybe'] in 3 row(s)" in text
    assert "hosp1: time column 'days' holds text in 1 row(s) (e.g. ['unknown'])" in text
    assert "hosp1: 1 row(s) have a time <= 0" in text and "hosp0" not in text
    assert not (tmp_path / "out" / "flower").exists()
    result = CliRunner().invoke(app, ["cox", "--site", paths[0], "--site", paths[1], "--time",
                                      "days", "--event", "died", "--out", str(tmp_path / "o2")])
    assert result.exit_code != 0
    with pytest.raises(Exception, match="secure-aggregation"):
        SurvivalRun(mode="cox", time="t", event="e", out_dir="", secure_aggregation="bound=x")


def pooled_encoded(frames):
    rows = []
    for k, f in enumerate(frames.values()):
        rows.append(pd.DataFrame({
            "age": f["age"].astype(float), "smoker": (f["smoker"] == "yes").astype(float),
            "stage=II": (f["stage"] == "II").astype(float),
            "stage=III": (f["stage"] == "III").astype(float),
            "T": f["days"].astype(float), "E": (f["died"] == "TRUE").astype(int), "h": k}))
    return pd.concat(rows, ignore_index=True)


@pytest.mark.slow
def test_secure_cox_on_site_tables_equals_lifelines(tmp_path):
    paths, frames = write_sites(tmp_path)
    run = SurvivalRun(mode="cox", time="days", event="died", out_dir="", id_column="pid",
                      penalizer=0.05, secure_aggregation="on")
    doc = run_survival(run, CoxDocument, dataset=None, site_files=paths, out=tmp_path / "out")
    ref = CoxPHFitter(penalizer=0.05).fit(pooled_encoded(frames), "T", "E", strata=["h"],
                                          fit_options=TIGHT)
    cov = doc.covariates
    assert list(cov) == ["age", "stage=II", "stage=III", "smoker"]  # stage=I: the reference
    assert doc.reference_categories == {"stage": "I"}
    names = list(ref.params_.index)
    coef = np.array([cov[n].coef for n in names])
    se = np.array([cov[n].se for n in names])
    np.testing.assert_allclose(coef, ref.params_.values, rtol=1e-5)
    np.testing.assert_allclose(se, ref.standard_errors_.values, rtol=1e-4)
    assert doc.concordance == pytest.approx(ref.concordance_index_, abs=1e-9)
    assert doc.newton_rounds <= 15
    assert doc.secure_aggregation.startswith("bound=") and doc.per_site.rows is None
    assert (tmp_path / "out" / "cox.png").stat().st_size > 5000


@pytest.mark.slow
def test_cox_cli_on_tcga_brca_equals_lifelines(tmp_path):
    out = tmp_path / "cox"
    result = CliRunner().invoke(app, ["cox", "--dataset", "tcga-brca", "--penalizer", "0.01",
                                      "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Newton" in result.output and "age_at_index" in result.output
    doc = CoxDocument.load(out / "cox.json")
    data = load_tcga_brca()
    names = [c for c in data["northeast"][0].columns if c not in ("pid", "T", "E")]
    pooled = pd.concat([tr[[*names, "T", "E"]].astype(float).assign(h=k)
                        for k, (tr, _) in enumerate(data.values())], ignore_index=True)
    ref = CoxPHFitter(penalizer=0.01).fit(pooled, "T", "E", strata=["h"], fit_options=TIGHT)
    coef = np.array([doc.covariates[n].coef for n in names])
    se = np.array([doc.covariates[n].se for n in names])
    np.testing.assert_allclose(coef, ref.params_.values, rtol=1e-5)
    np.testing.assert_allclose(se, ref.standard_errors_.values, rtol=1e-4)
    assert doc.rows == 866 and doc.newton_rounds <= 15
    assert doc.per_site.rows["northeast"] == 248
    assert doc.concordance == pytest.approx(ref.concordance_index_, abs=1e-9)


@pytest.mark.slow
def test_secure_km_on_site_tables_equals_lifelines(tmp_path):
    paths, frames = write_sites(tmp_path, seed=3)
    run = SurvivalRun(mode="km", time="days", event="died", out_dir="", min_count=1,
                      secure_aggregation="on")
    doc = run_survival(run, KMDocument, dataset=None, site_files=paths, out=tmp_path / "out")
    pooled = pooled_encoded(frames)
    curve = doc.curve
    assert_km_is_lifelines(pooled["T"], pooled["E"] == 1, curve.time, curve.survival,
                           curve.lower_95, curve.upper_95)
    assert doc.rows == len(pooled) and doc.events == int(pooled["E"].sum())
    assert (tmp_path / "out" / "km.png").stat().st_size > 5000
    # each hospital's own curve stays beside its own rows
    for i, frame in enumerate(frames.values()):
        own = json.loads((tmp_path / "out" / "sites" / f"site-{i}" / "km-own.json").read_text())
        mine = KaplanMeierFitter().fit(frame["days"], frame["died"] == "TRUE")
        np.testing.assert_allclose(own["survival"], mine.survival_function_.iloc[:, 0])


def test_km_and_cox_commands_check_their_arguments(tmp_path):
    paths, _ = write_sites(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["km", "--site", paths[0], "--site", paths[1]])
    assert result.exit_code != 0 and "--time COLUMN and --event COLUMN" in str(result.exception)
    result = runner.invoke(app, ["km", "--dataset", "tcga-brca", "--event", "died"])
    assert result.exit_code != 0 and "leave --event unset" in str(result.exception)
    result = runner.invoke(app, ["cox", "--site", paths[0], "--time", "days", "--event", "died"])
    assert result.exit_code != 0 and "at least 2 hospitals" in str(result.exception)
    result = runner.invoke(app, ["km", "--dataset", "tcga-brca", "--min-count", "0"])
    assert result.exit_code != 0

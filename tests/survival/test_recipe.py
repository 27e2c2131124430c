"""The survival recipe: its loss against lifelines' partial likelihood, its C-index against
lifelines, its data reading and refusals; one slow ``fedsplit simulate`` run with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from fedsplit.cli.app import app
from fedsplit.client.models import build_model
from fedsplit.client.recipes import ModelInputs, load_recipe
from fedsplit.client.survival.cox import efron_parts
from fedsplit.client.survival.recipe import Cox
from fedsplit.client.survival.tcga import load_tcga_brca
from fedsplit.protocol.schema import TableSettings, column_report, encode_frame, merge_reports
from lifelines.utils import concordance_index
from typer.testing import CliRunner

REF = "fedsplit.client.survival.recipe:Cox"


def model_for(recipe, p):
    return build_model(recipe.model_spec(ModelInputs("survival", (p,), 1)))


def test_loss_is_the_partial_likelihood_per_event_with_efron_ties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3))
    t = rng.integers(1, 8, 60).astype(float)  # heavy ties
    e = rng.random(60) < 0.6
    beta = np.array([0.4, -0.3, 0.2])
    recipe = load_recipe(REF)
    model = model_for(recipe, 3)
    risk = torch.tensor(x @ beta, dtype=torch.float64)
    loss = recipe.loss(model, risk, torch.tensor(np.c_[t, e], dtype=torch.float64))
    ref = efron_parts(x, t, e, beta).loglik  # equal to lifelines' (test_cox_math)
    assert float(loss) == pytest.approx(-ref / e.sum(), rel=1e-6)  # torchsurv computes in float32
    ridge = load_recipe(REF, {"penalizer": 0.1})
    model = model_for(ridge, 3)
    weight = next(m.weight for m in model.modules() if isinstance(m, torch.nn.Linear))
    penalized = ridge.loss(model, risk, torch.tensor(np.c_[t, e], dtype=torch.float64))
    extra = 0.1 * 60 / e.sum() * 0.5 * float((weight ** 2).sum())
    assert float(penalized) == pytest.approx(-ref / e.sum() + extra, rel=1e-6)
    none = recipe.loss(model, risk.requires_grad_(), torch.tensor(np.c_[t, 0 * e], dtype=torch.float64))
    assert float(none) == 0.0
    none.backward()  # a batch without an event: defined, and no gradient
    assert float(risk.grad.abs().sum()) == 0.0


def test_c_index_is_lifelines_on_rows_the_schema_encodes():
    train, _ = load_tcga_brca()["south"]
    settings = TableSettings(target="T", id_column="pid", event="E")
    schema = merge_reports([column_report("south", train, settings)], settings).schema
    x, y = encode_frame(schema, train, where="south")
    assert x.shape == (156, 39) and y.shape == (156, 2) and schema.task == "survival"
    recipe = load_recipe(REF)
    assert recipe.read_data(Path("south.csv")) is None  # tables: the schema path reads them
    model = model_for(recipe, 39)
    metrics = recipe.metrics(model, x, y, torch.device("cpu"))
    risk = recipe.predict(model, x)["risk"]
    assert metrics["c_index"] == pytest.approx(
        concordance_index(y[:, 0], -risk, y[:, 1]), abs=1e-12)
    assert recipe.metric_names("survival") == ("loss", "c_index", "auc")
    from torchsurv.metrics.auc import Auc
    from torchsurv.stats.ipcw import get_ipcw

    event, time = torch.as_tensor(y[:, 1] > 0.5), torch.as_tensor(y[:, 0], dtype=torch.float64)
    auc = Auc()
    auc(torch.as_tensor(risk, dtype=torch.float64), event, time, weight=get_ipcw(event, time))
    assert metrics["auc"] == pytest.approx(float(auc.integral()), abs=1e-9)
    # a risk that orders every event before the later times scores 1; no event: undefined, 0.5
    from fedsplit.client.survival.recipe import _time_auc

    t = np.arange(1.0, 41.0)
    e = (np.arange(40) % 2 == 0).astype(float)
    assert _time_auc(-t, t, e) == pytest.approx(1.0)
    assert _time_auc(-t, t, 0 * e) == 0.5
    assert recipe.selection_metric("survival") == "c_index" and not Cox.per_sample_loss
    with pytest.raises(Exception, match="refuses its parameters"):
        Cox({"hidden": [4], "unknown": 1})
    linear = model_for(recipe, 39)
    assert sum(isinstance(m, torch.nn.Linear) for m in linear.modules()) == 1
    mlp = model_for(load_recipe(REF, {"hidden": [16]}), 39)
    assert sum(isinstance(m, torch.nn.Linear) for m in mlp.modules()) == 2


def test_patient_level_dp_is_refused_with_the_reason(tmp_path):
    from fedsplit.client.privacy.agent import patient_dp, train_private
    from fedsplit.client.privacy.ledger import LedgerAccount
    from fedsplit.protocol.config import RunConfig

    recipe = load_recipe(REF)
    model = model_for(recipe, 3)
    cfg = RunConfig(dp="epsilon=5,delta=1e-3", recipe=REF)
    x = np.zeros((40, 3), np.float32)
    y = np.c_[np.arange(1, 41), np.ones(40)].astype(np.float32)
    with pytest.raises(Exception, match=r"must be a sum over patients.*per_sample_loss = False"):
        train_private(model, x, y, patient_dp(cfg), cfg, steps=10, server_round=1, seed=0,
                      proximal_mu=0.0, device=torch.device("cpu"),
                      account=LedgerAccount(tmp_path / "state", "a", tmp_path, "run", None))


@pytest.mark.slow
def test_simulate_survival_task_on_three_hospitals_tables_as_they_come(tmp_path):
    """``--task survival --time --event`` on NAME=TRAIN:TEST tables with their own quirks: a text
    covariate (one-hot by the agreed schema), one hospital writing its events as yes/no and
    another as TRUE/FALSE, columns in another order; under secure aggregation. Then the
    coordinator's summary: km.json as the plain sums give it, km.png, the Breslow baseline equal
    to one recomputed from what each hospital holds (all its rows: the linear model is the exact
    fit, `server.survival.exact`) and the kept model (to the fixed point's precision);
    ``predict`` scores new patients, with ``--times`` survival
    probabilities in (0, 1] falling with time, no ``--recipe`` needed."""
    from fedsplit.client.data import encode_table, read_table
    from fedsplit.client.models import load_model, recipe_of
    from fedsplit.client.survival.summary import baseline_vector
    from fedsplit.protocol import survival_summary as ss
    from fedsplit.protocol.schema import Schema
    from fedsplit.protocol.weights import read_schema
    from fedsplit.server.survival import km as kmm
    from fedsplit.server.survival.summary import publish_baseline

    data = load_tcga_brca()
    sites = []
    words = {"northeast": ("1", "0"), "south": ("yes", "no"), "west": ("TRUE", "FALSE")}
    for k, (region, (one, zero)) in enumerate(words.items()):
        for part, rows in zip(("train", "test"), data[region], strict=True):
            rows = rows.rename(columns={"T": "days", "E": "died"}).copy()
            rows["died"] = np.where(rows["died"].astype(float) > 0, one, zero)
            rows["clinic"] = np.where(np.arange(len(rows)) % 3 == 0, "surgery", "oncology")
            rows = rows[list(reversed(rows.columns))] if k == 1 else rows
            rows.to_csv(tmp_path / f"{region}_{part}.csv", index=False)
        sites += ["--site", f"{region}={tmp_path / f'{region}_train.csv'}:"
                            f"{tmp_path / f'{region}_test.csv'}"]
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "simulate", *sites, "--task", "survival", "--time", "days", "--event", "died",
        "--id-column", "pid", "--penalizer", "0.01", "--rounds", "2",
        "--secure-aggregation", "on", "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Test c_index on each hospital's own test patients" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "survival" and summary["selection_metric"] == "c_index"
    for model in ("centralized", "local_only", "federated"):
        assert summary[model] is not None, model
    fed = summary["federated"]
    assert set(fed["per_site"]) == {"northeast", "south", "west"}
    assert 0.6 < fed["mean_per_site"]["c_index"] <= 1.0
    assert all(0.0 <= s["c_index"] <= 1.0 and 0.0 <= s["auc"] <= 1.0
               for s in fed["per_site"].values())
    assert (out / "rounds.png").stat().st_size > 5000
    assert summary["schema"]["features"] == 39 + 2  # clinic=oncology, clinic=surgery

    # the summary after the last round, from secure sums
    fdir = out / "federation"
    assert summary["survival"]["km_plot"] == str(fdir / "km.png")
    assert (fdir / "km.png").stat().st_size > 5000
    km = json.loads((fdir / "km.json").read_text())
    assert km["min_count"] == 5 and sorted(km["hospitals"]) == sorted(words)
    assert km["secure_aggregation"].startswith("bound=")
    base = ss.Baseline.load(fdir / "global.baseline.json")
    base.check_model(fdir / "global.h5", "test")
    assert list(base.times) == km["curve"]["time"]
    schema = Schema.from_json(read_schema(fdir / "global.h5"))
    model = load_model(fdir / "global.h5")
    held = []
    # each hospital's folder (beside them, the simulation's roster.json)
    for folder in sorted(p for p in (out / "sites").iterdir() if p.is_dir()):  # its rows, as held:
        # all of them, as the exact linear Cox fit used them (no validation rows held out)
        frame = read_table(next(folder.glob("*.csv")))
        held.append(encode_table(schema, frame, source="t"))
    x = np.concatenate([d.x for d in held])
    y = np.concatenate([d.y for d in held]).astype(np.float64)
    t, e = y[:, 0], y[:, 1] > 0.5
    assert km["rows"] == len(t)
    grid = np.unique(t[e])
    sums = baseline_vector(t, e, recipe_of(model).predict(model, x)["risk"], grid)
    at_risk = np.array([(t >= g).sum() for g in grid])
    n = len(grid)
    assert km["curve"] == kmm.apply_min_count(grid, at_risk, sums[:n], 5).points().to_json()
    times, hazard = publish_baseline(grid, at_risk, sums[:n], sums[:n], sums[n:], 5)
    np.testing.assert_allclose(base.times, times)
    np.testing.assert_allclose(base.cumulative_hazard, hazard, rtol=1e-8)

    # predict: one log relative hazard per patient, ids from the ID column, survival at times
    test = tmp_path / "west_test.csv"
    pred = tmp_path / "pred.csv"
    result = CliRunner().invoke(app, [
        "predict", str(test), "--model", str(fdir / "global.h5"), "-o", str(pred),
        "--times", "365,1000,3000"])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(pred)
    assert "risk" in frame.columns and len(frame) == len(data["west"][1])
    probs = frame[["survival_at_365", "survival_at_1000", "survival_at_3000"]].to_numpy()
    assert np.all((probs > 0) & (probs <= 1)) and np.all(np.diff(probs, axis=1) <= 0)
    assert probs[:, 2].min() < 0.99


def test_simulate_refuses_patient_dp_with_the_cox_recipe_before_flower_starts(tmp_path):
    """Experiment (what `fedsplit simulate` builds first) refuses it: no process is started and
    no run folder written; hospital-level DP stays allowed (it noises the aggregate)."""
    from fedsplit.orchestration.experiment import Experiment
    from fedsplit.protocol.config import RunConfig
    from fedsplit.protocol.errors import ConfigError

    cfg = RunConfig(dp="epsilon=5,delta=1e-3", recipe=REF)
    with pytest.raises(ConfigError, match=r"sum over patients.*level=hospital"):
        Experiment(cfg=cfg, out=tmp_path / "run", dataset="breast-cancer", num_sites=2)
    assert not (tmp_path / "run").exists()
    hospital = RunConfig(dp="epsilon=5,delta=1e-3,level=hospital", recipe=REF)
    Experiment(cfg=hospital, out=tmp_path / "run2", dataset="breast-cancer", num_sites=2)

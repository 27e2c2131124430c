"""Federated vs centralized vs lifelines' pooled Cox fit, over seeds (issue 35).

    python bench/survival_seeds.py [--seeds 0,1,2] [--datasets multicentre,tcga-brca] [--rounds 10]
    python bench/survival_seeds.py --hidden 32 [--server-opt adam --server-lr 0.03]   # deep model

For each dataset and seed, one `fedsplit simulate --task survival` run (the default linear Cox
model: the exact federated Newton fit, `server.survival.exact`), and, measured in the same run
on the same hospitals' training rows and test patients:

- lifelines ``CoxPHFitter(penalizer=0.01)`` on the pooled training rows (unstratified: the
  "pooled Cox fit") and stratified by hospital (the model `fedsplit cox` fits);
- the C-index (Harrell's, lifelines) on each hospital's test patients, mean per hospital;
- the federated coefficients (``federation/cox.json``) against lifelines' stratified fit run to
  its maximum: the largest relative difference;
- the integrated Brier score on the pooled test patients (torchsurv, IPCW weights), from the
  run's Breslow baseline (``global.baseline.json``) for the federated model and from lifelines'
  own baseline for the pooled fit, on the same time grid (10%-80% quantiles of the test times,
  up to the federated baseline's last published time).

``--hidden 32`` (any ``--hidden``) trains the MLP risk model instead, by rounds of local steps
(each hospital's local steps on its whole risk sets: `client.train.step_batch_size`); there is
no coefficient to compare (``coef_rel_diff`` NaN) and ``rounds`` counts training rounds.

Printed: one row per dataset and seed, then the means and the ratios federated / lifelines
pooled and federated / centralized. Datasets: ``multicentre`` (generated here, fixed seed 35:
5 centres, ~820 patients, censoring, a text covariate and centre-specific baseline hazards; a
test fifth is cut per seed) and ``tcga-brca`` (FLamby's regions and split, which no seed
changes: the exact fit is then the same in every seed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

PENALIZER = 0.01
CENTRES = {"leeds": 210, "porto": 180, "lyon": 150, "graz": 130, "turku": 150}


def multicentre(folder: Path, seed: int = 35) -> list[str]:
    """Generated multi-centre survival tables (``NAME=PATH`` per centre)."""
    rng = np.random.default_rng(seed)
    sites = []
    for k, (name, n) in enumerate(CENTRES.items()):
        age = rng.normal(62 + 2 * k, 12, n)
        albumin = rng.normal(3.8 - 0.1 * k, 0.5, n)
        diabetes = rng.choice(["yes", "no"], n, p=[0.35 + 0.05 * k, 0.65 - 0.05 * k])
        sex = rng.choice(["female", "male"], n)
        bmi = rng.normal(27, 4, n)
        risk = (0.03 * (age - 62) - 0.6 * (albumin - 3.8) + 0.4 * (diabetes == "yes")
                + 0.1 * (sex == "male") + 0.0 * bmi)
        scale = 900 * np.exp(-0.25 * k)  # each centre its own baseline hazard
        days = np.ceil(scale * rng.weibull(1.3, n) * np.exp(-risk / 1.3))
        censor = rng.uniform(200, 1500, n)
        frame = pd.DataFrame({"pid": [f"{name}-{i}" for i in range(n)], "age": age.round(1),
                              "albumin": albumin.round(2), "diabetes": diabetes, "sex": sex,
                              "bmi": bmi.round(1), "days": np.minimum(days, censor.round()) + 1,
                              "died": (days <= censor).astype(int)})
        path = folder / f"{name}.csv"
        frame.to_csv(path, index=False)
        sites.append(f"{name}={path}")
    return sites


def encoded(tables: list[Any], cfg: Any) -> tuple[list[str], dict[str, tuple[pd.DataFrame, pd.DataFrame]]]:
    """Covariate names and per hospital (train, test) frames of the Cox covariates + T/E."""
    from fedsplit.client.data import encode_table
    from fedsplit.protocol import survival as sv
    from fedsplit.protocol.schema import column_report, merge_reports

    settings = cfg.table_settings
    schema = merge_reports([column_report(t.name, t.train, settings) for t in tables], settings,
                           task="survival").schema
    names, keep, _ = sv.cox_columns(schema)
    out = {}
    for t in tables:
        parts = []
        for rows in (t.train, t.test):
            data = encode_table(schema, rows, source=t.name)
            frame = pd.DataFrame(np.asarray(data.x, float)[:, keep], columns=names)
            frame["T"], frame["E"] = data.y[:, 0], data.y[:, 1]
            parts.append(frame)
        out[t.name] = (parts[0], parts[1])
    return names, out


def concordance(model: Any, frame: pd.DataFrame) -> float:
    from lifelines.utils import concordance_index

    return float(concordance_index(frame["T"], -model.predict_log_partial_hazard(frame), frame["E"]))


def integrated_brier(survival: np.ndarray, test: pd.DataFrame, times: np.ndarray) -> float:
    """torchsurv's integrated Brier score with IPCW weights (survival: patients x times)."""
    import warnings

    import torch
    from torchsurv.metrics.brier_score import BrierScore
    from torchsurv.stats.ipcw import get_ipcw

    event = torch.as_tensor(test["E"].to_numpy() > 0.5)
    time_ = torch.as_tensor(test["T"].to_numpy(), dtype=torch.float64)
    grid = torch.as_tensor(times, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        brier = BrierScore()
        brier(torch.as_tensor(survival, dtype=torch.float64), event, time_, new_time=grid,
              weight=get_ipcw(event, time_), weight_new_time=get_ipcw(event, time_, grid))
        return float(brier.integral())


def one_run(dataset: str, sites: list[str], seed: int, rounds: int, out: Path,
            hidden: str = "none", server_opt: str = "none", server_lr: float = 0.0,
            lr: float = 0.01) -> dict[str, Any]:
    from fedsplit.client.models import load_model, recipe_of
    from fedsplit.orchestration.datasets import table_keys
    from fedsplit.orchestration.experiment import Experiment, prepare_tables, run_simulation
    from fedsplit.protocol import survival_summary as ss
    from fedsplit.protocol.config import RunConfig
    from fedsplit.protocol.record.common import HISTORY_FILE
    from fedsplit.protocol.record.horizontal import RunRecord
    from fedsplit.protocol.record.survival import COX_FILE, CoxDocument
    from lifelines import CoxPHFitter

    keys = (table_keys("tcga-brca", hidden=hidden) if dataset == "tcga-brca" else
            table_keys(None, time="days", event="died", id_column="pid", task="survival",
                       penalizer=PENALIZER, hidden=hidden))
    cfg = RunConfig.from_flower(dict(num_server_rounds=rounds, seed=seed, server_opt=server_opt,
                                     server_lr=server_lr, lr=lr, **keys))
    exp = Experiment(cfg=cfg, out=out, dataset="tcga-brca" if dataset == "tcga-brca" else None,
                     site_files=[] if dataset == "tcga-brca" else sites)
    started = time.monotonic()
    summary = run_simulation(exp)
    seconds = time.monotonic() - started
    names, frames = encoded(prepare_tables(exp), cfg)
    pooled = pd.concat([tr.assign(site=n) for n, (tr, _) in frames.items()], ignore_index=True)
    precise = {"precision": 1e-12, "r_precision": 1e-14}
    plain = CoxPHFitter(penalizer=PENALIZER).fit(pooled.drop(columns="site"), "T", "E")
    strata = CoxPHFitter(penalizer=PENALIZER).fit(pooled, "T", "E", strata=["site"],
                                                  fit_options=precise)
    rel = float("nan")  # the exact path's coefficients (cox.json); an MLP has none
    if (out / "federation" / "cox.json").exists():
        cox = CoxDocument.load(out / "federation" / COX_FILE).covariates
        fed_coef = np.array([cox[n].coef for n in names])
        ref = strata.params_[names].to_numpy()
        rel = float(np.max(np.abs(fed_coef - ref) / np.maximum(np.abs(ref), 1e-8)))
    tests = {n: te for n, (_, te) in frames.items()}
    lifelines_mean = float(np.mean([concordance(plain, te) for te in tests.values()]))
    # integrated Brier score on the pooled test patients
    test = pd.concat(tests.values(), ignore_index=True)
    model = load_model(out / "federation" / "global.h5")
    baseline = ss.Baseline.load(ss.baseline_path(out / "federation" / "global.h5"))
    raw = pd.concat([t.test for t in prepare_tables(exp)], ignore_index=True)
    from fedsplit.client.data import encode_table
    from fedsplit.protocol.schema import Schema
    from fedsplit.protocol.weights import read_schema

    x = encode_table(Schema.from_json(read_schema(out / "federation" / "global.h5")), raw,
                     source="test patients").x
    risk = recipe_of(model).predict(model, x)["risk"]
    times = np.quantile(test["T"], np.linspace(0.1, 0.8, 20))
    times = np.unique(times[times <= baseline.times[-1]])
    fed_ibs = integrated_brier(baseline.survival(risk, times), test, times)
    ll_surv = plain.predict_survival_function(test[names], times=times).to_numpy().T
    ll_ibs = integrated_brier(ll_surv, test, times)
    assert summary.federated is not None and summary.centralized is not None
    fed = summary.federated.mean_per_site["c_index"]
    central = summary.centralized.mean_per_site["c_index"]
    return {"dataset": dataset, "seed": seed, "hidden": hidden, "server_opt": server_opt, "lr": lr,
            "federated": fed, "centralized": central,
            "lifelines_pooled": lifelines_mean, "coef_rel_diff": rel,
            "federated_round": summary.federated.rounds_kept,
            # the last round's model (FLamby's protocol keeps it), beside the kept one
            "federated_last": summary.rounds[-1].mean_per_site["c_index"],
            "rounds": len(RunRecord.load(out / "federation" / HISTORY_FILE).rounds),
            "ibs_federated": fed_ibs, "ibs_lifelines": ll_ibs, "seconds": seconds,
            "train_rows": len(pooled), "test_rows": len(test)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--datasets", default="multicentre,tcga-brca")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--hidden", default="none", help="the risk model: none (linear Cox, "
                        "the exact fit) or MLP widths, e.g. 32 or 64-32 (local steps)")
    parser.add_argument("--server-opt", default="none", help="none, adam, yogi, ...")
    parser.add_argument("--server-lr", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=0.01, help="local Adam learning rate")
    parser.add_argument("--json", type=Path, default=None, help="Also write the rows here.")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sites = multicentre(work)
        for dataset in args.datasets.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                row = one_run(dataset, sites, seed, args.rounds, work / f"{dataset}-{seed}",
                              args.hidden, args.server_opt, args.server_lr, args.lr)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    for dataset, part in table.groupby("dataset", sort=False):
        fed, central, ll = part["federated"].mean(), part["centralized"].mean(), part[
            "lifelines_pooled"].mean()
        print(f"{dataset}: mean over seeds federated {fed:.4f}, centralized {central:.4f}, "
              f"lifelines pooled {ll:.4f}; federated / lifelines {fed / ll:.4f}, federated / "
              f"centralized {fed / central:.4f}; spread of federated over seeds "
              f"{part['federated'].max() - part['federated'].min():.4f}; coefficients vs "
              f"lifelines stratified: max relative difference {part['coef_rel_diff'].max():.2e}; "
              f"integrated Brier federated {part['ibs_federated'].mean():.4f} vs lifelines "
              f"pooled {part['ibs_lifelines'].mean():.4f} (ratio "
              f"{part['ibs_federated'].mean() / part['ibs_lifelines'].mean():.4f})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

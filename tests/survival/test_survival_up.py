"""`fedsplit up --task survival --time T --event E` with three hospitals on their own CSV files:
the local federation fits the linear Cox model exactly (`server.survival.exact`), ends with
each hospital's C-index, ``km.json`` / ``km.png`` and the Breslow baseline, and its
coefficients are lifelines' stratified fit on the same rows (the slow test runs one real
federation of processes on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.orchestration.flower_runtime import flower_env
from fedsplit.orchestration.survival_summary import UpDataset, up_dataset
from lifelines import CoxPHFitter

from tests._helpers.processes import run_up_process


def write_hospitals(folder: Path, seed: int = 0) -> dict[str, Path]:
    """Three hospitals, censored follow-up in days, a text covariate, shifted baselines."""
    rng = np.random.default_rng(seed)
    files = {}
    for k, (name, n) in enumerate((("north", 120), ("south", 90), ("east", 70))):
        age = rng.normal(60, 10, n)
        ward = rng.choice(["icu", "surgery", "medicine"], n)
        risk = 0.04 * (age - 60) + np.where(ward == "icu", 0.7, 0.0) + 0.3 * k
        days = np.ceil(rng.exponential(400 * np.exp(-risk)))
        censor = rng.uniform(100, 900, n)
        frame = pd.DataFrame({"pid": np.arange(n) + 1000 * k, "age": age, "ward": ward,
                              "days": np.minimum(days, censor) + 1,
                              "died": np.where(days <= censor, "yes", "no")})
        files[name] = folder / f"{name}.csv"
        frame.to_csv(files[name], index=False)
    return files


def test_tcga_brca_is_a_dataset_of_up() -> None:
    assert up_dataset("tcga-brca", None) == UpDataset(dataset="tcga-brca", sites=6)
    assert up_dataset("tcga-brca", ["a=x.csv"]) == UpDataset()  # --site tables come with their columns
    assert up_dataset("breast-cancer", None) == UpDataset()


@pytest.mark.slow
def test_up_survival_fits_the_exact_cox_model_and_writes_the_summary(tmp_path: Path) -> None:
    files = write_hospitals(tmp_path)
    env = flower_env(tmp_path / "cli-home")
    env["PATH"] = os.pathsep.join(["/usr/bin", "/bin"])
    work = tmp_path / "work"
    args = [arg for name, path in files.items() for arg in ("--site", f"{name}={path}")]
    args += ["--task", "survival", "--time", "days", "--event", "died", "--id-column", "pid",
             "--penalizer", "0.01", "--rounds", "1", "--round-timeout", "120", "--no-admin",
             "--work", str(work)]
    started = time.monotonic()
    code = run_up_process(args, tmp_path / "up.log", env, 480)
    printed = (tmp_path / "up.log").read_text()
    assert code == 0, printed[-3000:]
    out = work / "out"
    for name in files:  # each hospital's C-index of the kept model, printed
        assert any(line.startswith(f"{name}: C-index ") for line in printed.splitlines()), printed
    assert "all hospitals (summed pairs): C-index" in printed
    km = json.loads((out / "km.json").read_text())
    pooled = pd.concat([pd.read_csv(p).assign(site=n) for n, p in files.items()], ignore_index=True)
    assert km["rows"] == len(pooled) and km["events"] == int((pooled["died"] == "yes").sum())
    assert (out / "km.png").is_file() and (out / "global.baseline.json").is_file()
    # the coefficients: lifelines' stratified fit on all of each hospital's rows
    cox = json.loads((out / "cox.json").read_text())["covariates"]
    frame = pd.get_dummies(pooled.drop(columns="pid").assign(died=pooled["died"] == "yes"),
                           columns=["ward"], drop_first=True, dtype=float)
    ref = CoxPHFitter(penalizer=0.01).fit(frame, "days", "died", strata=["site"],
                                          fit_options={"precision": 1e-12, "r_precision": 1e-14})
    mine = np.array([cox[name]["coef"] for name in ("age", "ward=medicine", "ward=surgery")])
    np.testing.assert_allclose(mine, ref.params_[["age", "ward_medicine", "ward_surgery"]],
                               rtol=1e-6)
    print(f"fedsplit up --task survival (3 hospitals, exact Cox): {time.monotonic() - started:.0f} s")

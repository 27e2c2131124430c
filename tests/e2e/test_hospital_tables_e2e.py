"""Four real hospitals' raw tables through `fedsplit simulate --site`, per-hospital scores,
a server optimizer, personalization, and `fedsplit predict` on a raw file: end to end with Flower."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.client.data import load_heart_disease
from fedsplit.protocol.schema import Schema

NAMES = ["cleveland", "hungary", "switzerland", "va"]


@pytest.mark.slow
def test_raw_heart_disease_files_train_with_a_server_optimizer_and_predict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Text, TRUE/FALSE, empty cells and '?' go in as exported; summary.json carries per_site and
    mean_per_site for every model, the fine-tuned models included; the saved model scores a raw
    file."""
    # Prepare: one raw CSV per hospital; VA writes '?' for missing, columns in another order
    args = []
    for name, frame in load_heart_disease().items():
        if name == "va":
            frame = frame.replace("", "?")[list(reversed(frame.columns))]
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        args += ["--site", f"{name}={tmp_path / name}.csv"]
    out = tmp_path / "run"
    # Execute
    code = run_guarded(app, ["simulate", *args, "--target", "disease", "--id-column", "id",
                             "--rounds", "2", "--server-opt", "adam", "--local-steps", "5",
                             "--personalize", "alone", "--out", str(out)])
    # Assert
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["site_names"] == NAMES
    tuned = summary["personalized"]
    for entry in [summary["federated"], summary["centralized"], *summary["local_only"], tuned]:
        assert sorted(entry["per_site"]) == NAMES
        assert set(entry["mean_per_site"]) >= {"accuracy", "loss"}
        assert 0.0 <= entry["mean_per_site"]["accuracy"] <= 1.0
    assert summary["steps_per_round"] == dict.fromkeys(NAMES, 5)
    assert summary["centralized"]["steps"] == 2 * 4 * 5
    assert [s["steps"] for s in summary["local_only"]] == [10] * 4
    # each baseline keeps its best round by validation accuracy, ties to the later round
    for entry in [summary["centralized"], *summary["local_only"]]:
        scores = entry["val_metric"]
        assert len(scores) == 2 and entry["val_examples"] >= 1
        assert entry["rounds_kept"] == max(r for r in (1, 2) if scores[r - 1] == max(scores))
    # personalization ('alone'): each hospital's own fine-tuned copy, for its alone budget
    assert tuned["steps"] == "alone"
    assert tuned["steps_per_site"] == {s["site"]: s["steps"] for s in summary["local_only"]}
    assert tuned["num_examples"] == summary["federated"]["num_examples"]
    assert tuned["fine_tune_examples"] == {s["site"]: s["num_examples"] for s in summary["local_only"]}
    assert any(tuned["per_site"][n]["loss"] != summary["federated"]["per_site"][n]["loss"]
               for n in NAMES)
    printed = "".join(capsys.readouterr().out.split())  # rich wraps lines at the console width
    assert ("federated+fine-tuned:eachhospital'sownfine-tunedcopyoftheglobalmodel(asmany"
            "mini-batchesasalone:cleveland10,hungary10,switzerland10,va10)") in printed
    assert (out / "rounds.png").stat().st_size > 0
    assert any("constant at switzerland" in w for w in summary["schema"]["warnings"])
    assert sorted(summary["rounds"][-1]["per_site"]) == NAMES
    history = json.loads((out / "federation" / "history.json").read_text())
    assert history["schema"]["format"] == "fedsplit.schema"
    assert [r["server_opt"]["step"] for r in history["rounds"]] == [1, 2]
    # derived inputs that carry nothing (set only by categories withheld as rare) are left out
    # of a classification schema too, with one warning per source column
    assert any("'sex:missing'" in w and "left out" in w for w in summary["schema"]["warnings"])
    assert "sex:missing" not in Schema.from_json(history["schema"]).feature_names
    assert {s["site"] for s in history["rounds"][0]["evaluate"]["sites"]} == set(NAMES)
    # predict on a hospital's raw rows
    code = run_guarded(app, ["predict", "--model", str(out / "federation" / "global.h5"),
                             str(tmp_path / "va.csv"), "-o", str(tmp_path / "pred.csv")])
    assert code == 0
    pred = pd.read_csv(tmp_path / "pred.csv")
    assert len(pred) == 200 and list(pred.columns) == ["id", "p_0", "p_1", "predicted"]

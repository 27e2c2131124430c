"""One real Flower run of the vertical app (simulation engine), then predict with its models."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration.vertical.predict import predict_rows
from fedsplit.protocol.vertical.wire import ALLOWED, ALLOWED_CONFIG


@pytest.mark.slow
def test_vertical_simulate_with_flower_then_predict(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = run_guarded(app, ["vertical", "simulate", "--out", str(out), "--dataset", "breast-cancer",
                             "--sites", "2", "--rounds", "2", "--steps", "8", "--fill", "nearest"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"task", "centralized", "local_only", "federated", "rounds"} <= set(summary)
    assert (out / "rounds.png").stat().st_size > 0
    assert [o["share_of_labels"] for o in summary["overlap"]] == [1.0, 1.0]
    assert len(summary["rounds"]) == 2 and summary["rounds"][-1]["steps"] == 16
    assert summary["federated"]["metrics"]["accuracy"] > 0.85
    # what crossed Flower's network, per message type and direction
    for key, entry in summary["inventory"].items():
        message_type, direction = key.split(" ")
        reply = direction == "from-site"
        assert set(entry["arrays"]) <= ALLOWED[message_type][reply]
        assert set(entry["config"]) <= ALLOWED_CONFIG[message_type][reply]
    assert summary["inventory"]["train.step from-site"]["arrays"] == {
        "embeddings": {"dtype": "float32", "width": [16]}}
    assert set(summary["inventory"]["train.step to-site"]["arrays"]) == {
        "positions", "grad-positions", "gradients"}

    data = out / "data"
    result = predict_rows(out, [data / "site-0.csv", data / "site-1.csv"], "patient_id",
                          data / "labels.csv", "target")
    assert len(result.frame) == 569 and result.skipped == 0
    assert result.metrics is not None and result.metrics["accuracy"] > 0.85
    assert set(pd.unique(result.frame["prediction"].astype(str))) <= {"0", "1"}

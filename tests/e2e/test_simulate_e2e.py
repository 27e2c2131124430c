"""A real Flower simulation of three hospitals, end to end through the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli.app import app
from cli.errors import run_guarded
from protocol import read_weights
from protocol.errors import AggregationError


@pytest.mark.slow
def test_simulate_breast_cancer_three_sites(tmp_path: Path) -> None:
    """`fedsplit simulate` trains with Flower and writes the documented summary and plot."""
    out = tmp_path / "run"
    code = run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--sites", "3",
                             "--rounds", "3", "--out", str(out), "--seed", "1"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "classification"
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    assert len(summary["local_only"]) == 3
    assert {s["site"] for s in summary["local_only"]} == {"site-0", "site-1", "site-2"}
    assert summary["centralized"]["metrics"]["accuracy"] > 0.9
    assert summary["federated"]["metrics"]["accuracy"] > 0.9
    assert (out / "rounds.png").stat().st_size > 10_000
    model = read_weights(out / "federation" / "global.h5")
    assert model.round == 3 and model.num_examples == summary["centralized"]["num_examples"]
    assert summary["federated"]["num_examples"] == model.num_examples
    # Each hospital's folder holds only its own rows, and history records every site per round
    history = json.loads((out / "federation" / "history.json").read_text())
    assert history["status"] == "finished"
    sites = {s["site"] for r in history["rounds"] for s in r["train"]["sites"]}
    assert sites == {"site-0", "site-1", "site-2"}
    infos = [s["info"] for r in history["rounds"] for s in r["train"]["sites"]]
    assert all(i["device"] == "cpu" and i["parallel-mode"] == "none" for i in infos)
    # No Flower process outlives the run
    leftover = subprocess.run(["pgrep", "-f", str(out / "flower")], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_simulate_refuses_bad_arguments(tmp_path: Path, capsys) -> None:
    """Bad inputs fail fast with a message that says how to fix them."""
    assert run_guarded(app, ["simulate", "--out", str(tmp_path)]) == 2
    assert "either --dataset NAME" in capsys.readouterr().err
    assert run_guarded(app, ["simulate", "--dataset", "mnist", "--out", str(tmp_path)]) == 2
    assert "Unknown dataset" in capsys.readouterr().err
    assert run_guarded(app, ["simulate", "--dataset", "digits", "--strategy", "fedmagic",
                             "--out", str(tmp_path)]) == AggregationError.exit_code
    assert "No aggregation strategy is called 'fedmagic'" in capsys.readouterr().err
    assert run_guarded(app, ["simulate", "--dataset", "digits", "--partition", "dirichlet:-1",
                             "--out", str(tmp_path)]) == 2
    assert "ALPHA > 0" in capsys.readouterr().err

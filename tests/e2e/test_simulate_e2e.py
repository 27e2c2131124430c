"""A real Flower simulation of three hospitals, end to end through the CLI."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration.experiment import Experiment, stage_sites
from fedsplit.protocol import read_weights
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import AggregationError, ResumeMismatchError


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
    assert run_guarded(app, ["simulate", "--dataset", "wine", "--norm", "layer", "--out", str(tmp_path)]) == 2
    assert "--norm is none or batch" in capsys.readouterr().err
    assert run_guarded(app, ["simulate", "--dataset", "digits", "--norm", "batch",
                             "--out", str(tmp_path / "cnn")]) == 2
    assert "the cnn, which has none" in capsys.readouterr().err
    assert not (tmp_path / "cnn" / "flower").exists()
    for bad in ("ten", "-3"):
        assert run_guarded(app, ["simulate", "--dataset", "wine", "--personalize", bad,
                                 "--out", str(tmp_path / "ft")]) == 2
        assert re.search(r"'alone'.*or 'prior'.*Received: '" + bad, capsys.readouterr().err)
    assert not (tmp_path / "ft" / "flower").exists()


def _interrupted_run(out: Path, exp: Experiment) -> None:
    """What `simulate` leaves in ``out`` when interrupted after round 1: its sites, a history
    and a global model in OUT/federation (its config as the coordinator records it: the
    roster's names and fingerprints inline)."""
    cfg, _, _ = stage_sites(exp)
    (out / "federation").mkdir(parents=True)
    (out / "federation" / "history.json").write_text(json.dumps({
        "status": "running", "config": cfg.with_roster().to_flower(), "model_id": "mlp:x",
        "rounds": [{"round": 1, "train": {}}]}))
    (out / "federation" / "global.h5").write_bytes(b"")


def _refused(err: str, code: int, change: str, out: Path) -> None:
    assert code == ResumeMismatchError.exit_code, err
    assert "ResumeMismatchError" in err and "trained on other site data" in err
    assert re.search(change, err), err
    assert "--no-resume" in err and "differs too" not in err  # only the data differs
    assert not (out / "flower").exists()  # refused before Flower started


def test_simulate_refuses_to_resume_on_another_partition(tmp_path: Path, capsys) -> None:
    """`simulate --out X` interrupted, re-run with --partition dirichlet:0.5: refused, naming rows."""
    # Prepare: an interrupted `simulate --dataset breast-cancer --sites 3` (iid, seed 0)
    out = tmp_path / "run"
    _interrupted_run(out, Experiment(cfg=RunConfig(num_server_rounds=10), out=out,
                                     dataset="breast-cancer", num_sites=3))

    # Execute: the same command with another partition
    code = run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--sites", "3",
                             "--partition", "dirichlet:0.5", "--out", str(out)])

    # Assert
    _refused(capsys.readouterr().err, code, r"site-\d: rows \d+ -> \d+", out)


def test_simulate_refuses_to_resume_on_an_edited_site_file(tmp_path: Path, capsys,
                                                           rng: np.random.Generator) -> None:
    """Same --site files, one edited in place (same rows and columns): refused, naming the content."""
    # Prepare: two hospitals' files and an interrupted run on them
    files = [tmp_path / "h1.csv", tmp_path / "h2.csv"]
    for path in files:
        pd.DataFrame({"a": rng.normal(size=40), "b": rng.normal(size=40),
                      "target": rng.integers(0, 2, 40)}).to_csv(path, index=False)
    out = tmp_path / "run"
    _interrupted_run(out, Experiment(cfg=RunConfig(num_server_rounds=10), out=out, site_files=files,
                                     num_sites=2))
    frame = pd.read_csv(files[1])
    frame["a"] += 1.0
    frame.to_csv(files[1], index=False)

    # Execute
    code = run_guarded(app, ["simulate", "--site", str(files[0]), "--site", str(files[1]),
                             "--out", str(out)])

    # Assert: only h2 (hospitals are named after their files) changed, and only its content
    err = capsys.readouterr().err
    _refused(err, code, r"h2: content changed \(sha256 [0-9a-f]{12} -> [0-9a-f]{12}\)", out)
    assert "h1" not in err.split("Received:")[1]

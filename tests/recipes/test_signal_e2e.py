"""End to end (issue 31): a hospital's own model with BatchNorm and a frozen layer (the signal
recipe of docs/recipes.md, worked example 3, imported through PYTHONPATH) in `fedsplit simulate`,
with and without secure aggregation, then `fedsplit predict` on an unlabelled file; and the same
recipe's mistakes: a training step that raises at every hospital, or at one hospital only. Each
either succeeds or exits non-zero with one line naming the hospital and the cause."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

Cli = Callable[..., subprocess.CompletedProcess]  # the `fedsplit` fixture (conftest.py)
RECIPE = "signal_bn:SignalNet"
MISTAKES = '''"""The signal recipe with a training step that raises: at every hospital, or only on one
hospital's inputs (its device's offset puts them out of the range the step accepts)."""

from signal_bn import SignalNet


class RaiseAll(SignalNet):
    def train_step(self, model, xb, yb, optimizers, penalty):
        raise ValueError("my step is broken")


class RaiseEast(SignalNet):
    def train_step(self, model, xb, yb, optimizers, penalty):
        if float(xb.mean()) > 0.85:
            raise ValueError("inputs out of the device's range")
        return super().train_step(model, xb, yb, optimizers, penalty)
'''


def sites(files: dict[str, Path]) -> list[str]:
    return [a for name in ("north", "south", "east") for a in ("--site", f"{name}={files[name]}")]


def one_line(done: subprocess.CompletedProcess) -> str:
    """The command's error: exactly one line on stderr, no traceback."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_batchnorm_recipe_federates_plain_and_secure_then_predicts(
        fedsplit: Cli, recipe_dir: Path, signal_hospitals: dict[str, Path], tmp_path: Path) -> None:
    """Secure aggregation runs a BatchNorm model and lands within 0.02 of the plain run; the
    frozen layer never moves and the counters never travel."""
    scores = {}
    for mode in ("plain", "secure"):
        out = tmp_path / mode
        extra = ["--secure-aggregation", "on"] if mode == "secure" else []
        done = fedsplit(["simulate", *sites(signal_hospitals), "--recipe", RECIPE, "--rounds", "3",
                         "--out", str(out), *extra], recipe_dir)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        scores[mode] = summary["federated"]["mean_per_site"]["balanced-accuracy"]
        assert summary["failures"] == []
        history = json.loads((out / "federation" / "history.json").read_text())
        assert "0.weight" not in history["federated"]  # the frozen Conv1d
        assert not any(n.endswith("num_batches_tracked") for n in history["federated"])
        assert {"1.running_var", "6.running_var"} <= set(history["federated"])
        assert all(not s.get("excluded") for r in history["rounds"] for s in r["train"]["sites"])
    assert scores["plain"] > 0.8
    assert abs(scores["secure"] - scores["plain"]) <= 0.02, scores
    model = tmp_path / "plain" / "federation" / "global.h5"
    predictions = tmp_path / "predictions.csv"
    done = fedsplit(["predict", str(signal_hospitals["unlabelled"]), "--model", str(model),
                     "--recipe", RECIPE, "-o", str(predictions)], recipe_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(predictions)
    assert len(table) == 40 and list(table.columns) == ["input", *[f"p_{k}" for k in range(5)],
                                                        "predicted"]


@pytest.mark.slow
def test_a_training_step_that_raises_is_named_per_hospital(
        fedsplit: Cli, recipe_dir: Path, signal_hospitals: dict[str, Path], tmp_path: Path) -> None:
    """At every hospital: no model, exit 14 (NoTrainingError), each hospital's line, history
    failed. At one hospital: the others' model and summary are written, then exit 13 naming it."""
    (recipe_dir / "signal_mistakes.py").write_text(MISTAKES)
    out = tmp_path / "all"
    done = fedsplit(["simulate", *sites(signal_hospitals), "--recipe", "signal_mistakes:RaiseAll",
                     "--rounds", "2", "--out", str(out)], recipe_dir)
    assert done.returncode == 14, done.stdout[-2000:] + done.stderr[-2000:]
    line = one_line(done)
    assert line.startswith("NoTrainingError: The federation trained no model: 0 of 2 round(s)")
    for name in ("north", "south", "east"):
        assert (f"hospital {name}, training: ValueError: my step is broken (at "
                f"signal_mistakes.py:9 in train_step)") in line
    assert "node-" not in line and "global model" not in done.stdout
    history = json.loads((out / "federation" / "history.json").read_text())
    assert history["status"] == "failed" and "NoTrainingError" in history["error"]
    assert not (out / "federation" / "global.h5").exists()

    out = tmp_path / "east"
    done = fedsplit(["simulate", *sites(signal_hospitals), "--recipe", "signal_mistakes:RaiseEast",
                     "--rounds", "2", "--out", str(out)], recipe_dir)
    assert done.returncode == 13, done.stdout[-2000:] + done.stderr[-2000:]
    line = one_line(done)
    assert line.startswith("HospitalFailure: hospital east, training: ValueError: inputs out of "
                           "the device's range (at signal_mistakes.py:15 in train_step) (in every "
                           "round: the federation trained without it)"), line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"][0].startswith("hospital east, training:")
    assert set(summary["federated"]["per_site"]) == {"north", "south", "east"}  # scored for all
    assert (out / "federation" / "global.h5").exists()

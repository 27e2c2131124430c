"""A new task kind is one file (toy_task.py) and runs through ``fedsplit simulate`` end to end:
Flower's simulation engine, the coordinator and the hospitals find it by its entry point, train
the built-in MLP on it and record its own metric, which keeps the round."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import tasks
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError

HERE = Path(__file__).resolve().parent


@pytest.fixture
def toy_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tasks.TaskKind]:
    """toy_task.py importable here and, through PYTHONPATH, in every Flower process, which find
    it as an installed package names it: a ``fedsplit.tasks`` entry point (a dist-info folder).
    The kind is registered in this process for the test only."""
    plugins = tmp_path / "plugins"
    info = plugins / "fedsplit_toy_task-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedsplit-toy-task\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{tasks.ENTRY_POINT_GROUP}]\ncount = toy_task\n")
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(plugins), str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(tasks, "_KINDS", dict(tasks._KINDS))  # restored after the test
    yield importlib.import_module("toy_task").COUNT
    sys.modules.pop("toy_task", None)


def test_an_unregistered_task_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "No task kind is named 'segmentation'. Registered: classification, regression, "
            "survival")):
        RunConfig.from_flower({"task": "segmentation"})


def _count_sites(folder: Path, sites: int = 3, rows: int = 90) -> list[Path]:
    """Hospital tables whose target ``visits`` is a Poisson count driven by two features."""
    rng = np.random.default_rng(7)
    paths = []
    for k in range(sites):
        x = rng.normal(size=(rows, 3))
        visits = rng.poisson(np.exp(0.8 + 0.6 * x[:, 0] - 0.4 * x[:, 1]))
        frame = pd.DataFrame({"age": x[:, 0], "bmi": x[:, 1], "noise": x[:, 2], "visits": visits})
        paths.append(folder / f"hospital-{k}.csv")
        frame.to_csv(paths[-1], index=False)
    return paths


@pytest.mark.slow
def test_a_toy_task_kind_runs_through_simulate(tmp_path: Path, toy_kind: tasks.TaskKind) -> None:
    assert tasks.task_kind("count") is toy_kind and "count" in tasks.task_names()
    out = tmp_path / "run"
    sites = [arg for path in _count_sites(tmp_path) for arg in ("--site", str(path))]
    code = run_guarded(app, ["simulate", *sites, "--target", "visits", "--task", "count",
                             "--rounds", "2", "--local-steps", "10", "--seed", "1",
                             "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "count" and summary["selection_metric"] == "within_one"
    assert summary["metric_names"] == ["loss", "within_one", "mae"]
    for entry in (summary["federated"], summary["centralized"], *summary["local_only"]):
        assert 0.0 <= entry["metrics"]["within_one"] <= 1.0 and entry["metrics"]["mae"] >= 0
    record = json.loads((out / "federation" / "history.json").read_text())
    assert record["status"] == "finished" and record["selection"]["metric"] == "within_one"
    for entry in record["rounds"]:  # each round's evaluation, as the hospitals computed it
        assert {"within_one", "mae"} <= set(entry["evaluate"]["metrics"])

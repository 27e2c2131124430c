"""A model with BatchNorm federated through a real Flower simulation, end to end through the CLI.

BatchNorm brings a 0-d int64 buffer (``num_batches_tracked``): it stays at each hospital (a
counter: averaging it means nothing) while the running statistics travel; the global model keeps
the counter as the initial model set it, 0-d float64 in the weight file.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import read_weights


@pytest.mark.slow
def test_simulate_batchnorm_mlp_two_sites(tmp_path: Path) -> None:
    """norm=batch: every round's global model moves (running statistics included), its BatchNorm
    counter does not travel, nothing excluded."""
    out = tmp_path / "run"
    code = run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--sites", "2",
                             "--rounds", "3", "--norm", "batch", "--out", str(out)])
    assert code == 0
    history = json.loads((out / "federation" / "history.json").read_text())
    assert history["status"] == "finished"
    assert history["model_id"].endswith("/batch")
    for entry in history["rounds"]:
        assert "error" not in entry, entry["error"]
        sites = entry["train"]["sites"]
        assert len(sites) == 2 and not any(s.get("excluded") for s in sites), sites
        assert not any(s["excluded"] for s in entry["aggregation"]["sites"])
    models = [read_weights(out / "federation" / "models" / f"round-{r:03d}.h5") for r in (1, 2, 3)]
    counters = [m.arrays["body.1.num_batches_tracked"] for m in models]
    assert all(c.shape == () and c.dtype == np.float64 for c in counters)
    assert [float(c) for c in counters] == [0.0, 0.0, 0.0]  # counted at each hospital only
    assert "body.1.num_batches_tracked" not in history["federated"]
    for name in ("body.0.weight", "body.1.weight", "body.1.running_mean", "body.1.running_var"):
        for before, after in pairwise(models):
            assert not np.array_equal(before.arrays[name], after.arrays[name]), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["federated"]["metrics"]["accuracy"] > 0.85

"""A model with BatchNorm federated through a real Flower simulation, end to end through the CLI.

BatchNorm brings a 0-d int64 buffer (``num_batches_tracked``): it must travel as float64 in every
message and keep its 0-d shape, or every reply from round 2 on is excluded as a layout mismatch.
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
    """norm=batch: every round's global model moves, its BatchNorm counter grows, nothing excluded."""
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
    assert 0 < float(counters[0]) < float(counters[1]) < float(counters[2])
    for name in ("body.0.weight", "body.1.weight", "body.1.running_mean", "body.1.running_var"):
        for before, after in pairwise(models):
            assert not np.array_equal(before.arrays[name], after.arrays[name]), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["federated"]["metrics"]["accuracy"] > 0.85

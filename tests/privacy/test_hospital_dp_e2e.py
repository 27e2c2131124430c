"""Hospital-level DP (`--dp level=hospital`) on a real Flower run: the coordinator clips and
noises count-weighted FedAvg, every hospital's spent epsilon is recorded and stays within the
budget, and the noised global model differs from plain FedAvg's on the same seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol.weights import read_weights


def _simulate(out: Path, *extra: str) -> dict:
    code = run_guarded(app, ["simulate", "--dataset", "heart-disease", "--out", str(out),
                             "--rounds", "2", "--hidden", "none", "--lr", "0.05", *extra])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_hospital_level_dp_runs_end_to_end_within_its_budget(tmp_path: Path) -> None:
    noised = _simulate(tmp_path / "dp", "--dp", "level=hospital,epsilon=4,delta=1e-3,clip=1")
    assert "privacy" not in _simulate(tmp_path / "plain")
    privacy = noised["privacy"]
    assert privacy["level"] == "hospital" and privacy["epsilon_budget"] == 4.0
    assert sorted(privacy["per_site"]) == ["cleveland", "hungary", "switzerland", "va"]
    for site in privacy["per_site"].values():
        assert 0 < site["epsilon"] <= 4.0 and site["round"] == 2
    assert "auc" in privacy["audit"]["headline"]
    a = read_weights(tmp_path / "dp" / "federation" / "global.h5")
    b = read_weights(tmp_path / "plain" / "federation" / "global.h5")
    assert set(a.arrays) == set(b.arrays)
    assert any(not np.allclose(a.arrays[k], b.arrays[k]) for k in a.arrays)

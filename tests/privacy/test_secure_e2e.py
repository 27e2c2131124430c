"""Secure aggregation in real Flower simulations, through `fedsplit simulate`.

The slow tests run the Message-API SecAgg+ rounds end to end: the aggregate equals plain
FedAvg's on the same seed within the documented quantisation error, and a hospital that drops
out after the key exchange (its update leaves the declared range, so it refuses to send it)
does not stop the round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol import read_weights
from fedsplit.protocol.errors import ConfigError


def _simulate(out: Path, *extra: str) -> dict:
    code = run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--out", str(out),
                             "--seed", "1", *extra])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_secure_fedavg_equals_plain_within_quantisation(tmp_path: Path) -> None:
    args = ("--sites", "3", "--rounds", "2")
    plain = _simulate(tmp_path / "plain", *args)
    secure = _simulate(tmp_path / "secure", *args, "--secure-aggregation", "bound=1.0")
    step = 2 * 1.0 / (1 << 20)  # documented bound per coordinate and round: 2B / L
    a = read_weights(tmp_path / "plain" / "federation" / "models" / "round-001.h5")
    b = read_weights(tmp_path / "secure" / "federation" / "models" / "round-001.h5")
    # Same training, one secure sum: within one quantisation step of plain FedAvg, plus plain
    # FedAvg's own float32 rounding (documented: 2 ulp of the value; relative, so it matters for
    # large parameters such as the standardisation buffers, where one ulp of ~650 is 6.1e-5).
    excess = max(float(np.max(np.abs(a.arrays[k].astype(np.float64) - b.arrays[k].astype(np.float64))
                              - 2 * np.spacing(np.abs(a.arrays[k]).astype(np.float32))))
                 for k in a.arrays)
    assert excess < step
    assert b.num_examples == a.num_examples  # the total count, decoded from the masked sum
    for key in ("accuracy",):
        assert abs(secure["federated"]["mean_per_site"][key]
                   - plain["federated"]["mean_per_site"][key]) <= 0.02
    history = json.loads((tmp_path / "secure" / "federation" / "history.json").read_text())
    assert history["status"] == "finished"
    for entry in history["rounds"]:
        details = entry["aggregation"]["details"]["secure_aggregation"]
        assert details["hospitals"] == 3 and details["dropped"] == 0
        # the coordinator never saw a single hospital's count
        assert all("num_examples" not in s and s.get("secure") for s in entry["train"]["sites"])
    # each round's evaluation is recorded as in the plain run (it rides on the masked train
    # reply): the same hospitals and validation rows, scores of nearly the same model
    before = json.loads((tmp_path / "plain" / "federation" / "history.json").read_text())
    for mine, theirs in zip(history["rounds"], before["rounds"], strict=True):
        sites = {s["site"]: s for s in mine["evaluate"]["sites"]}
        plain_sites = {s["site"]: s for s in theirs["evaluate"]["sites"]}
        assert sites.keys() == plain_sites.keys() and len(sites) == 3
        for name, site in sites.items():
            assert not site.get("excluded") and site["num_examples"] == plain_sites[name][
                "num_examples"]
            assert site["metrics"].keys() == plain_sites[name]["metrics"].keys()
        assert mine["evaluate"]["metrics"].keys() == theirs["evaluate"]["metrics"].keys()
        assert abs(mine["evaluate"]["metrics"]["accuracy"]
                   - theirs["evaluate"]["metrics"]["accuracy"]) <= 0.02


@pytest.mark.slow
def test_a_hospital_dropping_out_mid_round_does_not_stop_it(tmp_path: Path) -> None:
    # site-3 holds the most rows, trains 3 epochs and moves a weight by more than 0.12: after
    # the key exchange it refuses to send its update (out of range) and so drops out of the sum.
    summary = _simulate(tmp_path / "run", "--sites", "4", "--partition", "sizes:50,50,50,300",
                        "--local-epochs", "3", "--rounds", "2",
                        "--secure-aggregation", "bound=0.12")
    history = json.loads((tmp_path / "run" / "federation" / "history.json").read_text())
    assert history["status"] == "finished"
    for entry in history["rounds"]:
        details = entry["aggregation"]["details"]["secure_aggregation"]
        assert details == {**details, "hospitals": 3, "dropped": 1, "share_num": 4,
                           "threshold": 2}
        refused = [s for s in entry["train"]["sites"] if s.get("excluded")]
        assert len(refused) == 1 and "outside the secure aggregation range" in refused[0]["reason"]
    assert summary["federated"]["mean_per_site"]["accuracy"] > 0.85


@pytest.mark.slow
def test_geometric_median_runs_under_secure_aggregation(tmp_path: Path) -> None:
    summary = _simulate(tmp_path / "run", "--sites", "3", "--rounds", "2",
                        "--strategy", "geometric-median", "--secure-aggregation", "on")
    history = json.loads((tmp_path / "run" / "federation" / "history.json").read_text())
    assert history["status"] == "finished"
    for entry in history["rounds"]:
        steps = entry["aggregation"]["details"]["weiszfeld"]
        assert steps["steps"] >= 1 and steps["stopped"] in ("converged", "max_iter")
        assert steps["objectives"][-1] <= steps["objectives"][0]  # Weiszfeld lowers g
    assert summary["federated"]["mean_per_site"]["accuracy"] > 0.9


@pytest.mark.parametrize("strategy", ["median", "trimmed-mean", "krum"])
def test_simulate_refuses_robust_rules_under_secure_aggregation(tmp_path: Path, capsys,
                                                                strategy: str) -> None:
    code = run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--out", str(tmp_path),
                             "--strategy", strategy, "--secure-aggregation", "on"])
    assert code == ConfigError.exit_code
    err = capsys.readouterr().err
    assert "cannot run with secure aggregation" in err and "masked sum" in err
    assert "fedavg" in err

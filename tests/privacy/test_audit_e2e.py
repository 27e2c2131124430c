"""The leakage audit on a real Flower run: `simulate --dp` audits at the end, and
`privacy-audit RUN_DIR` re-audits (a run without DP is audited the same way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol.errors import ConfigError


@pytest.mark.slow
def test_simulate_with_dp_writes_the_audit_and_privacy_audit_reruns_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = run_guarded(app, ["simulate", "--dataset", "heart-disease", "--out", str(out),
                             "--rounds", "2", "--hidden", "none", "--lr", "0.05",
                             "--dp", "epsilon=4,delta=1e-3"])
    assert code == 0
    audit = json.loads((out / "summary.json").read_text())["privacy"]["audit"]
    result = json.loads((out / "privacy.json").read_text())
    assert (out / "privacy-roc.png").stat().st_size > 0
    names = ["cleveland", "hungary", "switzerland", "va"]
    assert list(result["per_site"]) == list(audit["per_site"]) == names
    fed = result["federation"]
    assert fed["members"] == sum(s["members"] for s in result["per_site"].values())
    assert fed["non_members"] == sum(s["non_members"] for s in result["per_site"].values())
    assert result["headline"] == audit["headline"] == {
        "scope": "federation", "auc": fed["auc"], "ci95": fed["ci95"], "attack": fed["attack"]}
    for group in [fed, *result["per_site"].values()]:
        low, high = group["ci95"]
        assert 0 <= low <= group["auc"] <= high <= 1
        assert group["attack"] in ("loss-threshold", "calibrated")
    assert audit["per_site"]["va"]["auc"] == result["per_site"]["va"]["auc"]

    capsys.readouterr()
    assert run_guarded(app, ["privacy-audit", str(out), "--references", "4"]) == 0
    printed = capsys.readouterr().out
    assert "federation" in printed and "membership AUC (federation" in printed
    again = json.loads((out / "privacy.json").read_text())
    assert again["references"] == 4 and list(again["per_site"]) == names
    # same rows, same global model: the loss-threshold attack is unchanged
    assert (again["federation"]["attacks"]["loss-threshold"]["auc"]
            == fed["attacks"]["loss-threshold"]["auc"])
    assert run_guarded(app, ["privacy-audit", str(out), "--references", "3"]) == ConfigError.exit_code

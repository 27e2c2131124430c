"""``fedsplit compare-strategies`` and ``simulate --attack``: argument checks and a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--strategies", "fedavg,fedavg"], 2, "distinct strategy names"),
        (["--strategies", "fedavg,bogus"], 5, "No aggregation strategy is called 'bogus'"),
        (["--param", "beta=0.3"], 2, "STRATEGY:key=value"),
        (["--strategies", "trimmed-mean", "--param", "trimmed-mean:beta=0.7"], 5, "beta"),
        (["--attack", "scale:10"], 2, "go together"),
        (["--attack", "scale", "--attackers", "1"], 2, "needs a value"),
        (["--attack", "nan", "--attackers", "5"], 2, "at least one site must stay honest"),
    ],
)
def test_bad_arguments_fail_before_any_run(tmp_path: Path, capsys, args, code, message) -> None:
    """Every mistake is caught up front, with the fix in the message."""
    assert run_guarded(app, ["compare-strategies", "--out", str(tmp_path), *args]) == code
    assert message in capsys.readouterr().err
    assert not (tmp_path / "comparison.json").exists()


@pytest.mark.slow
def test_nan_site_is_excluded_and_the_run_finishes(tmp_path: Path) -> None:
    """A hospital sending NaN weights every round is excluded, not fatal, under each rule."""
    out = tmp_path / "cmp"
    code = run_guarded(app, ["compare-strategies", "--dataset", "breast-cancer", "--sites", "3",
                             "--attackers", "1", "--attack", "nan", "--strategies", "fedavg,median",
                             "--rounds", "2", "--no-clean", "--out", str(out)])
    assert code == 0
    comparison = json.loads((out / "comparison.json").read_text())
    assert set(comparison["runs"]) == {"fedavg under nan x1", "median under nan x1"}
    assert comparison["hostile_sites"] == ["site-2"]
    for run in comparison["runs"].values():
        assert run["final"] > 0.85
    history = json.loads((out / "fedavg-under-nan-x1" / "federation" / "history.json").read_text())
    for entry in history["rounds"]:
        sites = {s["site"]: s for s in entry["train"]["sites"]}
        assert sites["site-2"]["excluded"] and "NaN/Inf" in sites["site-2"]["reason"]
        assert not sites["site-0"].get("excluded") and not sites["site-1"].get("excluded")
        assert entry["aggregation"]["num_examples"] == sum(
            s["num_examples"] for s in entry["train"]["sites"] if not s.get("excluded"))
    summary = json.loads((out / "fedavg-under-nan-x1" / "summary.json").read_text())
    honest = [s["num_examples"] for s in summary["local_only"] if s["site"] != "site-2"]
    assert summary["federated"]["num_examples"] == sum(honest)  # the NaN site's rows do not count
    assert (out / "comparison.png").stat().st_size > 10_000

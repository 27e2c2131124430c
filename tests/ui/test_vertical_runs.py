"""The web view lists and shows vertical runs (issue 34, item 3): the coordinator's
``history.json`` read through `protocol.record.vertical.VerticalRunRecord` (files written before its
``kind`` included), with the kept round and the fused / centralized / per-site scores."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.kinds import load_run_record, run_kind
from fedsplit.protocol.record.vertical import VerticalRound, VerticalRunRecord, VerticalSelection
from fedsplit.server.admin.ui.runs import load_run, run_id_of

from tests.admin.conftest import ADMIN_TOKEN
from tests.ui.conftest import sign_in

# a history.json as server/vertical/app.py wrote it before issue 34 (no "kind"; val_metric a
# list of numbers, which RunRecord refuses)
OLD_HISTORY: dict[str, Any] = {
    "status": "finished",
    "config": {"num-server-rounds": 3, "fusion-params": "{}", "site-files": "[]", "keep": "best-val"},
    "rounds": [
        {"round": r, "train_loss": 0.9 - 0.1 * r, "steps": 10 * r, "seconds": 0.5,
         "metrics": {"accuracy": acc, "auc": acc + 0.05}, "num_examples": 40,
         "val_metrics": {"accuracy": val}, "val_examples": 20}
        for r, acc, val in ((1, 0.61, 0.6), (2, 0.72, 0.8), (3, 0.70, 0.7))
    ],
    "started_at": 1_700_000_000.0, "finished_at": 1_700_000_100.0,
    "overlap": [{"site": "site-0", "overlap": 180}], "psi_seconds": 0.4, "task": "binary",
    "train_rows": 120, "test_rows": 40, "val_rows": 20, "input_widths": {"site-0": 4, "site-1": 6},
    "selection": {"keep": "best-val", "metric": "accuracy", "rounds_kept": 2, "val_score": 0.8,
                  "val_metric": [0.6, 0.8, None]},
    "site_models": ["a", "b"], "last_site_models": ["c", "d"],
    "inventory": {"train.step up": {"arrays": {}, "config": []}}, "messages": 60,
}
SUMMARY: dict[str, Any] = {
    "task": "binary", "sites": 2, "keep": "best-val",
    "federated": {"metrics": {"accuracy": 0.72, "auc": 0.77}, "num_examples": 40, "rounds_kept": 2},
    "centralized": {"metrics": {"accuracy": 0.745, "auc": 0.8}, "rounds_kept": 3},
    "local_only": [{"site": "site-0", "metrics": {"accuracy": 0.5125}, "rounds_kept": 1},
                   {"site": "site-1", "metrics": {"accuracy": 0.6375}, "rounds_kept": 2}],
}


def _write_run(folder: Path, history: dict[str, Any], summary: dict[str, Any] | None) -> Path:
    (folder / "federation").mkdir(parents=True)
    (folder / "federation" / "history.json").write_text(json.dumps(history))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder / "federation"


def test_an_old_vertical_history_loads_as_a_vertical_record_and_not_as_a_horizontal_one(tmp_path) -> None:
    path = _write_run(tmp_path / "v", OLD_HISTORY, None) / "history.json"
    assert run_kind(OLD_HISTORY) == "vertical"
    record = load_run_record(path)
    assert isinstance(record, VerticalRunRecord)
    kept = record.kept_round()
    assert kept is not None and kept.round == 2 and kept.metrics["accuracy"] == 0.72
    assert record.to_json() == OLD_HISTORY  # read and written back unchanged
    assert run_kind({"status": "running", "config": {"strategy": "fedavg"}, "rounds": []}) == "horizontal"
    assert run_kind({"status": "finished", "mode": "km"}) == "survival-km"
    assert isinstance(load_run_record(_write_run(tmp_path / "h", {"status": "running", "rounds": []},
                                                 None) / "history.json"), RunRecord)


def test_the_vertical_writer_saves_the_kind_through_the_model(tmp_path) -> None:
    record = VerticalRunRecord(kind="vertical", status="running", config={}, rounds=[])
    record.rounds.append(VerticalRound.model_validate(OLD_HISTORY["rounds"][0]))
    record.selection = VerticalSelection(keep="last", metric="accuracy", rounds_kept=1)
    record.save(tmp_path / "history.json")
    data = json.loads((tmp_path / "history.json").read_text())
    assert data["kind"] == "vertical" and run_kind(data) == "vertical"
    assert data["rounds"][0] == OLD_HISTORY["rounds"][0]


def test_the_view_lists_and_shows_a_vertical_run(runs_dir: Path,
                                                 make_client: Callable[..., TestClient]) -> None:
    folder = _write_run(runs_dir / "vertical-heart", OLD_HISTORY, SUMMARY)
    run = load_run("vertical-heart/federation", folder)
    assert run is not None and run.kind == "vertical" and run.vertical is not None
    assert [label for label, _ in run.vertical.comparison] == [
        "Fused (federation)", "Centralized (all columns pooled)", "site-0 alone", "site-1 alone"]
    admin = sign_in(make_client(), ADMIN_TOKEN)
    overview = admin.get("/ui").text
    run_id = run_id_of(folder)
    assert f"/ui/runs/{run_id}" in overview and "vertical fusion" in overview and "3 / 3" in overview
    page = admin.get(f"/ui/runs/{run_id}")
    assert page.status_code == 200
    html = page.text
    assert "Vertical run" in html and "Round 2 (best-val" in html
    for shown in ("0.745", "0.5125", "0.6375", "Centralized (all columns pooled)", "site-1 alone"):
        assert shown in html, shown
    assert html.count('tag-kept') == 1  # the kept round is marked, once


def test_a_hospital_does_not_see_a_vertical_run(runs_dir: Path, make_client: Callable[..., TestClient],
                                                site_token: Callable[..., str]) -> None:
    folder = _write_run(runs_dir / "v", OLD_HISTORY, SUMMARY)
    site = sign_in(make_client(), site_token("site-0"))
    assert site.get(f"/ui/runs/{run_id_of(folder)}").status_code == 404

"""The run record (protocol.record): files written before the models existed load and write back
unchanged, privacy is recorded through a method, bad records are refused with what is wrong.

``data/history-v1*.json`` and ``data/summary-v1*.json`` were written by ``fedsplit simulate``
(breast-cancer, 2 sites, 2 rounds; ``-dp``: ``--dp epsilon=5,delta=1e-5``, patient level) with
the code before protocol/record/ existed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.horizontal_wire import DP_EPSILON
from fedsplit.protocol.record.horizontal import RoundEntry, RunRecord, SiteEntry
from fedsplit.protocol.record.summary import RunSummary, privacy_section
from fedsplit.protocol.update import Update
from fedsplit.protocol.weights import write_weights
from fedsplit.server.history import RunHistory, find_resume_point

DATA = Path(__file__).parent / "data"


def raw(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


@pytest.mark.parametrize("name", ["history-v1.json", "history-v1-dp.json"])
def test_v1_history_loads_and_writes_back_byte_for_byte(name: str, tmp_path: Path) -> None:
    """Every key of an old record survives a load and a save; absent keys stay absent."""
    record = RunRecord.load(DATA / name)
    assert record.to_json() == raw(name)
    record.save(tmp_path / "history.json")
    assert json.loads((tmp_path / "history.json").read_text()) == raw(name)
    assert record.status == "finished" and record.completed_rounds == 2
    assert [r.round for r in record.model_rounds] == [1, 2]
    first = record.round(1)
    assert first is not None and first.train is not None and first.aggregation is not None
    assert {s.site for s in first.train.sites} == {"site-0", "site-1"}
    assert first.aggregation.num_examples == sum(s.num_examples or 0 for s in first.train.sites)
    assert record.final_examples == raw(name)["rounds"][-1]["aggregation"]["num_examples"]
    assert record.table_schema is not None and record.table_schema["format"] == "fedsplit.schema"
    assert "error" not in record.to_json() and "server_opt" not in first.to_json()


def test_v1_dp_record_gives_each_hospitals_spent_epsilon() -> None:
    """The DP run's epsilon per hospital, from the typed entries, matches the JSON's last round."""
    record = RunRecord.load(DATA / "history-v1-dp.json")
    last = raw("history-v1-dp.json")["rounds"][-1]["train"]["sites"]
    assert record.spent_epsilon() == {s["site"]: (s["epsilon"], 2) for s in last}
    privacy = record.round(2).privacy
    assert (privacy.level, privacy.epsilon_budget, privacy.delta) == ("patient", 5.0, 1e-5)
    # summary.json's privacy section, rebuilt from the record, is the one the old code wrote
    old = raw("summary-v1-dp.json")["privacy"]
    rebuilt = privacy_section(record, dp=old["dp"], level=old["level"],
                              epsilon_budget=old["epsilon_budget"], delta=old["delta"])
    assert rebuilt.to_json() == {k: v for k, v in old.items() if k != "audit"}


@pytest.mark.parametrize("name", ["summary-v1.json", "summary-v1-dp.json"])
def test_v1_summary_loads_with_baselines(name: str) -> None:
    """summary.json: centralized and hospital-alone baselines, per-round scores, privacy."""
    summary = RunSummary.load(DATA / name)
    assert summary.to_json() == raw(name)
    assert summary.centralized is not None and summary.centralized.site is None
    assert [b.site for b in summary.local_only] == ["site-0", "site-1"]
    assert summary.round_metric("accuracy") == [r["metrics"]["accuracy"] for r in raw(name)["rounds"]]
    assert (summary.privacy is not None) == name.endswith("-dp.json")


def _without_privacy(data: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for entry in data["rounds"]:
        entry.pop("privacy", None)
        for site in entry["train"]["sites"]:
            site.pop("epsilon", None)
    return data


def test_record_privacy_writes_what_the_coordinator_wrote_before() -> None:
    """Patient level: each hospital's reported DP_EPSILON becomes its epsilon, and the round's
    privacy entry holds level, budget and delta: the exact JSON of the old in-place edit."""
    old = raw("history-v1-dp.json")
    record = RunRecord.from_json(_without_privacy(old))
    assert record.to_json() != old
    for entry in old["rounds"]:
        assert record.record_privacy(entry["round"], level="patient", epsilon_budget=5.0, delta=1e-5)
    assert record.to_json() == old
    assert all(DP_EPSILON in s.metrics for s in record.round(1).train.sites)


def test_record_privacy_hospital_level_gives_the_run_epsilon_to_used_hospitals() -> None:
    """Hospital level: every replying hospital gets the run's epsilon; an excluded one none."""
    record = RunRecord(rounds=[RoundEntry(round=1)])
    entry = record.round(1)
    assert not record.record_privacy(1, level="hospital", epsilon_budget=2.0, delta=1e-5,
                                     run_epsilon=0.7)  # no training recorded yet
    entry.train = RunRecord.model_validate({"rounds": [{"round": 1, "train": {"sites": [
        {"site": "a", "num_examples": 10, "metrics": {"train-loss": 0.1}},
        {"site": "b", "excluded": True, "late": True, "reason": "no train reply"},
    ]}}]}).rounds[0].train
    assert record.record_privacy(1, level="hospital", epsilon_budget=2.0, delta=1e-5, run_epsilon=0.7)
    written = record.to_json()["rounds"][0]
    assert written["privacy"] == {"level": "hospital", "epsilon_budget": 2.0, "delta": 1e-5,
                                  "epsilon": 0.7}
    assert written["train"]["sites"][0]["epsilon"] == 0.7
    assert "epsilon" not in written["train"]["sites"][1]
    assert record.spent_epsilon() == {"a": (0.7, 1)}


def test_unknown_fields_survive_a_rewrite() -> None:
    """A newer writer's field, at any level, is kept by an older reader that rewrites the file."""
    data = raw("history-v1.json")
    data["future_top"] = {"x": 1}
    data["rounds"][0]["future_round"] = [1, 2]
    data["rounds"][0]["train"]["sites"][0]["future_site"] = "y"
    data["rounds"][0]["aggregation"]["sites"][0]["future_report"] = True
    assert RunRecord.from_json(data).to_json() == data
    assert RoundEntry(round=3).to_json() == {"round": 3}
    assert SiteEntry(site="a", excluded=True, reason="r").to_json() == {
        "site": "a", "excluded": True, "reason": "r"}


@pytest.mark.parametrize(("data", "expected"), [
    ([], "must hold a JSON object"),
    ({"rounds": [{"round": "first"}]}, "rounds.0.round"),
    ({"rounds": [{"train": {}}]}, "rounds.0.round"),
    ({"rounds": [{"round": 1, "train": {"sites": [{"num_examples": "many"}]}}]},
     "rounds.0.train.sites.0.num_examples"),
    ({"status": "finished", "resumed": [{"at": 1.0}]}, "resumed.0.after_round"),
])
def test_malformed_record_is_refused_naming_the_field(data: Any, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        RunRecord.from_json(data)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "history.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        RunRecord.load(tmp_path / "history.json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        RunSummary.load(tmp_path / "missing.json")


def _models(out: Path, rounds: int) -> None:
    for number in range(1, rounds + 1):
        write_weights(Update(arrays={"w": np.full((2,), number, np.float32)}, num_examples=10,
                             round=number), out / "models" / f"round-{number:03d}.h5")


def test_coordinator_resumes_a_run_written_before_the_models(tmp_path: Path) -> None:
    """An unfinished v1 run (round 3 started, never trained) continues from round 2: the
    record keeps its rounds and keys, gets ``resumed`` and the kept round, and is on disk."""
    data = raw("history-v1.json")
    data["status"] = "running"
    data["rounds"].append({"round": 3})
    (tmp_path / "history.json").write_text(json.dumps(data))
    _models(tmp_path, 2)
    config = dict(data["config"])
    point = find_resume_point(tmp_path, config)
    assert point is not None and point.last_round == 2 and isinstance(point.history, RunRecord)
    history = RunHistory(tmp_path, config, previous=point.history)
    saved = RunRecord.load(tmp_path / "history.json")
    assert [r.round for r in saved.rounds] == [1, 2]
    assert saved.status == "running" and saved.resumed[-1].after_round == 2
    assert saved.selection is not None and saved.selection.rounds_kept in (1, 2)
    assert saved.round(1).to_json() == data["rounds"][0]
    assert (tmp_path / "global.h5").exists()
    history.finish("failed", "stopped")
    done = json.loads((tmp_path / "history.json").read_text())
    assert (done["status"], done["error"]) == ("failed", "stopped") and "finished_at" in done


def test_coordinator_writes_rounds_through_the_models(tmp_path: Path) -> None:
    """record_train/evaluate take entries (or their JSON) and write the documented keys."""
    history = RunHistory(tmp_path, {"strategy": "fedavg"})
    history.set_model("mlp/classification/2/2/none")
    history.record_train(1, None, [{"site": "a", "excluded": True, "late": True,
                                    "reason": "no train reply within round-timeout (5 s)"}],
                         {}, error="no usable training replies; global model unchanged",
                         train_seconds=0.5)
    history.record_evaluate(1, [SiteEntry(site="a", num_examples=4, metrics={"accuracy": 0.5})],
                            {"accuracy": 0.5}, seconds=0.7)
    history.record_privacy(1, level="patient", epsilon_budget=1.0, delta=1e-5)
    history.finish()
    saved = json.loads((tmp_path / "history.json").read_text())
    entry = saved["rounds"][0]
    assert set(saved) == {"status", "config", "model_id", "started_at", "rounds", "selection",
                          "finished_at"}
    assert entry["train"] == {"sites": [{"site": "a", "excluded": True, "late": True,
                                         "reason": "no train reply within round-timeout (5 s)"}],
                              "metrics": {}}
    assert entry["evaluate"]["sites"] == [{"site": "a", "num_examples": 4,
                                           "metrics": {"accuracy": 0.5}}]
    assert entry["privacy"] == {"level": "patient", "epsilon_budget": 1.0, "delta": 1e-5}
    assert "epsilon" not in entry["train"]["sites"][0]  # excluded: nothing reported
    assert {"train_seconds", "seconds", "error"} <= set(entry) and "model" not in entry
    assert history.data == saved


def test_bad_site_entry_from_the_coordinator_is_refused(tmp_path: Path) -> None:
    """The writer validates what it records: a site entry of the wrong shape never reaches disk."""
    history = RunHistory(tmp_path, {})
    with pytest.raises(ValueError, match="num_examples"):
        history.record_train(1, None, [{"site": "a", "num_examples": "lots"}], {})
    assert json.loads((tmp_path / "history.json").read_text())["rounds"] == []


def test_up_progress_lines_read_the_record() -> None:
    """``fedsplit up`` prints each round of a record: hospitals used, those left out, metrics."""
    from fedsplit.cli.up import round_line

    record = RunRecord.load(DATA / "history-v1.json")
    line = round_line(record.round(2), 2)
    accuracy = raw("history-v1.json")["rounds"][1]["evaluate"]["metrics"]["accuracy"]
    assert line.startswith(f"round 2/2 | 2 hospitals | accuracy={accuracy:.4f}, loss=")
    assert line.endswith(f"{record.round(2).seconds:.1f} s")
    cut = RoundEntry.model_validate({"round": 3, "error": "only 0 valid training replies",
                                     "train": {"sites": [{"site": "a", "excluded": True,
                                                          "late": True, "reason": "late"}]}})
    assert round_line(cut, 3) == ("round 3/3 | 0 hospitals | no evaluation | "
                                  "[yellow]only 0 valid training replies[/] | [yellow]without a (late)[/]")


def test_round_line_shows_a_recipes_own_metrics() -> None:
    """A recipe without accuracy or r2 still shows its metrics (first three), not just loss."""
    from fedsplit.cli.up import round_line

    record = RunRecord.from_json({"rounds": [{"round": 1, "evaluate": {"metrics": {
        "balanced-accuracy": 0.9, "loss": 0.5, "macro-auroc": 0.95, "extra": 1.0}}}]})
    line = round_line(record.round(1), 2)
    assert "balanced-accuracy=0.9000, loss=0.5000, macro-auroc=0.9500" in line
    assert "extra" not in line

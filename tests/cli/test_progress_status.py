"""What `fedsplit simulate` and `fedsplit up` say while they run (issue 41 item 3): the steps
before Flower are named as such, and a round that trained nothing shows no score."""

from __future__ import annotations

from pathlib import Path

import pytest
from fedsplit.cli.simulate import round_status
from fedsplit.cli.up import round_line
from fedsplit.orchestration.experiment import PHASES, Experiment, stage_sites
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.horizontal import RunRecord


def _record(*rounds: dict) -> RunRecord:
    return RunRecord.from_json({"status": "running", "rounds": list(rounds)})


def _round(number: int, *, model: bool, accuracy: float = 0.571) -> dict:
    entry = {"round": number, "train": {"sites": [{"site": "a", "num_examples": 10}]},
             "evaluate": {"metrics": {"accuracy": accuracy, "loss": 0.69}}}
    if model:
        entry["model"] = f"models/round-{number:03d}.h5"
    else:
        entry["error"] = "no hospital sent a usable update; global model unchanged"
    return entry


def test_a_run_that_trained_nothing_shows_no_score() -> None:
    """Two rounds evaluated, neither saved a model: the bar says so, with no accuracy."""
    status = round_status(_record(_round(1, model=False), _round(2, model=False)))
    assert status == "no model trained yet (2 round(s) trained nothing)"
    assert "accuracy" not in status and "0.571" not in status


def test_the_newest_trained_rounds_score_and_a_later_empty_round() -> None:
    record = _record(_round(1, model=True, accuracy=0.8), _round(2, model=False, accuracy=0.8))
    assert round_status(record) == "round 2 trained nothing; round 1: accuracy=0.800, loss=0.690"
    record = _record(_round(1, model=True, accuracy=0.8), _round(2, model=True, accuracy=0.85))
    assert round_status(record) == "accuracy=0.850, loss=0.690"


def test_before_any_evaluation_the_status_names_the_step() -> None:
    assert round_status(_record()) == "Flower: agreeing on the schema and the first model"
    assert round_status(_record({"round": 1, "train": {"sites": []}})) == "training round 1"


def test_up_prints_no_score_for_a_round_that_trained_nothing() -> None:
    record = _record(_round(1, model=False), _round(2, model=True, accuracy=0.9))
    first = round_line(record.round(1), 2)
    assert "no model trained: no score" in first and "accuracy" not in first
    assert "accuracy=0.9000" in round_line(record.round(2), 2)


def test_the_steps_before_flower_are_named_in_order(tmp_path: Path) -> None:
    """stage_sites reports reading, then schema agreement, then writing the rows; a schema
    conflict stops during schema agreement, before anything is written."""
    seen: list[str] = []
    stage_sites(Experiment(cfg=RunConfig(), out=tmp_path / "ok", dataset="wine", num_sites=2),
                seen.append)
    assert seen == list(PHASES[:3])
    assert PHASES[1] == "schema agreement (before Flower)"

    rows = "".join(f"{i},{i % 3},{i % 2}\n" for i in range(12))
    (tmp_path / "h1.csv").write_text("a,b,y\n" + rows)
    (tmp_path / "h2.csv").write_text("a,c,y\n" + rows)
    seen.clear()
    with pytest.raises(ConfigError, match="'b'"):
        stage_sites(Experiment(cfg=RunConfig(target="y"), out=tmp_path / "bad",
                               site_files=[tmp_path / "h1.csv", tmp_path / "h2.csv"]), seen.append)
    assert seen == list(PHASES[:2])
    assert not (tmp_path / "bad" / "sites").exists()

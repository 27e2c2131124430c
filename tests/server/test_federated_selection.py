"""The horizontal coordinator keeps the round its federated validation scores best (issue 26).

Scripted evaluation replies drive Flower's FedAvg hooks of `RegistryStrategy`: the hospitals'
count-weighted validation metric decides, ties go to the later round, ``keep=last`` keeps the
last round, ``global.h5`` is the kept round's saved model, ``last.h5`` the last one's, and a run
stopped after its best round and resumed still keeps that round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import read_weights
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.horizontal import Phase, RoundEntry
from fedsplit.server.history import RunHistory, find_resume_point
from fedsplit.server.selection import select, task_metric
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedsplit import aggregation

CLASSIFIER = "mlp/classification/2/2/-"
REGRESSOR = "mlp/regression/2/1/-"
COUNTS = {1: 10, 2: 30}  # evaluation rows per hospital: the weighted mean is count-weighted



class Grid:
    """The little of Flower's Grid that FedAvg's sampling uses."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


def _instruction(node: int, kind: str) -> Message:
    return Message(RecordDict({}), dst_node_id=node, message_type=kind)


def train_reply(node: int, r: int) -> Message:
    """A hospital's update in round ``r``: weights that say which round made them."""
    arrays = {"w": np.full((2, 2), r + node / 10, np.float32), "b": np.full(2, -r, np.float32)}
    return Message(RecordDict({
        "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "metrics": MetricRecord({wire.NUM_EXAMPLES: 10}),
        "site": ConfigRecord({wire.SITE_NAME: f"h{node}"})}), reply_to=_instruction(node, "train"))


def evaluate_reply(node: int, metric: str, value: float) -> Message:
    content = wire.build_evaluate_reply({wire.NUM_EXAMPLES: COUNTS[node], metric: value, "loss": 1.0},
                                        {wire.SITE_NAME: f"h{node}"})
    return Message(content, reply_to=_instruction(node, "evaluate"))


def run(out: Path, scores: dict[int, tuple[float, float] | None], *, keep: str | None = None,
        model_id: str = CLASSIFIER, history: RunHistory | None = None) -> RunHistory:
    """Rounds ``scores`` (in order) through the strategy's hooks: per round both hospitals'
    validation scores, or None for a round whose training brought no usable reply."""
    config = {} if keep is None else {"keep": keep}
    history = history or RunHistory(out, config)
    if history.data["model_id"] is None:
        history.set_model(model_id)
    metric = "accuracy" if "classification" in model_id else "r2"
    strategy = RegistryStrategy(aggregation.get_strategy("fedavg"), history, quorum=1,
                                min_train_nodes=1, min_available_nodes=1)
    for r, pair in scores.items():  # a resumed run's rounds go on from its last one
        record = ArrayRecord({"w": Array(np.zeros((2, 2), np.float32)),
                              "b": Array(np.zeros(2, np.float32))})
        strategy.configure_train(r, record, ConfigRecord({}), Grid())
        strategy.aggregate_train(r, [] if pair is None else [train_reply(n, r) for n in (1, 2)])
        values = pair or (0.99, 0.99)  # the unchanged model scores well: still not a candidate
        strategy.aggregate_evaluate(r, [evaluate_reply(n, metric, v)
                                        for n, v in zip((1, 2), values, strict=True)])
    return history


def weights(path: Path) -> dict[str, np.ndarray]:
    return read_weights(path).arrays


def assert_same_model(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        np.testing.assert_array_equal(wa[key], wb[key])


def test_the_best_weighted_validation_round_is_global_h5_and_a_tie_goes_later(tmp_path: Path) -> None:
    # Prepare: weighted means (10 and 30 rows) 0.6, 0.75, 0.7, 0.75, 0.5
    scores = {1: (0.6, 0.6), 2: (0.3, 0.9), 3: (0.7, 0.7), 4: (0.75, 0.75), 5: (0.5, 0.5)}
    # Execute
    history = run(tmp_path, scores)
    # Assert: round 2 and 4 tie at 0.75 -> round 4; global.h5 is round 4's model, last.h5 round 5's
    chosen = history.data["selection"]
    assert chosen["keep"] == "best-val" and chosen["metric"] == "accuracy"
    assert chosen["rounds_kept"] == 4 and chosen["val_score"] == pytest.approx(0.75)
    assert [s["score"] for s in chosen["val_metric"]] == pytest.approx([0.6, 0.75, 0.7, 0.75, 0.5])
    assert [s["examples"] for s in chosen["val_metric"]] == [40] * 5
    assert_same_model(tmp_path / "global.h5", tmp_path / "models" / "round-004.h5")
    assert_same_model(tmp_path / "last.h5", tmp_path / "models" / "round-005.h5")
    assert weights(tmp_path / "global.h5")["b"][0] == -4  # round 4's update, not another round's
    saved = json.loads((tmp_path / "history.json").read_text())
    assert saved["selection"]["rounds_kept"] == 4


def test_keep_last_keeps_the_last_round_whatever_it_scores(tmp_path: Path) -> None:
    history = run(tmp_path, {1: (0.9, 0.9), 2: (0.2, 0.2), 3: (0.1, 0.1)}, keep="last")
    chosen = history.data["selection"]
    assert chosen["keep"] == "last" and chosen["rounds_kept"] == 3
    assert chosen["val_score"] == pytest.approx(0.1)
    assert_same_model(tmp_path / "global.h5", tmp_path / "models" / "round-003.h5")
    assert_same_model(tmp_path / "global.h5", tmp_path / "last.h5")


def test_regression_is_chosen_by_r2_and_a_round_without_a_new_model_is_no_candidate(
        tmp_path: Path) -> None:
    # Prepare: round 3 brings no usable update; its evaluation (of round 2's model) is not a round
    scores = {1: (-0.5, 0.1), 2: (0.2, 0.3), 3: None, 4: (0.1, 0.1)}
    # Execute
    history = run(tmp_path, scores, model_id=REGRESSOR)
    # Assert
    chosen = history.data["selection"]
    assert chosen["metric"] == "r2" and chosen["rounds_kept"] == 2
    assert [s["round"] for s in chosen["val_metric"]] == [1, 2, 4]
    assert not (tmp_path / "models" / "round-003.h5").exists()
    assert_same_model(tmp_path / "global.h5", tmp_path / "models" / "round-002.h5")
    assert_same_model(tmp_path / "last.h5", tmp_path / "models" / "round-004.h5")


def test_a_run_stopped_after_its_best_round_and_resumed_still_keeps_it(tmp_path: Path) -> None:
    # Prepare: rounds 1-3 (best: round 2), then the coordinator dies
    run(tmp_path, {1: (0.5, 0.5), 2: (0.8, 0.8), 3: (0.6, 0.6)})
    # Execute: a new coordinator resumes from the out-dir and runs rounds 4-5, both worse
    point = find_resume_point(tmp_path, {})
    assert point is not None and point.last_round == 3
    # it continues from the last round's model, not from the kept one
    assert point.start_model == tmp_path / "models" / "round-003.h5"
    assert point.arrays()["b"].numpy()[0] == -3
    resumed = RunHistory(tmp_path, {}, previous=point.history)
    assert resumed.data["selection"]["rounds_kept"] == 2
    assert resumed.data["selection"]["val_score"] == pytest.approx(0.8)
    run(tmp_path, {4: (0.7, 0.7), 5: (0.4, 0.4)}, history=resumed)
    # Assert: round 2 is still the kept one, with its score; global.h5 is its model
    chosen = json.loads((tmp_path / "history.json").read_text())["selection"]
    assert chosen["rounds_kept"] == 2 and chosen["val_score"] == pytest.approx(0.8)
    assert [s["round"] for s in chosen["val_metric"]] == [1, 2, 3, 4, 5]
    assert_same_model(tmp_path / "global.h5", tmp_path / "models" / "round-002.h5")
    assert_same_model(tmp_path / "last.h5", tmp_path / "models" / "round-005.h5")


def test_a_resume_may_switch_the_rule_and_the_choice_follows(tmp_path: Path) -> None:
    run(tmp_path, {1: (0.9, 0.9), 2: (0.6, 0.6)})
    point = find_resume_point(tmp_path, {"keep": "last"})  # keep may change on resume
    resumed = RunHistory(tmp_path, {"keep": "last"}, previous=point.history)
    assert resumed.data["selection"]["rounds_kept"] == 2
    assert_same_model(tmp_path / "global.h5", tmp_path / "models" / "round-002.h5")


def test_a_bad_keep_value_says_what_to_use(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"best-val, last.*Received: 'best'"):
        RunHistory(tmp_path, {"keep": "best"})


def test_the_metric_follows_the_task() -> None:
    assert task_metric(CLASSIFIER) == "accuracy" and task_metric(REGRESSOR) == "r2"
    # ids without the task: the metric the evaluations report
    scored = RoundEntry(round=1, evaluate=Phase(metrics={"r2": 0.1}))
    assert task_metric("mlp:x", [scored]) == "r2"
    empty = select([], "best-val", CLASSIFIER)
    assert empty.rounds_kept == 0 and empty.val_score is None


def test_scores_equal_but_for_rounding_are_a_tie() -> None:
    """The same accuracy reached another way differs in the last bits of a weighted mean."""
    from fedsplit.protocol.selection import BestRound

    rule = BestRound.replay([(1, 0.5), (5, 0.8378378378378379), (8, 0.8378378378378378), (9, 0.83)])
    assert rule.round == 8
    assert BestRound.replay([(1, 0.5), (2, 0.8), (3, 0.8 - 1e-6)]).round == 2

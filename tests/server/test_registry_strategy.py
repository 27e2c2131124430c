"""The coordinator's Flower strategy: registry aggregation, exclusions, history and models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol import read_weights
from fedsplit.server.history import RunHistory
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedsplit import aggregation


def reply(node: int, arrays: dict[str, np.ndarray] | None, metrics: dict | None,
          site: str | None = None, error: str | None = None) -> Message:
    """A training reply from ``node`` (or an error reply)."""
    instruction = Message(RecordDict({}), dst_node_id=node, message_type="train")
    if error is not None:
        return Message(Error(code=1, reason=error), reply_to=instruction)
    records: dict = {}
    if arrays is not None:
        records["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    if metrics is not None:
        records["metrics"] = MetricRecord(metrics)
    if site is not None:
        records["site"] = ConfigRecord({"name": site})
    return Message(RecordDict(records), reply_to=instruction)


def test_bad_replies_are_excluded_with_reasons_and_the_rest_averaged(tmp_path: Path) -> None:
    """NaN weights, a missing count and a crashed client are excluded; others are FedAvg'd."""
    # Prepare
    history = RunHistory(tmp_path, config={})
    history.set_model("mlp/classification/2/2/-")
    strategy = RegistryStrategy(aggregation.get_strategy("fedavg"), history)
    w = {"fc.weight": np.ones((2, 2), np.float32)}
    replies = [
        reply(1, {"fc.weight": np.full((2, 2), 1.0, np.float32)}, {"num-examples": 10, "loss": 1.0}, "a"),
        reply(2, {"fc.weight": np.full((2, 2), 4.0, np.float32)}, {"num-examples": 30, "loss": 3.0}, "b"),
        reply(3, {"fc.weight": np.full((2, 2), np.nan, np.float32)}, {"num-examples": 5}, "nan-site"),
        reply(4, w, {"loss": 0.1}, "no-count"),
        reply(5, None, None, error="CUDA out of memory"),
    ]
    # Execute
    arrays, metrics = strategy.aggregate_train(1, replies)
    # Assert
    assert arrays is not None
    np.testing.assert_allclose(arrays["fc.weight"].numpy(), np.full((2, 2), 3.25))
    assert metrics["loss"] == pytest.approx(2.5)
    saved = json.loads((tmp_path / "history.json").read_text())
    train = saved["rounds"][0]["train"]
    excluded = {s["site"]: s["reason"] for s in train["sites"] if s.get("excluded")}
    assert "NaN/Inf" in excluded["nan-site"]
    assert "num-examples" in excluded["no-count"]
    assert "CUDA out of memory" in excluded["node-5"]
    model = read_weights(tmp_path / "global.h5")
    assert model.round == 1 and model.num_examples == 40
    assert model.model == "mlp/classification/2/2/-"
    report = json.loads((tmp_path / "models" / "round-001.report.json").read_text())
    assert [s["site"] for s in report["sites"] if not s["excluded"]] == ["a", "b"]


def test_incompatible_round_keeps_previous_model_and_records_error(tmp_path: Path) -> None:
    """Sites sending different shapes: the round is recorded as failed, not a crash."""
    history = RunHistory(tmp_path, config={})
    strategy = RegistryStrategy(aggregation.get_strategy("fedavg"), history)
    replies = [
        reply(1, {"w": np.ones(3, np.float32)}, {"num-examples": 1}, "a"),
        reply(2, {"w": np.ones(4, np.float32)}, {"num-examples": 1}, "b"),
    ]
    assert strategy.aggregate_train(1, replies) == (None, None)
    saved = json.loads((tmp_path / "history.json").read_text())
    assert "vertical fusion" in saved["rounds"][0]["error"]
    assert not (tmp_path / "global.h5").exists()


def test_evaluate_is_count_weighted(tmp_path: Path) -> None:
    """Federated evaluation weights each site's held-out metric by its count."""
    history = RunHistory(tmp_path, config={})
    strategy = RegistryStrategy(aggregation.get_strategy("fedavg"), history)
    replies = []
    for node, (n, acc) in enumerate([(10, 0.5), (30, 0.9)], start=1):
        instruction = Message(RecordDict({}), dst_node_id=node, message_type="evaluate")
        replies.append(Message(RecordDict({"metrics": MetricRecord({"num-examples": n,
                                                                     "accuracy": acc})}),
                               reply_to=instruction))
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics["accuracy"] == pytest.approx(0.8)

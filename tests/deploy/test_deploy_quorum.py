"""Quorum and deadline bookkeeping of `RegistryStrategy` (the real Flower FedAvg sampling path;
only the Grid is a fixed list of connected node ids)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.server.history import RunHistory
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsplit import aggregation


class ConnectedNodes:
    """The part of Flower's Grid that sampling reads: which node ids are connected."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def pushed(messages: list[Message]) -> list[Message]:
    """Give instructions their ids the way Flower's grid does when it pushes them."""
    for msg in messages:
        msg.metadata.__dict__["_message_id"] = msg.object_id
    return messages


def train_reply(instruction: Message, site: str, value: float) -> Message:
    records = RecordDict({"arrays": ArrayRecord({"w": Array(np.full(2, value, np.float32))}),
                          "metrics": MetricRecord({"num-examples": 10}),
                          "site": ConfigRecord({"name": site})})
    reply = Message(records, reply_to=instruction)
    reply.metadata.__dict__["_src_node_id"] = instruction.metadata.dst_node_id
    return reply


def strategy_for(tmp_path: Path, quorum: int) -> RegistryStrategy:
    history = RunHistory(tmp_path, config={})
    history.set_model("mlp/classification/2/2/-")
    return RegistryStrategy(aggregation.get_strategy("fedavg"), history, quorum=quorum, deadline=1.0,
                            min_train_nodes=quorum, min_available_nodes=quorum)


def test_short_round_is_recorded_and_keeps_the_model(tmp_path: Path) -> None:
    """3 sampled, 1 answered, quorum 2: no new model, the two silent sites are recorded as late."""
    strategy = strategy_for(tmp_path, quorum=2)
    arrays = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    sent = pushed(strategy.configure_train(1, arrays, ConfigRecord({}), ConnectedNodes([11, 12, 13])))
    assert sorted(m.metadata.dst_node_id for m in sent) == [11, 12, 13]
    first = next(m for m in sent if m.metadata.dst_node_id == 11)
    result, metrics = strategy.aggregate_train(1, [train_reply(first, "a", 1.0)])
    assert result is None and metrics is None
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert "fewer than the quorum of 2" in entry["error"]
    late = [s for s in entry["train"]["sites"] if s.get("late")]
    assert sorted(s["site"] for s in late) == ["node-12", "node-13"]
    assert all("round-timeout (1 s)" in s["reason"] for s in late)
    assert not (tmp_path / "global.h5").exists()


def test_quorum_met_aggregates_and_the_round_is_recorded_as_flower_numbers_it(
        tmp_path: Path) -> None:
    """2 of 3 answer with quorum 2: aggregated, under Flower's round number (the coordinator's
    own loop applies a resume's offset: tests/server/test_one_message_rounds.py)."""
    strategy = strategy_for(tmp_path, quorum=2)
    arrays = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    sent = pushed(strategy.configure_train(5, arrays, ConfigRecord({}), ConnectedNodes([1, 2, 3])))
    assert {int(m.content.config_records["config"]["server-round"]) for m in sent} == {5}
    replies = [train_reply(m, f"s{m.metadata.dst_node_id}", float(m.metadata.dst_node_id))
               for m in sent if m.metadata.dst_node_id != 3]
    result, _ = strategy.aggregate_train(5, replies)
    assert result is not None
    np.testing.assert_allclose(result["w"].numpy(), [1.5, 1.5])
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert entry["round"] == 5 and entry["model"] == "models/round-005.h5"
    assert [s["site"] for s in entry["train"]["sites"] if s.get("late")] == ["node-3"]


def test_too_few_connected_skips_the_phase_within_the_deadline(tmp_path: Path) -> None:
    """Only 1 hospital connected, quorum 2: the phase is skipped after the deadline, not hung."""
    strategy = strategy_for(tmp_path, quorum=2)
    arrays = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    assert strategy.configure_train(1, arrays, ConfigRecord({}), ConnectedNodes([7])) == []
    assert strategy.aggregate_train(1, []) == (None, None)
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert "only 1 hospital(s) connected" in entry["error"]

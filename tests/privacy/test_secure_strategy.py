"""The round loop's secure merge step with Flower Messages, hospitals answered in process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fedsplit.client.secure.agent import UPDATE, UPDATE_COUNT, handle_query
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.protocol.update import Update
from fedsplit.server.secure.merge import SecureMerge
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsplit import aggregation


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class Node:
    """A hospital's Flower context, reduced to what the stages use."""

    def __init__(self) -> None:
        self.state = RecordDict()


class InProcessGrid:
    """Delivers each ``query.secagg`` message to its hospital's handler (`client.secure`)."""

    def __init__(self, nodes: dict[int, Node], drop: set[int] = frozenset()) -> None:
        self.nodes, self.drop = nodes, drop

    def send_and_receive(self, msgs: list[Message], *, timeout: Any = None) -> list[Message]:
        return [Message(handle_query(m.content, m.metadata.dst_node_id,
                                     self.nodes[m.metadata.dst_node_id]), reply_to=m)
                for m in msgs if m.metadata.dst_node_id not in self.drop]


def _merge(spec: SecureSpec, **params: Any) -> SecureMerge:
    """The secure merge step with geometric-median; only its secure steps run here (no round)."""
    return SecureMerge(aggregation.get_strategy("geometric-median", params), secure=spec)


def test_each_train_message_gets_its_own_secure_record() -> None:
    """Flower's FedAvg shares one RecordDict across a round's messages: the cause of
    "Shares arrived from a node that is not a neighbour" in real simulations."""
    shared = RecordDict({"config": ConfigRecord({"server-round": 1})})
    msgs = [Message(shared, dst_node_id=n, message_type="train") for n in (5, 9)]
    out = [SecureMerge._with_record(m, ConfigRecord({"srcs": [str(m.metadata.dst_node_id)]}))
           for m in msgs]
    assert [list(m.content["secagg"]["srcs"]) for m in out] == [["5"], ["9"]]
    assert "secagg" not in shared and out[0].content["config"]["server-round"] == 1
    assert [m.metadata.dst_node_id for m in out] == [5, 9]


def test_secure_weiszfeld_equals_the_geometric_median() -> None:
    rng = np.random.default_rng(3)
    n = 7
    ids = [(1 << 63) + 101 * i for i in range(n)]  # node ids as large as Flower draws them
    deltas = [{"w": rng.normal(0, 0.02, (6, 5)), "b": rng.normal(0, 0.02, 5)} for _ in range(n)]
    deltas[-1] = {"w": np.full((6, 5), 0.9), "b": np.full(5, -0.9)}  # one hostile hospital
    counts = [int(c) for c in rng.integers(40, 400, n)]
    counts[-1] = 300
    nodes = {i: Node() for i in ids}
    for i, d, c in zip(ids, deltas, counts, strict=True):
        nodes[i].state.array_records[UPDATE] = Update(arrays=d, num_examples=c).to_array_record()
        nodes[i].state.config_records[UPDATE_COUNT] = ConfigRecord({"count": c})
    total = sum(counts)
    mean = {k: sum(d[k] * c for d, c in zip(deltas, counts, strict=True)) / total for k in ("w", "b")}
    # one iteration (aggregation.geometric_median.weiszfeld) on both sides: the same steps,
    # the same stopping test, the same point returned
    params = {"eps": 1e-9, "max_iter": 200}
    point, details = _merge(SecureSpec(bound=1.0), **params).iterate(
        1, ids, {k: np.zeros_like(v) for k, v in mean.items()}, mean, InProcessGrid(nodes))
    plain = aggregation.aggregate_updates(
        aggregation.get_strategy("geometric-median", params),
        [Update(arrays=d, num_examples=c) for d, c in zip(deltas, counts, strict=True)])
    assert details["steps"] >= 2 and details["stopped"] == "converged"
    assert details["steps"] == plain.report.details["iterations"] + 1  # + the step at z_0
    for k in ("w", "b"):  # within the quantisation (2B / L = 1.9e-6) and weight rounding
        assert np.max(np.abs(point[k] - plain.arrays[k])) < 1e-5
    # and robust: the hostile hospital pulls the mean far from the honest ones, the median hardly
    honest = sum(d["w"] * c for d, c in zip(deltas[:-1], counts[:-1], strict=True)) / sum(counts[:-1])
    pulled, kept = np.max(np.abs(mean["w"] - honest)), np.max(np.abs(point["w"] - honest))
    assert pulled > 0.1 and kept < 0.1 * pulled


def test_secure_weiszfeld_survives_a_dropout() -> None:
    rng = np.random.default_rng(4)
    ids = [1000 + i for i in range(6)]
    deltas = {i: {"w": rng.normal(0, 0.05, 20)} for i in ids}
    nodes = {i: Node() for i in ids}
    for i in ids:
        nodes[i].state.array_records[UPDATE] = Update(arrays=deltas[i], num_examples=100
                                                      ).to_array_record()
        nodes[i].state.config_records[UPDATE_COUNT] = ConfigRecord({"count": 100})
    mean = {"w": np.mean([deltas[i]["w"] for i in ids], axis=0)}
    point, details = _merge(SecureSpec(bound=1.0)).iterate(
        1, ids, {"w": np.zeros(20)}, mean, InProcessGrid(nodes, drop={ids[2]}))
    plain = aggregation.aggregate_updates(
        aggregation.get_strategy("geometric-median", {}),
        [Update(arrays=deltas[i], num_examples=100) for i in ids if i != ids[2]])
    assert details["steps"] >= 1
    assert np.max(np.abs(point["w"] - plain.arrays["w"])) < 1e-3

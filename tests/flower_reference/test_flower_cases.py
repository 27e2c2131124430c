"""Flower 1.42's strategy unit-test cases, run on `RegistryStrategy` (see README.md here).

Source of the cases: adap/flower, framework/py/flwr/serverapp/strategy/{fedmedian,
fedtrimmedavg,multikrum,fedavgm}_test.py (Apache-2.0); re-expressed, not copied.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.server.history import RunHistory
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Krum, MultiKrum
from flwr.supercore.task_identity import TaskIdentity

from fedsplit import aggregation


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def flower_reply(node: int, arrays: list[np.ndarray], num_examples: int) -> Message:
    """A reply shaped like Flower's mock replies: list-keyed ArrayRecord, a count, no site."""
    instruction = Message(RecordDict({}), dst_node_id=node, message_type="train")
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": num_examples})})
    return Message(content, reply_to=instruction)


def replies_of(cases: list[tuple[list[np.ndarray], int]]) -> list[Message]:
    return [flower_reply(node, arrays, n) for node, (arrays, n) in enumerate(cases, start=1)]


def registry(tmp_path: Path, name: str, params: dict | None = None) -> RegistryStrategy:
    return RegistryStrategy(aggregation.get_strategy(name, params or {}), RunHistory(tmp_path, {}))


# --- fedmedian_test.py ----------------------------------------------------------------------
def test_median_of_three_replies_is_exact(tmp_path: Path) -> None:
    """FedMedian: coordinate-wise median, counts ignored."""
    replies = replies_of([([np.array([1.0, 0.2, 0.5, 1.0])], 5),
                          ([np.array([0.2, 0.5, 1.0, 0.2])], 2),
                          ([np.array([0.5, 1.0, 0.2, 0.5])], 9)])
    arrays, _ = registry(tmp_path, "median").aggregate_train(1, replies)
    np.testing.assert_equal(arrays["0"].numpy(), np.array([0.5, 0.5, 0.5, 0.5]))
    sites = json.loads((tmp_path / "history.json").read_text())["rounds"][0]["train"]["sites"]
    assert [s["site"] for s in sites] == ["node-1", "node-2", "node-3"]  # no site record


# --- fedtrimmedavg_test.py ------------------------------------------------------------------
def test_trimmed_mean_of_four_replies_is_exact(tmp_path: Path) -> None:
    """FedTrimmedAvg(beta=0.25): drop the lowest and highest value per coordinate."""
    replies = replies_of([([np.array([0.5, 0.5, 0.5, 0.5])], 1),
                          ([np.array([1.0, 0.2, 0.5, 1.0])], 5),
                          ([np.array([0.2, 0.5, 1.0, 0.2])], 2),
                          ([np.array([0.5, 1.0, 0.2, 0.5])], 9)])
    arrays, _ = registry(tmp_path, "trimmed-mean", {"beta": 0.25}).aggregate_train(1, replies)
    np.testing.assert_equal(arrays["0"].numpy(), np.array([0.5, 0.5, 0.5, 0.5]))


def test_trimmed_mean_of_scalar_weights_keeps_them_scalar(tmp_path: Path) -> None:
    """0-d parameters: the result is 0-d and exactly (1 + 2) / 2."""
    replies = replies_of([([np.array(v)], 1) for v in (0.5, 1.0, 2.0, 100.0)])
    arrays, _ = registry(tmp_path, "trimmed-mean", {"beta": 0.25}).aggregate_train(1, replies)
    result = arrays["0"].numpy()
    assert result.shape == ()
    assert result == 1.5


# --- multikrum_test.py ----------------------------------------------------------------------
def test_krum_selects_the_update_closest_to_its_neighbours(tmp_path: Path) -> None:
    """Krum(f=1) over 5 replies picks [0.7]*4 bit for bit (same ArrayRecord object id as
    Flower's expected record and as Flower's own Krum on the same replies; our strategy takes
    each reply's arrays as it folds them, so Flower gets the replies built again)."""
    cases = [([np.array([v] * 4)], 5) for v in (0.2, 0.6, 0.7, 0.8, 1.0)]
    arrays, _ = registry(tmp_path, "krum", {"f": 1}).aggregate_train(1, replies_of(cases))
    expected = ArrayRecord([np.array([0.7, 0.7, 0.7, 0.7])])
    assert arrays.object_id == expected.object_id
    flower, _ = Krum(num_malicious_nodes=1).aggregate_train(1, replies_of(cases))
    assert arrays.object_id == flower.object_id


def test_multi_krum_averages_the_selected_updates(tmp_path: Path) -> None:
    """MultiKrum(f=1, m=2): 0.2 and 0.5 are selected as in Flower's case (the far 1.0, 2.0 and
    3.0 are not) and averaged to exactly [0.35]*4."""
    cases = [([np.array([v] * 4)], 5) for v in (0.2, 0.5, 1.0, 2.0, 3.0)]
    arrays, _ = registry(tmp_path, "multi-krum", {"f": 1, "m": 2}).aggregate_train(
        1, replies_of(cases))
    expected = ArrayRecord([np.array([0.35, 0.35, 0.35, 0.35])])
    assert arrays.object_id == expected.object_id
    flower, _ = MultiKrum(num_malicious_nodes=1, num_nodes_to_select=2).aggregate_train(
        1, replies_of(cases))
    assert arrays.object_id == flower.object_id
    report = json.loads((tmp_path / "models" / "round-001.report.json").read_text())
    assert [s["selected"] for s in report["sites"]] == [True, True, False, False, False]


@pytest.mark.parametrize(("name", "params"), [("krum", {"f": 1}), ("multi-krum", {"f": 1, "m": 2})])
def test_krum_with_three_replies_and_f_1_is_refused(tmp_path: Path, name: str, params: dict) -> None:
    """Flower's own case (N=3, f=1) breaks Krum's N >= 2f+3: the round is refused with the reason
    and the model stays unchanged (the coordinator refuses such a run at start already)."""
    replies = replies_of([([np.array([v] * 4)], 5) for v in (0.2, 0.7, 1.0)])
    assert registry(tmp_path, name, params).aggregate_train(1, replies) == (None, None)
    error = json.loads((tmp_path / "history.json").read_text())["rounds"][0]["error"]
    assert "2f+3" in error.replace(" ", "") and "5" in error
    assert not (tmp_path / "global.h5").exists()


# --- fedavgm_test.py (server learning rate 1, momentum 0: plain count-weighted FedAvg) --------
W0 = [np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32), np.array([7, 8, 9, 10], dtype=np.float32)]
W1 = [np.array([[29, 23, 19], [17, 13, 11]], dtype=np.float32),
      np.array([7, 5, 3, 2], dtype=np.float32)]


@pytest.mark.parametrize("rounds", [1, 2])
def test_fedavg_weights_each_reply_by_its_count(tmp_path: Path, rounds: int) -> None:
    """(w0 * 1 + w1 * 2) / 3 per array, to 5 decimals, in every round the same replies arrive."""
    strategy = registry(tmp_path, "fedavg")
    for server_round in range(1, rounds + 1):
        arrays, _ = strategy.aggregate_train(server_round, replies_of([(W0, 1), (W1, 2)]))
        for key, a, b in zip(("0", "1"), W0, W1, strict=True):
            np.testing.assert_almost_equal(arrays[key].numpy(), (a * 1 + b * 2) / 3, decimal=5)


def test_fedavg_of_scalar_weights_keeps_them_scalar(tmp_path: Path) -> None:
    """0-d parameters 1.0 (n=1) and 3.0 (n=2): a 0-d 7/3."""
    replies = replies_of([([np.array(1.0)], 1), ([np.array(3.0)], 2)])
    arrays, _ = registry(tmp_path, "fedavg").aggregate_train(1, replies)
    result = arrays["0"].numpy()
    assert result.shape == ()
    np.testing.assert_allclose(result, 7 / 3, rtol=1e-6)

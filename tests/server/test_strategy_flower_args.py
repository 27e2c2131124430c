"""`RegistryStrategy` honours what a Flower user passes to FedAvg, keeps 0-d parameters 0-d,
counts the quorum on usable updates, and the coordinator refuses a rule no round can satisfy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.update import to_array_record
from fedsplit.server.app import check_strategy_fits
from fedsplit.server.history import RunHistory
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedsplit import aggregation


class ConnectedNodes:
    """The part of Flower's Grid that sampling reads: which node ids are connected."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def reply(node: int, arrays: dict[str, np.ndarray], metrics: dict, kind: str = "train",
          site: str | None = None) -> Message:
    """A reply from ``node``; training replies carry arrays, evaluation replies only metrics."""
    instruction = Message(RecordDict({}), dst_node_id=node, message_type=kind)
    records: dict = {"metrics": MetricRecord(metrics)}
    if kind == "train":
        records["arrays"] = to_array_record(arrays)
    if site is not None:
        records["site"] = ConfigRecord({"name": site})
    return Message(RecordDict(records), reply_to=instruction)


def history_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "history.json").read_text())


def strategy(tmp_path: Path, name: str = "fedavg", **kwargs) -> RegistryStrategy:
    return RegistryStrategy(aggregation.get_strategy(name), RunHistory(tmp_path, {}), **kwargs)


def test_weighted_by_key_weights_the_arrays_and_the_metrics(tmp_path: Path) -> None:
    """weighted_by_key="rows": the count and metric weights come from it; num-examples is just
    another metric; the weight key leaves the averaged metrics; a reply without it is excluded."""
    s = strategy(tmp_path, weighted_by_key="rows")
    replies = [
        reply(1, {"w": np.full(2, 1.0)}, {"rows": 1, "num-examples": 100, "loss": 1.0}),
        reply(2, {"w": np.full(2, 4.0)}, {"rows": 3, "num-examples": 1, "loss": 5.0}),
        reply(3, {"w": np.full(2, 9.0)}, {"num-examples": 7, "loss": 0.0}),
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [3.25, 3.25])
    assert metrics["loss"] == pytest.approx(4.0)
    assert metrics["num-examples"] == pytest.approx(25.75)
    assert "rows" not in metrics
    sites = history_of(tmp_path)["rounds"][0]["train"]["sites"]
    assert [s_["num_examples"] for s_ in sites if not s_.get("excluded")] == [1, 3]
    assert "'rows'" in next(s_["reason"] for s_ in sites if s_.get("excluded"))
    # evaluation is weighted by the same key
    evaluation = [reply(1, {}, {"rows": 1, "acc": 0.2}, "evaluate"),
                  reply(2, {}, {"rows": 3, "acc": 0.6}, "evaluate")]
    assert s.aggregate_evaluate(1, evaluation)["acc"] == pytest.approx(0.5)


def test_list_valued_metrics_are_averaged_elementwise_as_flower_does(tmp_path: Path) -> None:
    """Same numbers as Flower's aggregate_metricrecords, lists included."""
    s = strategy(tmp_path)
    replies = [
        reply(1, {"w": np.ones(2)}, {"num-examples": 2, "loss": 0.3, "per-class": [0.1, 0.7, 0.2]}),
        reply(2, {"w": np.ones(2)}, {"num-examples": 5, "loss": 0.9, "per-class": [0.4, 0.4, 0.9]}),
    ]
    _, metrics = s.aggregate_train(1, replies)
    flower = aggregate_metricrecords([r.content for r in replies], "num-examples")
    assert dict(metrics) == dict(flower)
    assert metrics["per-class"] == pytest.approx([2 / 7 * 0.1 + 5 / 7 * 0.4,
                                                  2 / 7 * 0.7 + 5 / 7 * 0.4,
                                                  2 / 7 * 0.2 + 5 / 7 * 0.9])
    recorded = history_of(tmp_path)["rounds"][0]["train"]["metrics"]
    assert recorded["per-class"] == pytest.approx(list(metrics["per-class"]))


def test_metrics_aggregation_functions_get_the_usable_replies_and_the_weight_key(tmp_path: Path,
                                                                                 ) -> None:
    """train_metrics_aggr_fn / evaluate_metrics_aggr_fn replace the averaging; an excluded
    reply (NaN weights) is not passed to them."""
    calls: list[tuple[int, str]] = []

    def count_sites(contents: list[RecordDict], key: str) -> MetricRecord:
        calls.append((len(contents), key))
        return MetricRecord({"sites": len(contents),
                             "max-loss": max(float(c["metrics"]["loss"]) for c in contents)})

    s = strategy(tmp_path, train_metrics_aggr_fn=count_sites, evaluate_metrics_aggr_fn=count_sites)
    replies = [reply(1, {"w": np.ones(2)}, {"num-examples": 1, "loss": 0.5}),
               reply(2, {"w": np.full(2, np.nan)}, {"num-examples": 1, "loss": 9.0}),
               reply(3, {"w": np.ones(2)}, {"num-examples": 1, "loss": 0.7})]
    _, metrics = s.aggregate_train(1, replies)
    assert dict(metrics) == {"sites": 2, "max-loss": 0.7}
    evaluation = [reply(1, {}, {"num-examples": 4, "loss": 0.1}, "evaluate")]
    assert dict(s.aggregate_evaluate(1, evaluation)) == {"sites": 1, "max-loss": 0.1}
    assert calls == [(2, "num-examples"), (1, "num-examples")]
    assert history_of(tmp_path)["rounds"][0]["evaluate"]["metrics"] == {"sites": 1, "max-loss": 0.1}


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"arrayrecord_key": "weights"}, "arrayrecord_key"),
    ({"configrecord_key": "settings"}, "configrecord_key"),
    ({"server_momentum": 0.9}, "server_momentum"),
    ({"num_malicious_nodes": 1}, "num_malicious_nodes"),
    ({"train_metrics_aggr_fn": "mean"}, "train_metrics_aggr_fn"),
    ({"weighted_by_key": ""}, "weighted_by_key"),
])
def test_arguments_it_cannot_honour_are_refused_at_construction(tmp_path: Path, kwargs: dict,
                                                                named: str) -> None:
    """Never a silently ignored argument: the error names it."""
    with pytest.raises(ConfigError, match=named):
        strategy(tmp_path, **kwargs)


def test_flower_sampling_arguments_are_flowers(tmp_path: Path) -> None:
    """fraction_train and min_train_nodes drive Flower's own sampling."""
    s = strategy(tmp_path, fraction_train=0.5, min_train_nodes=1, min_available_nodes=1)
    sent = s.configure_train(1, to_array_record({"w": np.zeros(2)}), ConfigRecord({}),
                             ConnectedNodes([1, 2, 3, 4]))
    assert len(sent) == 2
    s = strategy(tmp_path, fraction_train=0.0)
    assert s.configure_train(1, to_array_record({"w": np.zeros(2)}), ConfigRecord({}),
                             ConnectedNodes([1, 2])) == []


def test_quorum_is_counted_on_usable_updates(tmp_path: Path) -> None:
    """Quorum 2, three replies, two of them failing the input checks (wrong layout, NaN):
    the round is short and the model unchanged, though three replies arrived."""
    s = strategy(tmp_path, quorum=2, min_train_nodes=1, min_available_nodes=1)
    s.configure_train(1, to_array_record({"w": np.zeros(2, np.float32)}), ConfigRecord({}),
                      ConnectedNodes([1, 2, 3]))
    replies = [reply(1, {"w": np.ones(2, np.float32)}, {"num-examples": 3}, site="good"),
               reply(2, {"w": np.ones(3, np.float32)}, {"num-examples": 3}, site="bad-shape"),
               reply(3, {"w": np.full(2, np.inf, np.float32)}, {"num-examples": 3}, site="inf")]
    assert s.aggregate_train(1, replies) == (None, None)
    entry = history_of(tmp_path)["rounds"][0]
    assert "only 1 usable training replies" in entry["error"]
    assert "fewer than the quorum of 2" in entry["error"]
    reasons = {x["site"]: x.get("reason", "") for x in entry["train"]["sites"]}
    assert "layout" in reasons["bad-shape"] and "NaN/Inf" in reasons["inf"]
    assert not (tmp_path / "global.h5").exists()
    # the same round with a second usable reply meets the quorum
    s.configure_train(2, to_array_record({"w": np.zeros(2, np.float32)}), ConfigRecord({}),
                      ConnectedNodes([1, 2, 3]))
    # (the strategy takes each reply's arrays as it folds them: round 2's replies are new ones)
    replies = [reply(1, {"w": np.ones(2, np.float32)}, {"num-examples": 3}, site="good"),
               reply(2, {"w": np.full(2, 3.0, np.float32)}, {"num-examples": 1}, site="ok"),
               reply(3, {"w": np.full(2, np.inf, np.float32)}, {"num-examples": 3}, site="inf")]
    arrays, _ = s.aggregate_train(2, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [1.5, 1.5])


def test_zero_d_parameters_survive_rounds_of_the_strategy(tmp_path: Path) -> None:
    """A scalar parameter: the aggregate is 0-d, so round 2's replies match its layout."""
    s = strategy(tmp_path, min_train_nodes=1, min_available_nodes=1)
    model = to_array_record({"w": np.zeros((2, 2), np.float32), "scale": np.array(1.0, np.float32)})
    for server_round, values in ((1, (1.0, 3.0)), (2, (5.0, 7.0))):
        s.configure_train(server_round, model, ConfigRecord({}), ConnectedNodes([1, 2]))
        replies = [reply(n, {"w": np.full((2, 2), v, np.float32), "scale": np.array(v, np.float32)},
                         {"num-examples": 1}) for n, v in zip((1, 2), values, strict=True)]
        model, _ = s.aggregate_train(server_round, replies)
        assert model is not None, history_of(tmp_path)["rounds"][-1].get("error")
        assert model["scale"].shape == () and model["scale"].dtype == "float32"
        assert float(model["scale"].numpy()) == sum(values) / 2
    excluded = [x for r in history_of(tmp_path)["rounds"] for x in r["train"]["sites"]
                if x.get("excluded")]
    assert excluded == []


def test_krum_that_no_round_can_satisfy_fails_at_start() -> None:
    """Krum with f=1 needs 5 updates: 3 hospitals are refused with the fix; 5 are fine."""
    krum = aggregation.get_strategy("krum", {"f": 1})
    cfg = RunConfig(strategy="krum", strategy_params='{"f": 1}', min_nodes=3)
    with pytest.raises(ConfigError, match=r"krum with f=1 needs at least 5.*at most 3.*Lower f"):
        check_strategy_fits(krum, 3, cfg)
    check_strategy_fits(krum, 5, RunConfig(min_nodes=5))
    # sampling half of 6 hospitals brings at most 3 per round
    with pytest.raises(ConfigError, match="at most 3"):
        check_strategy_fits(krum, 6, RunConfig(min_nodes=2, fraction_train=0.5))
    check_strategy_fits(aggregation.get_strategy("fedavg"), 1, RunConfig(min_nodes=1))

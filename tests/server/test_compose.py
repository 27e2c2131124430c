"""The strategy factory (`server.compose`): wrappers composed around the round loop, rules
asked what they support instead of name lists, and no import circle between the modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.fedavg import FedAvg
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg
from fedsplit.aggregation.median import Median
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.compose import check_composition, compose_aggregator, compose_strategy
from fedsplit.server.history import RunHistory
from fedsplit.server.privacy import PrivateStrategy
from fedsplit.server.secure.strategy import SecureStrategy, secure_rules
from fedsplit.server.strategy import RegistryStrategy, StrategyWrapper
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

DP = "epsilon=1,delta=1e-3"


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def stack(strategy: object) -> list[str]:
    """Class names from the outermost wrapper to the loop."""
    names = [type(strategy).__name__]
    while isinstance(strategy, StrategyWrapper):
        strategy = strategy.strategy
        names.append(type(strategy).__name__)
    return names


@pytest.mark.parametrize(("config", "layers"), [
    ({}, ["RegistryStrategy"]),
    ({"secure_aggregation": "on"}, ["SecureStrategy", "RegistryStrategy"]),
    ({"dp": DP}, ["PrivateStrategy", "RegistryStrategy"]),
    ({"dp": DP, "secure_aggregation": "on", "strategy": "geometric-median"},
     ["PrivateStrategy", "SecureStrategy", "RegistryStrategy"]),
    ({"dp": DP + ",level=hospital"}, ["PrivateStrategy", "RegistryStrategy"]),
])
def test_the_run_config_picks_the_wrappers(tmp_path: Path, config: dict, layers: list[str]) -> None:
    cfg = RunConfig(**config)
    aggregator = compose_aggregator(cfg)
    strategy = compose_strategy(cfg, aggregator, RunHistory(tmp_path, config={}), quorum=2)
    assert stack(strategy) == layers
    loop = strategy.loop if isinstance(strategy, StrategyWrapper) else strategy
    assert isinstance(loop, RegistryStrategy) and loop.quorum == 2 and loop.aggregator is aggregator
    hospital = "level=hospital" in config.get("dp", "")
    assert isinstance(aggregator, HospitalDPFedAvg) == hospital
    if not hospital:
        assert aggregator.name == cfg.strategy


def test_secure_aggregation_asks_the_rule_not_its_name(tmp_path: Path) -> None:
    assert secure_rules() == ["fedavg", "geometric-median"]  # what the registered rules declare
    cfg = RunConfig(secure_aggregation="on")

    class LinearMedian(Median):  # same name, declares itself linear: accepted
        linear = True

    class OpaqueFedAvg(FedAvg):  # same name, declares nothing: refused
        linear = False

    check_composition(cfg, LinearMedian())
    with pytest.raises(ConfigError, match="fedavg cannot run with secure aggregation") as err:
        check_composition(cfg, OpaqueFedAvg())
    assert "masked sum" in str(err.value) and "fedavg, geometric-median" in str(err.value)
    with pytest.raises(ConfigError, match="cannot run with secure aggregation"):
        SecureStrategy(RegistryStrategy(OpaqueFedAvg(), RunHistory(tmp_path, config={})),
                       secure=None)  # the wrapper itself refuses too


def test_hospital_dp_needs_a_linear_rule() -> None:
    with pytest.raises(ConfigError, match=r"linear in the updates \(fedavg\).*geometric-median"):
        compose_aggregator(RunConfig(strategy="geometric-median", dp=DP + ",level=hospital"))
    check_composition(RunConfig(strategy="geometric-median", dp=DP))  # patient level: any rule


def train_reply(node: int, value: float, count: int, epsilon: float) -> Message:
    instruction = Message(RecordDict({}), dst_node_id=node, message_type="train")
    return Message(RecordDict({
        "arrays": ArrayRecord({"fc.weight": Array(np.full((2, 2), value, np.float32))}),
        "metrics": MetricRecord({"num-examples": count, "dp-epsilon": epsilon}),
        "site": ConfigRecord({"name": f"h{node}"}),
    }), reply_to=instruction)


def test_the_dp_wrapper_delegates_and_records_epsilon(tmp_path: Path) -> None:
    cfg = RunConfig(dp=DP)
    history = RunHistory(tmp_path, config={})
    history.set_model("mlp/classification/2/2/-")
    strategy = compose_strategy(cfg, compose_aggregator(cfg), history)
    assert isinstance(strategy, PrivateStrategy)
    arrays, _ = strategy.aggregate_train(1, [train_reply(1, 1.0, 10, 0.3),
                                             train_reply(2, 4.0, 30, 0.5)])
    np.testing.assert_allclose(arrays["fc.weight"].numpy(), np.full((2, 2), 3.25))
    rounds = json.loads((tmp_path / "history.json").read_text())["rounds"]
    eps = {s["site"]: s["epsilon"] for s in rounds[0]["train"]["sites"]}
    assert eps == {"h1": pytest.approx(0.3), "h2": pytest.approx(0.5)}
    assert rounds[0]["privacy"]["level"] == "patient"


@pytest.mark.parametrize("module", ["fedsplit.server.secure.strategy", "fedsplit.server.privacy",
                                    "fedsplit.server.compose", "fedsplit.server.app"])
def test_each_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """No circle: the secure wrapper no longer imports server.privacy, which imported it back."""
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    privacy = Path(sys.modules["fedsplit.server.privacy"].__file__).read_text()
    assert "server.secure" not in privacy.split('"""', 2)[2]  # code, not the docstring

"""The loop factory (`server.compose`): the merge step and hooks of the round loop, rules
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
from fedsplit.server.compose import check_composition, compose_aggregator, compose_loop
from fedsplit.server.history import RunHistory
from fedsplit.server.merge import PlainMerge
from fedsplit.server.privacy import PrivacyHook
from fedsplit.server.rounds import RoundLoop
from fedsplit.server.secure.merge import SecureMerge, secure_rules
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

DP = "epsilon=1,delta=1e-3"



def parts(loop: RoundLoop) -> list[str]:
    """The loop's merge step, then its hooks, by class name."""
    return [type(loop.merge).__name__, *(type(h).__name__ for h in loop.hooks)]


@pytest.mark.parametrize(("config", "layers"), [
    ({}, ["PlainMerge"]),
    ({"secure_aggregation": "on"}, ["SecureMerge"]),
    ({"dp": DP}, ["PlainMerge", "PrivacyHook"]),
    ({"dp": DP, "secure_aggregation": "on", "strategy": "geometric-median"},
     ["SecureMerge", "PrivacyHook"]),
    ({"dp": DP + ",level=hospital"}, ["PlainMerge", "PrivacyHook"]),
])
def test_the_run_config_picks_the_merge_step_and_hooks(tmp_path: Path, config: dict,
                                                       layers: list[str]) -> None:
    cfg = RunConfig(**config)
    aggregator = compose_aggregator(cfg)
    loop = compose_loop(cfg, aggregator, RunHistory(tmp_path, config={}), quorum=2)
    assert parts(loop) == layers
    assert loop.quorum == 2 and loop.merge.aggregator is aggregator and loop.merge.quorum == 2
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
        SecureMerge(OpaqueFedAvg(), secure=None)  # the merge step itself refuses too


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


def test_the_dp_hook_records_epsilon(tmp_path: Path) -> None:
    cfg = RunConfig(dp=DP)
    history = RunHistory(tmp_path, config={})
    history.set_model("mlp/classification/2/2/-")
    loop = compose_loop(cfg, compose_aggregator(cfg), history)
    assert isinstance(loop.merge, PlainMerge) and isinstance(loop.hooks[0], PrivacyHook)
    arrays, _ = loop.close(loop.open(1, None), [train_reply(1, 1.0, 10, 0.3),
                                                 train_reply(2, 4.0, 30, 0.5)])
    np.testing.assert_allclose(arrays["fc.weight"].numpy(), np.full((2, 2), 3.25))
    rounds = json.loads((tmp_path / "history.json").read_text())["rounds"]
    eps = {s["site"]: s["epsilon"] for s in rounds[0]["train"]["sites"]}
    assert eps == {"h1": pytest.approx(0.3), "h2": pytest.approx(0.5)}
    assert rounds[0]["privacy"]["level"] == "patient"


@pytest.mark.parametrize("module", ["fedsplit.server.secure.merge", "fedsplit.server.privacy",
                                    "fedsplit.server.compose", "fedsplit.server.app",
                                    "fedsplit.server.strategy"])
def test_each_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """No circle: the secure merge step does not import server.privacy, nor the other way."""
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    privacy = Path(sys.modules["fedsplit.server.privacy"].__file__).read_text()
    assert "server.secure" not in privacy.split('"""', 2)[2]  # code, not the docstring

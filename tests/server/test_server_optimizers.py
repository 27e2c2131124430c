"""Server optimizers over any registry rule, and their state across a resumed run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import read_weights
from fedsplit.protocol.errors import ConfigError, ResumeMismatchError
from fedsplit.server.history import RunHistory, find_resume_point
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedsplit import aggregation

MODEL_ID = "mlp/classification/2/2/-"



class Grid:
    """The little of Flower's Grid that FedAvg's sampling uses."""

    def get_node_ids(self) -> list[int]:
        return [1, 2, 3]


def reply(node: int, arrays: dict[str, np.ndarray], count: int) -> Message:
    instruction = Message(RecordDict({}), dst_node_id=node, message_type="train")
    return Message(RecordDict({
        "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "metrics": MetricRecord({"num-examples": count}),
        "site": ConfigRecord({"name": f"h{node}"})}), reply_to=instruction)


def round_replies(r: int, start: dict[str, np.ndarray]) -> list[Message]:
    """Three hospitals moving the model; the third one far away (median ignores it)."""
    rng = np.random.default_rng(r)
    return [reply(n, {k: (v + rng.normal(0, 0.1, v.shape) + (5.0 if n == 3 else 0.0)
                          ).astype(np.float32) for k, v in start.items()}, 10 * n)
            for n in (1, 2, 3)]


def run_rounds(out: Path, rounds: range, optimizer: ServerOptimizer, start: dict[str, np.ndarray],
               history: RunHistory | None = None) -> dict[str, np.ndarray]:
    """Rounds of median + optimizer through RegistryStrategy's own hooks."""
    history = history or RunHistory(out, config={"server-opt": optimizer.name})
    if history.data["model_id"] is None:
        history.set_model(MODEL_ID)
    strategy = RegistryStrategy(aggregation.get_strategy("median"), history, quorum=1,
                                server_optimizer=optimizer, min_train_nodes=1,
                                min_available_nodes=1)
    current = start
    for r in rounds:
        record = ArrayRecord({k: Array(v) for k, v in current.items()})
        strategy.configure_train(r, record, ConfigRecord({}), Grid())
        arrays, _ = strategy.aggregate_train(r, round_replies(r, current))
        current = {k: a.numpy() for k, a in arrays.items()}
    return current


def test_adam_step_matches_the_paper_and_takes_running_stats_as_aggregated() -> None:
    """One Adam step: m = (1-b1) d, v = b2 tau^2 + (1-b2) d^2, x + lr m / (sqrt(v) + tau)."""
    opt = ServerOptimizer("adam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    x = {"w": np.array([1.0, -2.0], np.float32), "bn.running_mean": np.zeros(2, np.float32)}
    a = {"w": np.array([1.5, -2.0], np.float32), "bn.running_mean": np.ones(2, np.float32)}
    new = opt.step(x, a)
    d = np.array([0.5, 0.0])
    m, v = 0.1 * d, 0.99 * 1e-6 + 0.01 * d**2
    np.testing.assert_allclose(new["w"], x["w"] + 0.1 * m / (np.sqrt(v) + 1e-3), rtol=1e-6)
    np.testing.assert_array_equal(new["bn.running_mean"], a["bn.running_mean"])
    avgm = ServerOptimizer("avgm", momentum=0.5)
    assert avgm.lr == 1.0
    first = avgm.step(x, a)
    np.testing.assert_allclose(first["w"], a["w"])  # lr 1, no momentum yet: FedAvg's step
    second = avgm.step(first, {"w": first["w"] + 1, "bn.running_mean": a["bn.running_mean"]})
    np.testing.assert_allclose(second["w"], first["w"] + 1 + 0.5 * d, rtol=1e-6)
    with pytest.raises(ConfigError, match="server-opt must be one of"):
        ServerOptimizer("sgd")


@pytest.mark.parametrize("name", ["adam", "yogi", "adagrad", "avgm"])
def test_median_plus_optimizer_composes_and_a_resumed_run_continues_its_state(
        tmp_path: Path, name: str) -> None:
    """Median ignores the far hospital, the optimizer steps on median's pseudo-gradient; a run
    stopped after round 2 and resumed from its checkpoint ends where an unbroken run ends."""
    # Prepare
    start = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    make = lambda: ServerOptimizer(name, lr=0.05)  # noqa: E731
    # Execute: unbroken, 4 rounds
    unbroken = run_rounds(tmp_path / "a", range(1, 5), make(), start)
    # Execute: rounds 1-2, then a fresh coordinator resumes from the out-dir for rounds 3-4
    out = tmp_path / "b"
    run_rounds(out, range(1, 3), make(), start)
    point = find_resume_point(out, {"server-opt": name})
    assert point is not None and point.last_round == 2
    resumed_opt = make()
    point.restore_optimizer(resumed_opt)
    assert resumed_opt.step_count == 2
    history = RunHistory(out, {"server-opt": name}, previous=point.history)
    resumed = run_rounds(out, range(3, 5), resumed_opt,
                         {k: a.numpy() for k, a in point.arrays().items()}, history)
    # Assert
    for key in start:
        np.testing.assert_allclose(resumed[key], unbroken[key], rtol=1e-6, atol=1e-7)
        assert np.abs(unbroken[key]).max() < 1.0  # the far hospital (+5) did not pull it
    saved = json.loads((out / "history.json").read_text())
    assert [r["server_opt"]["step"] for r in saved["rounds"]] == [1, 2, 3, 4]
    state = read_weights(out / "models" / "round-004.opt.h5")
    assert state.model == f"server-opt/{name}" and state.num_examples == 4
    assert set(state.arrays) >= {"m.w", "m.b"}


def test_resuming_without_the_saved_state_is_refused(tmp_path: Path) -> None:
    """A run saved without optimizer state cannot continue with one."""
    start = {"w": np.zeros(2, np.float32)}
    history = RunHistory(tmp_path, config={})
    history.set_model(MODEL_ID)
    strategy = RegistryStrategy(aggregation.get_strategy("fedavg"), history, quorum=1)
    strategy.aggregate_train(1, round_replies(1, start))
    point = find_resume_point(tmp_path, {})
    with pytest.raises(ResumeMismatchError, match="no server-optimizer state for round 1"):
        point.restore_optimizer(ServerOptimizer("adam"))

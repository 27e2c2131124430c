"""The hospital agent keeps its own privacy ledger (issue 40): DP-SGD trainings are charged by
the hospital, whatever round the coordinator claims, across runs; the reply's ``dp-epsilon`` is
the data file's epsilon so far; plain trainings are counted."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from fedsplit.client.app import app
from fedsplit.client.data import load_bundled
from fedsplit.protocol import RunConfig
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.dp_ledger import LEDGER_FILE, PrivacyLedger
from fedsplit.protocol.stats import combine_moments
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

NODE_ID = 11


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 1
    yield


def _send(message_type: str, context: Context, **records) -> Message:
    content = RecordDict({"config": ConfigRecord({}), **records})
    return app(Message(content, dst_node_id=NODE_ID, message_type=message_type), context)


@pytest.fixture
def hospital(tmp_path: Path) -> dict[str, str]:
    """A hospital's node config: its 120-row file, its policy (a budget of epsilon 1 for the
    file, over every run) and its state folder."""
    data = load_bundled("breast-cancer")
    frame = pd.DataFrame(data.x[:120, :4], columns=data.feature_names[:4])
    frame["diagnosis"] = data.y[:120]
    frame.to_csv(tmp_path / "north.csv", index=False)
    (tmp_path / "policy.toml").write_text("[dp_budget]\nepsilon = 1.0\ndelta = 1e-5\n")
    return {"data-path": str(tmp_path / "north.csv"), "site-name": "north",
            "policy": str(tmp_path / "policy.toml"), "state-dir": str(tmp_path / "state")}


def _context(node: dict[str, str], cfg: RunConfig, run_id: int) -> Context:
    return Context(run_id=run_id, node_id=NODE_ID, node_config=node, state=RecordDict(),
                   run_config=cfg.to_flower())


def _model(context: Context) -> tuple[object, str]:
    stats = _send("query.stats", context)
    record = stats.content.metric_records["stats"]
    mean, std = combine_moments([(record["count"], record["sum"], record["sumsq"])])
    request = wire.ModelRequest(kind="mlp", task="classification", input_shape=(4,),
                                num_outputs=2, hidden=(8,), norm="none", mean=mean, std=std,
                                y_mean=0.0, y_std=1.0)
    init = _send("query.init", context, **dict(wire.build_init_instruction(request)))
    assert not init.has_error(), init.error
    return (init.content.array_records["arrays"],
            str(init.content.config_records["model"]["model-id"]))


def _train(context: Context, arrays, model_id: str, server_round: int | None) -> Message:
    config = {"model-id": model_id, wire.EVALUATE_FIRST: True} | (
        {} if server_round is None else {"server-round": server_round})  # scored, then trained
    return _send("train", context, arrays=arrays, config=ConfigRecord(config))


def test_the_agent_charges_its_ledger_whatever_round_is_claimed(hospital) -> None:
    cfg = RunConfig(target="diagnosis", local_epochs=1, num_server_rounds=2, hidden="8",
                    dp="epsilon=0.7,delta=1e-5")  # each run: 0.7 planned for 2 rounds
    first = _context(hospital, cfg, run_id=1)
    arrays, model_id = _model(first)
    replies = [_train(first, arrays, model_id, r) for r in (1, None, 1)]  # round 1, none, 1
    epsilons = [float(r.content.metric_records["metrics"][wire.DP_EPSILON])
                for r in replies[:2] if not r.has_error()]
    assert len(epsilons) == 2 and 0 < epsilons[0] < epsilons[1] <= 0.7
    refused = replies[2].error.reason
    assert "\n" not in refused and "north stops training in run 1" in refused
    ledger = PrivacyLedger.read(Path(hospital["state-dir"]) / LEDGER_FILE)
    (entry,) = ledger.files.values()
    assert [t.round for t in entry.trainings] == [1, 0]  # as claimed; counted by the hospital
    assert entry.trainings[-1].epsilon == pytest.approx(epsilons[-1])
    # a new run (a new run id, resume=false, a new --out): its own budget starts again, the
    # hospital's remembers: the file's epsilon goes on from 0.69 and stops below 1
    second = _context(hospital, cfg, run_id=2)
    arrays, model_id = _model(second)
    accepted, again = (_train(second, arrays, model_id, 1) for _ in range(2))
    assert 0.7 < float(accepted.content.metric_records["metrics"][wire.DP_EPSILON]) <= 1.0
    assert again.has_error() and "north refuses to train" in again.error.reason
    assert "above the hospital's budget of 1" in again.error.reason
    # a plain training is counted, not composed
    plain = _context(hospital, RunConfig(target="diagnosis", local_epochs=1, hidden="8"), 3)
    arrays, model_id = _model(plain)
    assert not _train(plain, arrays, model_id, 1).has_error()
    (entry,) = PrivacyLedger.read(Path(hospital["state-dir"]) / LEDGER_FILE).files.values()
    assert len(entry.trainings) == 3 and entry.plain_trainings == 1

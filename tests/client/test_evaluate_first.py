"""The hospital agent's one message per round (issue 32): a train instruction with
``evaluate-first`` scores the received model before training, exactly as an evaluate
instruction for that model would, and trains exactly as without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.app import app
from fedsplit.client.data import load_bundled
from fedsplit.client.models import build_model
from fedsplit.protocol import RunConfig
from fedsplit.protocol import horizontal_wire as wire
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

NODE_ID = 7
MODEL_ID = "mlp/classification/30/2/64-32"


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 1
    yield


@pytest.fixture
def context(tmp_path: Path) -> Context:
    data = load_bundled("breast-cancer")
    frame = pd.DataFrame(data.x[:150], columns=data.feature_names)
    frame["diagnosis"] = data.y[:150]
    path = tmp_path / "hospital.csv"
    frame.to_csv(path, index=False)
    cfg = RunConfig(target="diagnosis")
    return Context(run_id=1, node_id=NODE_ID, node_config={"data-path": str(path),
                   "site-name": "st-mary"}, state=RecordDict(), run_config=cfg.to_flower())


def send(kind: str, context: Context, arrays: ArrayRecord, **config) -> Message:
    msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord(
        {"model-id": MODEL_ID, "server-round": 2, **config})}), dst_node_id=NODE_ID,
        message_type=kind)
    reply = app(msg, context)
    assert not reply.has_error(), reply.error
    return reply


def test_the_train_reply_carries_the_received_models_evaluation(context: Context) -> None:
    model = build_model(MODEL_ID, seed=0)
    model.body[0].weight.data.mul_(0.01)  # a model that scores below a trained one
    arrays = ArrayRecord(model.state_dict())
    evaluated = send("evaluate", context, arrays).content.metric_records["metrics"]
    plain = send("train", context, arrays)
    fused = send("train", context, arrays, **{wire.EVALUATE_FIRST: True})
    assert wire.EVALUATION not in plain.content.metric_records
    carried = fused.content.metric_records[wire.EVALUATION]
    assert dict(carried) == dict(evaluated)  # the same rows, the same model, the same numbers
    assert carried[wire.NUM_EXAMPLES] == 30  # the validation rows (20% of 150)
    parsed = wire.parse_evaluation(fused)
    assert parsed.site == "st-mary" and parsed.metrics["accuracy"] == evaluated["accuracy"]
    # scoring first changes nothing in training: the same weights, count and loss
    for name, a in plain.content.array_records["arrays"].items():
        np.testing.assert_array_equal(a.numpy(), fused.content.array_records["arrays"][name].numpy())
    timing = wire.PARALLEL_SAMPLES_PER_S  # a throughput, measured: differs run to run
    assert ({k: v for k, v in plain.content.metric_records["metrics"].items() if k != timing}
            == {k: v for k, v in fused.content.metric_records["metrics"].items() if k != timing})
    # and the coordinator reads the train part as before
    assert wire.parse_train_reply(fused).update.num_examples == 120

"""The hospital agent's replies carry only model-shaped arrays, counts and scalar metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from fedsplit.client.app import app
from fedsplit.client.data import load_bundled
from fedsplit.client.models import build_model
from fedsplit.protocol import RunConfig
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.errors import ReplyError
from fedsplit.protocol.stats import combine_moments
from fedsplit.protocol.update import state_dict_arrays, to_array_record
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

NODE_ID = 7


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 1
    yield


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, pd.DataFrame]:
    """A hospital file: 120 breast-cancer rows with a target column."""
    data = load_bundled("breast-cancer")
    frame = pd.DataFrame(data.x[:120], columns=data.feature_names)
    frame["diagnosis"] = data.y[:120]
    path = tmp_path / "hospital.csv"
    frame.to_csv(path, index=False)
    return path, frame


def ask(message_type: str, context: Context, **records) -> Message:
    """Send one instruction to the ClientApp and return its reply."""
    content = RecordDict({"config": ConfigRecord({}), **records})
    reply = app(Message(content, dst_node_id=NODE_ID, message_type=message_type), context)
    assert not reply.has_error(), reply.error
    return reply


def refused(msg: Message, context: Context) -> str:
    """The one-line reason of the agent's error reply to ``msg`` (it must refuse it)."""
    reply = app(msg, context)
    assert reply.has_error(), "the agent answered instead of refusing"
    assert "\n" not in reply.error.reason and "Traceback" not in reply.error.reason
    return reply.error.reason


def init_request(stats: MetricRecord, num_features: int, norm: str = "none") -> dict:
    """The query.init instruction's records for a 2-class MLP over the site's own statistics."""
    mean, std = combine_moments([(stats["count"], stats["sum"], stats["sumsq"])])
    request = wire.ModelRequest(kind="mlp", task="classification", input_shape=(num_features,),
                                num_outputs=2, hidden=(64, 32), norm=norm, mean=mean, std=std,
                                y_mean=0.0, y_std=1.0)
    return dict(wire.build_init_instruction(request))


def assert_only_scalars(record: MetricRecord) -> None:
    """Every metric is one number."""
    for key, value in record.items():
        assert isinstance(value, int | float), f"metric {key} is {type(value).__name__}"


def test_every_reply_holds_only_model_arrays_counts_and_scalars(site) -> None:
    """Stats, init, train and evaluate replies: no rows, no labels, no IDs."""
    path, frame = site
    cfg = RunConfig(target="diagnosis", local_epochs=1, num_server_rounds=1)
    context = Context(run_id=1, node_id=NODE_ID, node_config={"data-path": str(path),
                      "site-name": "st-mary"}, state=RecordDict(), run_config=cfg.to_flower())
    num_features = frame.shape[1] - 1

    # Stats: per-feature aggregates only (one value per column, never per row)
    stats = ask("query.stats", context)
    assert set(stats.content.keys()) == {"stats", "schema", "fingerprint", "model", "check"}
    # its model check (issue 32): the model built with the site's own statistics, named and
    # shaped like the model's parameters, and what it was built for (no rows)
    check = stats.content.config_records["check"]
    assert set(check) == {"kind", "task", "input-shape", "num-outputs", "hidden", "norm",
                          "statistics"}
    built = build_model(str(stats.content.config_records["model"]["model-id"])).state_dict()
    # (issue 43: a fingerprint, no weights: each tensor's name, shape, dtype and digest)
    assert not stats.content.array_records
    tensors = json.loads(str(stats.content.config_records["fingerprint"]["tensors"]))
    assert {name: tuple(shape) for name, shape, _, _ in tensors} == {
        k: tuple(t.shape) for k, t in built.items()}
    record = stats.content.metric_records["stats"]
    for key in ("count", "sum", "sumsq"):
        assert len(record[key]) == num_features
    assert set(record) == {"num-examples", "count", "sum", "sumsq", "label-max", "y-sum", "y-sumsq"}
    schema = stats.content.config_records["schema"]
    assert set(schema) == {"name", "kind", "task", "input-shape", "features", "recipe"}
    assert list(schema["features"]) == list(frame.columns[:-1])

    # Init: a model built from pooled statistics
    init = ask("query.init", context, **init_request(record, num_features))
    assert set(init.content.keys()) == {"arrays", "model", "site"}
    assert dict(init.content.config_records["site"]) == {"name": "st-mary"}
    model_id = str(init.content.config_records["model"]["model-id"])
    federated = list(init.content.config_records["model"]["federated"])
    state = build_model(model_id).state_dict()
    # the trained parameters travel; the Standardize statistics stay as the initial model set them
    assert federated == [k for k in state if k.startswith("body.")]
    expected = {k: tuple(state[k].shape) for k in federated}

    # Train: the travelling arrays named and shaped like the model's, a count, scalar metrics,
    # the site name
    arrays = init.content.array_records["arrays"]
    train = ask("train", context, arrays=arrays,
                config=ConfigRecord({"model-id": model_id, "server-round": 1}))
    assert set(train.content.keys()) == {"arrays", "metrics", "site"}
    sent = train.content.array_records["arrays"]
    assert {k: tuple(a.shape) for k, a in sent.items()} == expected
    metrics = train.content.metric_records["metrics"]
    assert_only_scalars(metrics)
    assert metrics["num-examples"] == 96  # 120 rows minus the 20% local evaluation split
    assert set(metrics) == {"num-examples", "train-loss", "on-gpu", "parallel-workers",
                            "parallel-samples-per-s"}
    assert dict(train.content.config_records["site"]) == {
        "name": "st-mary", "device": "cpu", "parallel-mode": "none", "parallel-config": "none"}
    # No array is row-shaped: nothing has the table's row count along any axis
    assert all(96 not in a.shape and 120 not in a.shape for a in sent.values())

    # Evaluate: scalar metrics on the local held-out rows only
    # the next instruction carries the whole model: the tensors that do not travel as sent
    whole = to_array_record({**{k: a.numpy() for k, a in arrays.items()},
                             **{k: a.numpy() for k, a in sent.items()}})
    evaluate = ask("evaluate", context, arrays=whole,
                   config=ConfigRecord({"model-id": model_id}))
    assert set(evaluate.content.keys()) == {"metrics", "site"}
    eval_metrics = evaluate.content.metric_records["metrics"]
    assert_only_scalars(eval_metrics)
    assert eval_metrics["num-examples"] == 24
    assert 0.5 < eval_metrics["accuracy"] <= 1.0


def test_agent_without_data_path_fails_with_clear_error(site) -> None:
    """A SuperNode started without --node-config data-path gets told how to fix it."""
    cfg = RunConfig()
    context = Context(run_id=1, node_id=NODE_ID, node_config={}, state=RecordDict(),
                      run_config=cfg.to_flower())
    msg = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=NODE_ID,
                  message_type="query.stats")
    reply = app(msg, context)  # the failure comes back as Flower's error reply, one line
    assert reply.has_error()
    assert reply.error.reason.startswith("hospital node-7, reading its data: ConfigError: ")
    assert "data-path" in reply.error.reason and "\n" not in reply.error.reason


def test_train_reply_round_trips_into_an_update(site) -> None:
    """The coordinator's parser accepts what the agent sends."""
    path, _ = site
    cfg = RunConfig(target="diagnosis")
    context = Context(run_id=1, node_id=NODE_ID, node_config={"data-path": str(path)},
                      state=RecordDict(), run_config=cfg.to_flower())
    model_id = "mlp/classification/30/2/64-32"
    arrays = ArrayRecord(build_model(model_id, seed=0).state_dict())
    reply = ask("train", context, arrays=arrays,
                config=ConfigRecord({"model-id": model_id, "server-round": 2}))
    parsed = wire.parse_train_reply(reply, server_round=2)
    update = parsed.update
    assert update.num_examples == 96 and update.round == 2 and update.site == f"node-{NODE_ID}"
    assert np.isfinite(parsed.metrics["train-loss"]) and parsed.info["device"] == "cpu"


def test_hostile_simulated_site_scales_its_step_and_honest_sites_do_not(site) -> None:
    """attack=scale:10 with attackers=1: only the last site sends g + 10 (w - g)."""
    path, _ = site
    model_id = "mlp/classification/30/2/64-32"
    start = build_model(model_id, seed=0).state_dict()
    sent = {}
    for partition in (0, 2):  # site 2 of 3 is the hostile one; site 0 trains honestly
        cfg = RunConfig(target="diagnosis", attack="scale:10", attackers=1)
        context = Context(run_id=1, node_id=NODE_ID, state=RecordDict(), run_config=cfg.to_flower(),
                          node_config={"data-path": str(path), "partition-id": partition,
                                       "num-partitions": 3})
        reply = ask("train", context, arrays=ArrayRecord(start),
                    config=ConfigRecord({"model-id": model_id, "server-round": 1}))
        sent[partition] = {k: a.numpy() for k, a in reply.content.array_records["arrays"].items()}
    # Same data and seed: the honest site's weights are w; the hostile one sent g + 10 (w - g)
    assert set(sent[2]) == {k for k in start if k.startswith("body.")}  # what travels
    for name in sent[2]:
        g = start[name].numpy()
        np.testing.assert_allclose(sent[2][name], g + 10 * (sent[0][name] - g), rtol=1e-4, atol=1e-5)


def test_attack_outside_simulation_is_refused(site) -> None:
    """A deployed agent (no partition-id) refuses to play a simulated attack."""
    path, _ = site
    cfg = RunConfig(target="diagnosis", attack="nan", attackers=1)
    context = Context(run_id=1, node_id=NODE_ID, node_config={"data-path": str(path)},
                      state=RecordDict(), run_config=cfg.to_flower())
    model_id = "mlp/classification/30/2/64-32"
    msg = Message(RecordDict({"arrays": ArrayRecord(build_model(model_id, seed=0).state_dict()),
                              "config": ConfigRecord({"model-id": model_id})}),
                  dst_node_id=NODE_ID, message_type="train")
    assert "simulation engine" in refused(msg, context)


def test_batchnorm_model_travels_as_float64_counter_and_loads_back(site) -> None:
    """norm=batch: BatchNorm's int64 num_batches_tracked is float64 in the init and train replies,
    0-d like in the model, and counts the batches trained; loading casts it back to int64."""
    path, frame = site
    cfg = RunConfig(target="diagnosis", norm="batch", batch_size=32)
    context = Context(run_id=1, node_id=NODE_ID, node_config={"data-path": str(path)},
                      state=RecordDict(), run_config=cfg.to_flower())
    num_features = frame.shape[1] - 1
    stats = ask("query.stats", context).content.metric_records["stats"]
    init = ask("query.init", context, **init_request(stats, num_features, norm="batch"))
    model_id = str(init.content.config_records["model"]["model-id"])
    assert model_id == f"mlp/classification/{num_features}/2/64-32/batch"
    arrays = init.content.array_records["arrays"]
    counter = arrays["body.1.num_batches_tracked"]
    assert counter.dtype == "float64" and counter.shape == ()
    model = build_model(model_id)
    assert model.state_dict()["body.1.num_batches_tracked"].dtype == torch.int64
    # what travels: the trained parameters and BatchNorm's running statistics, never the
    # counter (averaging it means nothing) nor the Standardize statistics
    federated = list(init.content.config_records["model"]["federated"])
    assert "body.1.running_var" in federated and "body.1.num_batches_tracked" not in federated
    assert "norm.mean" not in federated
    # the layout the coordinator expects is the layout of the agent's reply
    train = ask("train", context, arrays=arrays,
                config=ConfigRecord({"model-id": model_id, "server-round": 1}))
    sent = train.content.array_records["arrays"]
    assert {k: (a.dtype, tuple(a.shape)) for k, a in sent.items()} == {
        k: (arrays[k].dtype, tuple(arrays[k].shape)) for k in federated}
    # 96 training rows in batches of 32: 3 steps per epoch, raised to MIN_LOCAL_STEPS (10); the
    # counter stays at the hospital (its agent's state), 0-d float64 there too
    kept = context.state.array_records["fedsplit-local"]
    assert float(kept["body.1.num_batches_tracked"].numpy()) == 10.0
    whole = to_array_record({**{k: a.numpy() for k, a in arrays.items()},
                             **{k: a.numpy() for k, a in sent.items()}})
    evaluate = ask("evaluate", context, arrays=whole, config=ConfigRecord({"model-id": model_id}))
    assert 0.5 < evaluate.content.metric_records["metrics"]["accuracy"] <= 1.0


def test_unexpected_records_and_keys_are_refused_on_both_ends(site) -> None:
    """The wire contract: a reply with an extra record or key is refused with a ReplyError that
    names it; so is an agent asked to send a metric the contract does not list."""
    instruction = Message(RecordDict({}), dst_node_id=3, message_type="train")
    good = {"arrays": to_array_record({"w": np.ones(2, np.float32)}),
            "metrics": MetricRecord({"num-examples": 5})}
    cases = [
        ({**good, "rows": to_array_record({"x": np.ones((5, 2), np.float32)})}, "rows"),
        ({**good, "site": ConfigRecord({"name": "a", "patient-ids": "1,2,3"})}, "patient-ids"),
        ({"metrics": good["metrics"]}, "arrays"),
        ({**good, "arrays": ConfigRecord({"w": 1.0})}, "array"),
    ]
    for records, named in cases:
        reply = Message(RecordDict(records), reply_to=instruction)
        with pytest.raises(ReplyError, match=named):
            wire.parse_train_reply(reply)
    ok = wire.parse_train_reply(Message(RecordDict(good), reply_to=instruction))
    assert ok.site == "node-3" and ok.update.num_examples == 5
    # stats and evaluate replies: closed key lists
    stats = wire.build_stats_reply(wire.SiteStats(
        "a", "table", "classification", (2,), ["f0", "f1"], 4, np.ones(2), np.ones(2), np.ones(2),
        1, 0.0, 0.0))
    stats["stats"]["row-ids"] = [1.0, 2.0]
    with pytest.raises(ReplyError, match="row-ids"):
        wire.parse_stats_reply(Message(stats, reply_to=instruction))
    with pytest.raises(ReplyError, match="labels"):
        wire.build_evaluate_reply({"num-examples": 4, "labels": 1.0}, {"name": "a"})
    with pytest.raises(ReplyError, match="single numbers"):
        wire.build_train_reply({"w": np.ones(2, np.float32)},
                               {"num-examples": 4, "train-loss": [0.1, 0.2]}, {"name": "a"})
    # the agent refuses an instruction outside the contract
    path, _ = site
    context = Context(run_id=1, node_id=NODE_ID, node_config={"data-path": str(path)},
                      state=RecordDict(), run_config=RunConfig(target="diagnosis").to_flower())
    model_id = "mlp/classification/30/2/64-32"
    msg = Message(RecordDict({"arrays": to_array_record(state_dict_arrays(
        build_model(model_id, seed=0).state_dict())), "config": ConfigRecord(
        {"model-id": model_id, "export-rows": 1})}), dst_node_id=NODE_ID, message_type="train")
    assert "export-rows" in refused(msg, context)

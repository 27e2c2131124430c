"""The hospital's policy, enforced by its own ClientApp mod, and the egress log it keeps.

Every test drives the real ClientApps (`client/app.py`, `client/vertical/app.py`) with real
Flower messages, a policy file and a state folder, as a hospital's SuperNode would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.app import app
from fedsplit.client.models import build_model
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.policy import check_reply, check_request, read_request, reply_contents
from fedsplit.client.policy.contents import read_instruction
from fedsplit.client.survival.app import app as survival_app
from fedsplit.client.vertical.app import app as vertical_app
from fedsplit.protocol import RunConfig, egress_log
from fedsplit.protocol.site_policy import PolicyRefusal, SitePolicy
from fedsplit.protocol.update import state_dict_arrays, to_array_record
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from tests.client.test_agent_messages import (  # noqa: F401 (task_identity: autouse fixture)
    NODE_ID,
    init_request,
    task_identity,
)

MODEL_ID = "mlp/classification/30/2/64-32"


@pytest.fixture
def hospital(tmp_path: Path) -> Path:
    """A hospital file: 120 breast-cancer rows, a ward column (two categories) and the target."""
    from fedsplit.client.data import load_bundled

    data = load_bundled("breast-cancer")
    frame = pd.DataFrame(data.x[:120], columns=data.feature_names)
    frame["ward"] = ["north", "south"] * 60
    frame["diagnosis"] = data.y[:120]
    path = tmp_path / "hospital.csv"
    frame.to_csv(path, index=False)
    return path


def context(tmp_path: Path, data: Path, policy: str | None = None, *, node: dict | None = None,
            **run: object) -> Context:
    """A hospital agent's context: its file, name, policy file (TOML text), state folder and
    the coordinator it was configured for."""
    node_config = {"data-path": str(data), "site-name": "st-mary", "state-dir": str(tmp_path / "state"),
                   "coordinator": "link.example.org:9092 ca=ab12"}
    if policy is not None:
        file = tmp_path / f"policy-{abs(hash(policy))}.toml"
        file.write_text(policy)
        node_config["policy"] = str(file)
    cfg = RunConfig(**{"target": "diagnosis", **run})
    return Context(run_id=1, node_id=NODE_ID, node_config={**node_config, **(node or {})},
                   state=RecordDict(), run_config=cfg.to_flower())


def send(message_type: str, ctx: Context, target=app, **records: object) -> Message:
    """One instruction to the ClientApp (its mods included); its reply."""
    content = RecordDict({"config": ConfigRecord({}), **records})
    return target(Message(content, dst_node_id=NODE_ID, message_type=message_type,
                          group_id="3"), ctx)


def refusal(reply: Message) -> str:
    """The reply's one-line policy refusal."""
    assert reply.has_error(), "the hospital answered instead of refusing"
    reason = reply.error.reason
    assert reason.startswith("hospital st-mary, its policy: "), reason
    assert "\n" not in reason and "Received: " in reason
    return reason


def records(tmp_path: Path) -> list[dict]:
    """The hospital's egress log, after checking that it verifies."""
    verdict = egress_log.verify(tmp_path / "state")
    assert verdict.ok, verdict.problem
    return [r.model_dump() for r in egress_log.read_records(tmp_path / "state")]


def train_arrays() -> ArrayRecord:
    return to_array_record(state_dict_arrays(build_model(MODEL_ID, seed=0).state_dict()))


# --- refused before the handler runs ----------------------------------------------------------
def test_a_run_kind_the_policy_does_not_take_is_refused_and_logged(tmp_path, hospital) -> None:
    """run_kinds = [horizontal]: the horizontal app answers; its query.survival (a survival run's
    summary) and a vertical site are refused, each with one line and one egress record."""
    ctx = context(tmp_path, hospital, 'run_kinds = ["horizontal"]\n')
    assert not send("query.schema", ctx).has_error()
    reason = refusal(send("query.survival", ctx))
    assert "takes no survival runs" in reason and "run_kinds" in reason
    vertical = refusal(send("query.psi_start", ctx, target=vertical_app))
    assert "takes no vertical runs" in vertical
    assert "takes no survival runs" in refusal(send("query.schema", ctx, target=survival_app))
    # the survival app's task is survival
    survival = context(tmp_path, hospital, 'tasks = ["classification"]\n')
    assert "does not take the task survival" in refusal(
        send("query.survival", survival, target=survival_app))
    logged = records(tmp_path)
    assert [(r["message"], r["outcome"], r["run_kind"]) for r in logged] == [
        ("query.schema", "sent", "horizontal"), ("query.survival", "refused", "survival"),
        ("query.psi_start", "refused", "vertical"), ("query.schema", "refused", "survival"),
        ("query.survival", "refused", "survival")]
    assert logged[1]["reason"] == reason and logged[1]["tensors"] == []


def test_a_task_the_policy_does_not_take_is_refused_where_it_is_known(tmp_path, hospital) -> None:
    """tasks = [regression]: a classification run config is refused; with task auto, the
    instruction's schema and the stats reply (the hospital's own data) still say it."""
    policy = 'tasks = ["regression"]\n'
    reason = refusal(send("query.schema", context(tmp_path, hospital, policy, task="classification")))
    assert "does not take the task classification" in reason and "run config task" in reason
    auto = context(tmp_path, hospital, policy)
    schema = json.dumps({"task": "classification", "columns": []})
    train = refusal(send("train", auto, arrays=train_arrays(),
                         config=ConfigRecord({"model-id": MODEL_ID, "schema": schema})))
    assert "the train instruction" in train
    stats = refusal(send("query.stats", auto))  # its own rows say classification
    assert "task 'classification' (its data)" in stats and "nothing was sent" in stats
    assert [r["outcome"] for r in records(tmp_path)] == ["refused"] * 3


def test_a_recipe_the_policy_does_not_list_is_refused_before_it_is_imported(
        tmp_path, hospital, monkeypatch) -> None:
    """A run naming a recipe module that would write a marker file on import: refused, the
    module never imported; the hospital's own recipe (node config) is its choice."""
    marker = tmp_path / "imported"
    (tmp_path / "marker_recipe.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nRecipe = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "marker_recipe", raising=False)
    ctx = context(tmp_path, hospital, recipe="marker_recipe:Recipe")
    reason = refusal(send("query.schema", ctx))
    assert "does not run the recipe marker_recipe:Recipe" in reason and "not imported" in reason
    assert not marker.exists() and "marker_recipe" not in sys.modules
    builtin = refusal(send("query.schema", context(tmp_path, hospital, 'recipes = []\n')))
    assert "runs no built-in model" in builtin
    # listed by the policy, or the hospital's own: the policy lets it through (the handler
    # imports it, and refuses it for not being a recipe)
    own = context(tmp_path, hospital, node={"recipe": "marker_recipe:Recipe"})
    reply = send("query.schema", own)
    assert reply.has_error() and "its policy" not in reply.error.reason
    assert marker.exists()
    listed = context(tmp_path, hospital, 'recipes = ["builtin", "marker_recipe:Recipe"]\n',
                     recipe="marker_recipe:Recipe")
    assert "its policy" not in send("query.schema", listed).error.reason


def test_plain_training_is_refused_when_the_policy_asks_for_patient_dp(tmp_path, hospital) -> None:
    """allow_plain_training = false: a train message without patient-level DP is refused before
    any training (horizontal, and vertical, which has no DP); evaluation is not training."""
    policy = "allow_plain_training = false\n"
    ctx = context(tmp_path, hospital, policy)
    reason = refusal(send("train", ctx, arrays=train_arrays(),
                          config=ConfigRecord({"model-id": MODEL_ID, "server-round": 1})))
    assert "only with patient-level DP" in reason and "Received: dp=''" in reason
    assert ctx.state.array_records == {}  # nothing trained, nothing kept
    assert "vertical training has none" in refusal(send("train.step", ctx, target=vertical_app))
    # hospital-level DP is no patient-level DP; patient-level DP passes the policy
    for dp, passes in (("level=hospital,epsilon=4,delta=1e-3,clip=1", False),
                       ("epsilon=5,delta=1e-3", True)):
        run = context(tmp_path, hospital, policy, dp=dp)
        msg = Message(RecordDict({"config": ConfigRecord({"model-id": MODEL_ID})}),
                      dst_node_id=NODE_ID, message_type="train")
        request = read_request("horizontal", msg, run, NodeConfig.from_flower(run.node_config))
        if passes:
            check_request(SitePolicy(allow_plain_training=False), request)
        else:
            with pytest.raises(PolicyRefusal, match="patient-level DP"):
                check_request(SitePolicy(allow_plain_training=False), request)


def test_an_unreadable_policy_file_refuses_everything(tmp_path, hospital) -> None:
    """A policy file with an unknown field: every message refused, naming the field."""
    reason = refusal(send("query.schema", context(tmp_path, hospital, "send_everything = true\n")))
    assert "send_everything" in reason


# --- what the reply carries ---------------------------------------------------------------------
def test_a_reply_carrying_a_kind_the_policy_does_not_send_is_blocked(tmp_path, hospital) -> None:
    """send without buffers: the stats reply passes (its model check is a fingerprint, no
    tensors), the initial model is blocked, naming the kind and the tensors; without statistics
    the stats reply is blocked for its sums."""
    ctx = context(tmp_path, hospital, 'send = ["weights", "statistics"]\n')
    sent = send("query.stats", ctx)
    assert not sent.has_error() and not sent.content.array_records
    stats = sent.content.metric_records["stats"]
    init = refusal(send("query.init", ctx, **init_request(stats, 32)))
    assert "buffers" in init and "arrays/norm.mean (32,) buffers" in init
    no_stats = refusal(send("query.stats", context(tmp_path, hospital, 'send = ["weights", '
                                                                        '"buffers"]\n')))
    # the stats record's sums: count, sum, sumsq, y-sum, y-sumsq
    assert "would send statistics" in no_stats and "stats/" in no_stats
    assert "and 2 more" in no_stats
    logged = records(tmp_path)
    assert [r["outcome"] for r in logged] == ["sent", "refused", "refused"]
    assert logged[1]["tensors"] == [] and logged[1]["bytes"] == 0  # nothing left


def test_every_item_of_vertical_and_secure_replies_has_its_kind() -> None:
    """Embeddings, PSI points, masked vectors and secure-aggregation shares are classified;
    anything unknown is blocked whatever the policy."""
    instruction = Message(RecordDict({}), dst_node_id=NODE_ID, message_type="train.step")
    vertical = RecordDict({"config": ConfigRecord({}), "arrays": ArrayRecord(
        {"embeddings": Array(np.zeros((8, 4), np.float32))})})
    contents = reply_contents("vertical", read_instruction(instruction), vertical)
    assert [(i.name, i.kinds, i.nbytes) for i in contents.items] == [
        ("embeddings", ("embeddings",), 128)]
    with pytest.raises(PolicyRefusal, match=r"would send embeddings.*arrays/embeddings \(8, 4\)"):
        check_reply(SitePolicy(send=("weights",)), contents)
    secure = RecordDict({"secagg": ConfigRecord({"pk1": b"k" * 32, "pk2": b"q" * 32}),
                         "rows": ArrayRecord({"x": Array(np.zeros((5, 2)))})})
    query = Message(RecordDict({}), dst_node_id=NODE_ID, message_type="query.secagg")
    items = reply_contents("horizontal", read_instruction(query), secure).items
    assert {(i.name, i.kinds) for i in items} == {
        ("pk1", ("secure",)), ("pk2", ("secure",)), ("x", ("unknown",))}
    with pytest.raises(PolicyRefusal, match="update the hospital's fedsplit"):
        check_reply(SitePolicy(), reply_contents("horizontal", read_instruction(query), secure))


# --- the egress log -----------------------------------------------------------------------------
def test_egress_records_name_every_tensor_count_label_and_category(tmp_path, hospital) -> None:
    """schema, stats, init, train and evaluate replies: one record each, with the run, the
    coordinator, the round, each tensor's name, shape, dtype and bytes, counts, metrics, the
    class labels and categories the column report named."""
    ctx = context(tmp_path, hospital)
    assert not send("query.schema", ctx).has_error()
    stats = send("query.stats", ctx).content.metric_records["stats"]
    init = send("query.init", ctx, **init_request(stats, 32))
    model_id = str(init.content.config_records["model"]["model-id"])
    arrays = init.content.array_records["arrays"]
    train = send("train", ctx, arrays=arrays,
                 config=ConfigRecord({"model-id": model_id, "server-round": 3}))
    whole = to_array_record({**{k: a.numpy() for k, a in arrays.items()},
                             **{k: a.numpy() for k, a in train.content.array_records["arrays"].items()}})
    assert not send("evaluate", ctx, arrays=whole,
                    config=ConfigRecord({"model-id": model_id, "server-round": 3})).has_error()
    schema, stats_record, init_record, trained, evaluated = records(tmp_path)
    assert all(r["run"] == 1 and r["site"] == "st-mary" and r["group"] == "3" and r["outcome"] == "sent"
               and r["coordinator"] == "link.example.org:9092 ca=ab12" for r in records(tmp_path))
    assert schema["labels"] == ["0", "1"] and schema["categories"] == {"ward": ["north", "south"]}
    assert schema["counts"] == {"rows": 96} and schema["tensors"][0]["kinds"] == ["column-report"]
    assert {t["name"]: t["kinds"] for t in stats_record["tensors"]}["sum"] == ["statistics"]
    assert {t["name"]: t["kinds"] for t in init_record["tensors"]}["norm.mean"] == ["buffers"]
    state = build_model(model_id).state_dict()
    sent = {t["name"]: t for t in trained["tensors"]}
    assert set(sent) == {k for k in state if k.startswith("body.")}
    for name, tensor in sent.items():
        assert tensor["shape"] == list(state[name].shape) and tensor["dtype"] == "float32"
        assert tensor["bytes"] == 4 * state[name].numel() and tensor["kinds"] == ["weights"]
    assert trained["round"] == 3 and trained["counts"] == {"num-examples": 96}
    assert trained["bytes"] == sum(t["bytes"] for t in trained["tensors"])
    assert "train-loss" in trained["metrics"] and trained["epsilon"] is None
    assert evaluated["tensors"] == [] and evaluated["counts"] == {"num-examples": 24}
    assert 0.5 < evaluated["metrics"]["accuracy"] <= 1.0


def test_the_handlers_own_error_reply_passes_and_is_logged(tmp_path) -> None:
    """A hospital without its data: the agent's own one-line failure goes back as it was, and
    the egress log records it as failed."""
    ctx = context(tmp_path, tmp_path / "missing.csv")
    reply = send("query.stats", ctx)
    assert reply.error.reason.startswith("hospital st-mary, reading its data: ")
    (logged,) = records(tmp_path)
    assert logged["outcome"] == "failed" and logged["reason"] == reply.error.reason


def test_a_reply_that_cannot_be_logged_is_not_sent(tmp_path, hospital) -> None:
    """A state folder whose log cannot be appended to: nothing leaves unrecorded."""
    ctx = context(tmp_path, hospital)
    state = tmp_path / "state"
    state.mkdir()
    (state / egress_log.LOG_NAME).mkdir()  # a folder where the log should be
    reason = refusal(send("query.schema", ctx))
    assert "the reply was not sent: its egress log cannot be written" in reason

"""Before round 1 every hospital runs the same recipe: the real agent's replies, the coordinator's
check, and each hospital's own check of the model it is sent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fedsplit.client.app import app
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.stats import combine_moments
from fedsplit.protocol.update import to_array_record
from fedsplit.server.setup import agree_recipe
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

NODE_ID = 11


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 1
    yield


def hospital(name: str, folder: Path, recipe: str, params: str = "{}") -> Context:
    """A hospital agent's context: its data folder and its operator's recipe (node config)."""
    cfg = RunConfig(num_server_rounds=1)
    return Context(run_id=1, node_id=NODE_ID, state=RecordDict(), run_config=cfg.to_flower(),
                   node_config={"data-path": str(folder), "site-name": name, "recipe": recipe,
                                "recipe-params": params})


def ask(message_type: str, context: Context, **records) -> Message:
    """One instruction to the real ClientApp; the reply."""
    content = RecordDict({"config": ConfigRecord({}), **records})
    return app(Message(content, dst_node_id=NODE_ID, message_type=message_type), context)


def stats_of(context: Context) -> wire.SiteStats:
    reply = ask(wire.STATS, context)
    assert not reply.has_error(), reply.error
    return wire.parse_stats_reply(reply)


def test_same_recipe_is_agreed(on_path: Path, png_hospitals: dict[str, Path]) -> None:
    """Three hospitals on png-cnn 1.0 with the same params: agreed, identity as reported."""
    stats = [stats_of(hospital(n, png_hospitals[n], "png_cnn:PngCNN", '{"channels": 8}'))
             for n in ("north", "south", "east")]
    agreed = agree_recipe(stats)
    assert (agreed.name, agreed.version, agreed.params["channels"]) == ("png-cnn", "1.0", 8)


def test_other_version_is_refused_before_round_1(on_path: Path,
                                                  png_hospitals: dict[str, Path]) -> None:
    """south runs version 1.1: the coordinator's check names south and the versions."""
    stats = [stats_of(hospital("north", png_hospitals["north"], "png_cnn:PngCNN")),
             stats_of(hospital("south", png_hospitals["south"], "png_cnn_v2:PngCNNv2")),
             stats_of(hospital("east", png_hospitals["east"], "png_cnn:PngCNN"))]
    with pytest.raises(ConfigError, match=r"hospital south runs png-cnn version 1.1 "
                                          r"\(version '1.1' vs '1.0'\)"):
        agree_recipe(stats)


def test_other_params_are_refused(on_path: Path, png_hospitals: dict[str, Path]) -> None:
    """Same version, other parameters: refused with the parameter named."""
    stats = [stats_of(hospital("north", png_hospitals["north"], "png_cnn:PngCNN")),
             stats_of(hospital("east", png_hospitals["east"], "png_cnn:PngCNN",
                               '{"channels": 4}'))]
    with pytest.raises(ConfigError, match=r"hospital east .*param channels=4 vs 16"):
        agree_recipe(stats)


def test_hospital_refuses_a_model_of_another_version(on_path: Path,
                                                     png_hospitals: dict[str, Path]) -> None:
    """A hospital on 1.1 sent a model built by 1.0 refuses to train it, naming both."""
    north = hospital("north", png_hospitals["north"], "png_cnn:PngCNN")
    record = stats_of(north)
    mean, std = combine_moments([(record.count, record.sum, record.sumsq)])
    request = wire.ModelRequest(kind="recipe", task="classification", input_shape=(1, 8, 8),
                                num_outputs=10, hidden=(), norm="none", mean=mean, std=std,
                                y_mean=0.0, y_std=1.0)
    init = ask(wire.INIT, north, **dict(wire.build_init_instruction(request)))
    assert not init.has_error(), init.error
    initial = wire.parse_init_reply(init)
    assert initial.model_id.startswith('recipe:{"input_shape":[1,8,8],"name":"png-cnn"')
    arrays = {k: v.numpy() for k, v in initial.arrays.items()}
    config = ConfigRecord({"model-id": initial.model_id, "server-round": 1})
    ok = ask(wire.EVALUATE, north, arrays=to_array_record(arrays), config=config)
    assert not ok.has_error(), ok.error
    metrics = wire.parse_evaluate_reply(ok).metrics
    assert set(metrics) == {"num-examples", "loss", "accuracy", "macro-f1"}
    south = hospital("south", png_hospitals["south"], "png_cnn_v2:PngCNNv2")
    refused = ask(wire.TRAIN, south, arrays=to_array_record(arrays), config=config)
    assert refused.has_error()  # one line naming the hospital and the stage, as its error reply
    assert re.match(r"hospital south, loading the global model: ConfigError: .*built by recipe "
                    r"png-cnn version 1.0 .* but this party runs png-cnn version 1.1 .*"
                    r"\(version '1.1' vs '1.0'\)", refused.error.reason)

"""A hospital's own model and its mistakes (issue 31), without Flower's runtime: what travels per
tensor, the model check before round 1, one data path for every process, and every failure
named with the hospital, the stage and the cause in one line.

The recipe is the signal recipe of docs/recipes.md (`tests/recipes/examples/signal_bn.py`: a
frozen random-feature Conv1d, two BatchNorm1d layers, its own reader, loss, metrics, training
step and predict), imported from a folder on ``sys.path`` as a hospital's own code would be.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from fedsplit.client.app import app
from fedsplit.client.data import is_staged, load_site_file, read_staged, write_staged
from fedsplit.client.failures import answered, hospital_stage
from fedsplit.client.models import build_model
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.recipes import ModelInputs, load_recipe
from fedsplit.client.site import load_site
from fedsplit.orchestration.experiment import Experiment, prepare_tables
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, HospitalFailure
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.server.setup import agree_model
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

RECIPE = "signal_bn:SignalNet"
INPUTS = ModelInputs("classification", (2, 32), 5)

WIDE = '''"""The signal recipe with another layer width under the same name, version and parameters
(a hospital running other code)."""

from signal_bn import SignalNet
from torch import nn


class Wider(SignalNet):
    def build_model(self, inputs):
        model = super().build_model(inputs)
        model[5] = nn.Linear(4 * self.params.width, 64)
        model[6] = nn.BatchNorm1d(64)
        model[8] = nn.Linear(64, inputs.num_outputs)
        return model


class FedBN(SignalNet):
    local_batch_norm = True


class HeadOnly(SignalNet):
    def federated(self, model):
        return [n for n in model.state_dict() if n.startswith("8.")]
'''


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield


@pytest.fixture
def recipes(on_path: Path) -> Path:
    """The signal recipe and its variants (signal_variants.py) importable here."""
    (on_path / "signal_variants.py").write_text(WIDE)
    yield on_path
    import sys

    sys.modules.pop("signal_variants", None)
    sys.modules.pop("signal_bn", None)


def hospital(name: str, path: Path, recipe: str = RECIPE, **run: object) -> Context:
    """A hospital agent's context: its own file, name and recipe (node config)."""
    cfg = RunConfig(recipe=recipe, **run)
    return Context(run_id=1, node_id=abs(hash(name)) % 10_000, state=RecordDict(),
                   node_config={"data-path": str(path), "site-name": name, "recipe": recipe},
                   run_config=cfg.to_flower())


def ask(kind: str, context: Context, **records: object) -> Message:
    content = RecordDict({"config": ConfigRecord({}), **records})
    return app(Message(content, dst_node_id=context.node_id, message_type=kind), context)


def init_reply(context: Context) -> Message:
    request = wire.ModelRequest(kind="recipe", task="classification", input_shape=(2, 32),
                                num_outputs=5, hidden=(), norm="none", mean=np.zeros(1),
                                std=np.ones(1), y_mean=0.0, y_std=1.0)
    return ask(wire.INIT, context, **dict(wire.build_init_instruction(request)))


# --- what travels ---------------------------------------------------------------------------
def test_default_federation_leaves_counters_and_frozen_layers_home(recipes: Path) -> None:
    """Trained parameters and BatchNorm running statistics travel; num_batches_tracked and the
    frozen Conv1d never do; FedBN keeps BatchNorm home; a recipe may name only its head."""
    recipe = load_recipe(RECIPE)
    model = build_model(recipe.model_spec(INPUTS), seed=0, recipe=recipe)
    travels = recipe.federated(model)
    assert "0.weight" not in travels and "0.bias" not in travels  # frozen random features
    assert not any(n.endswith("num_batches_tracked") for n in travels)
    assert {"1.running_mean", "1.running_var", "1.weight", "6.running_var", "8.weight"} <= set(travels)
    fedbn = load_recipe("signal_variants:FedBN")
    assert fedbn.federated(model) == ["5.weight", "5.bias", "8.weight", "8.bias"]
    head = load_recipe("signal_variants:HeadOnly")
    assert head.federated(model) == ["8.weight", "8.bias"]


def test_agent_replies_with_what_travels_and_keeps_the_rest(recipes: Path,
                                                            signal_hospitals: dict[str, Path]) -> None:
    """The train reply holds only the travelling tensors; FedBN's BatchNorm layers stay in the
    agent's state and come back into the next round's model (never averaged, never sent)."""
    context = hospital("north", signal_hospitals["north"], "signal_variants:FedBN")
    init = init_reply(context)
    assert not init.has_error(), init.error
    model = wire.parse_init_reply(init)
    assert model.federated == ("5.weight", "5.bias", "8.weight", "8.bias") and model.site == "north"
    arrays = {k: a.numpy() for k, a in model.arrays.items()}
    config = ConfigRecord({"model-id": model.model_id, "server-round": 1})
    reply = ask(wire.TRAIN, context, arrays=wire.to_array_record(arrays), config=config)
    assert not reply.has_error(), reply.error
    assert list(reply.content.array_records["arrays"]) == list(model.federated)
    kept = context.state.array_records["fedsplit-local"]
    assert {"1.running_mean", "1.weight", "6.running_var"} <= set(kept)
    assert not np.allclose(kept["1.running_mean"].numpy(), arrays["1.running_mean"])
    # the next round's global model (initial BatchNorm) is scored with the hospital's own
    evaluate = ask(wire.EVALUATE, context, arrays=wire.to_array_record(arrays), config=config)
    own = wire.parse_evaluate_reply(evaluate).metrics["balanced-accuracy"]
    other = hospital("north", signal_hospitals["north"], "signal_variants:FedBN")  # no own state
    plain = wire.parse_evaluate_reply(ask(wire.EVALUATE, other, arrays=wire.to_array_record(arrays),
                                          config=config)).metrics["balanced-accuracy"]
    assert own != plain


# --- the model check before round 1 ----------------------------------------------------------
def test_a_hospital_with_another_layer_width_is_refused_by_the_majority(
        recipes: Path, signal_hospitals: dict[str, Path]) -> None:
    """Same recipe name, version and parameters, other code at east: refused by name with the
    difference, whichever order the init replies arrive in (the majority decides)."""
    replies = {name: init_reply(hospital(name, signal_hospitals[name],
                                         "signal_variants:Wider" if name == "east" else RECIPE))
               for name in ("north", "south", "east")}
    for order in itertools.permutations(replies):
        with pytest.raises(ConfigError) as refused:
            agree_model([replies[n] for n in order], {})
        line = str(refused.value)
        assert line.startswith("Hospital east builds another model than the majority (north, "
                               "south)"), line
        assert "5.weight (64, 64) float32 vs (32, 64) float32" in line and "\n" not in line
    with pytest.raises(ConfigError, match=r"no majority agrees on one.*east.*north"):
        agree_model([replies["east"], replies["north"]], {})
    same = agree_model([replies["south"], replies["north"]], {})
    assert same.site == "north"  # the first by name gives the starting weights


# --- one data path ---------------------------------------------------------------------------
def test_signals_reach_every_process_with_the_shape_the_reader_gave(
        recipes: Path, signal_hospitals: dict[str, Path], tmp_path: Path) -> None:
    """N x C x L from the reader stays N x C x L: staged for a simulated hospital, read back by
    its agent (never N x 1 x C x L), as the coordinator's scoring and baselines read it."""
    recipe = load_recipe(RECIPE)
    data = recipe.read_data(signal_hospitals["south"])
    folder = tmp_path / "site-0"
    folder.mkdir()
    write_staged(data, folder / "data.npz")
    assert is_staged(folder) and not is_staged(signal_hospitals["south"])
    back = read_staged(folder / "data.npz")
    assert back.x.shape == data.x.shape == (250, 2, 32) and back.kind == "signal"
    np.testing.assert_array_equal(back.x, data.x)
    assert load_site_file(folder / "data.npz", target="y").x.shape == (250, 2, 32)
    cfg = RunConfig(recipe=RECIPE, data_dir=str(tmp_path))
    site = load_site(NodeConfig(partition_id=0, num_partitions=1), 1, cfg)
    assert site.train.x.shape[1:] == (2, 32)


# --- failures, named ---------------------------------------------------------------------------
def test_a_failure_is_one_line_with_hospital_stage_and_the_hospitals_own_code_line() -> None:
    def read() -> None:
        {}["label"]

    with pytest.raises(HospitalFailure) as failed, hospital_stage("east", "reading its data"):
        read()
    line = str(failed.value)
    assert re.match(r"hospital east, reading its data: KeyError: 'label' \(at "
                    r"test_hospital_failures.py:\d+ in read\)\. The file lacks", line), line
    assert failed.value.exit_code == 13

    @answered("training", lambda context: "west")
    def handler(msg: Message, context: object) -> Message:
        raise ValueError("my step\nis broken")

    instruction = Message(RecordDict({}), dst_node_id=1, message_type="train")
    reply = handler(instruction, None)
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert reply.error.reason.startswith("hospital west, training: ValueError: my step is broken")
    assert wire.failure_site(reply.error.reason) == "west"


def test_a_ray_traceback_becomes_one_line() -> None:
    """Errors written by Flower or Ray on a hospital's behalf: cut to their message, one line."""
    ray = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientApp"
           "Actor.run()\x1b[39m (pid=1)\n  File \"x.py\", line 3, in run\n    raise\nValueError: x"
           "\n\nException ClientAppException occurred. Message: too many values to unpack'>")
    assert wire.failure_reason(ray) == "the ClientApp failed: too many values to unpack"
    assert wire.failure_site(ray) is None


def test_the_agent_names_an_unlabelled_file_and_dp_with_batchnorm(
        recipes: Path, signal_hospitals: dict[str, Path]) -> None:
    """Reading an unlabelled file and building a BatchNorm model under DP-SGD come back as
    one line each, naming the hospital, the stage and the fix."""
    unlabelled = hospital("east", signal_hospitals["unlabelled"])
    reply = ask(wire.STATS, unlabelled)
    assert reply.has_error()
    assert re.match(r"hospital east, reading its data: KeyError: .*'label'.* \(at signal_bn\.py:\d+ "
                    r"in read_data\)", reply.error.reason), reply.error.reason
    dp = init_reply(hospital("north", signal_hospitals["north"], dp="epsilon=8,delta=1e-5"))
    assert dp.has_error() and "\n" not in dp.error.reason
    assert dp.error.reason.startswith("hospital north, building the model: ConfigError: Patient-"
                                      "level DP (DP-SGD) needs per-sample gradients")
    assert "1 (BatchNorm1d), 6 (BatchNorm1d)" in dp.error.reason and "GroupNorm" in dp.error.reason
    hospital_dp = "epsilon=8,delta=1e-5,level=hospital"
    noised = init_reply(hospital("north", signal_hospitals["north"], dp=hospital_dp))
    assert noised.has_error() and "local_batch_norm = True" in noised.error.reason
    fedbn = init_reply(hospital("north", signal_hospitals["north"], "signal_variants:FedBN",
                                dp=hospital_dp))
    assert not fedbn.has_error(), fedbn.error  # BatchNorm kept home: nothing of it is noised


def test_simulate_names_a_missing_or_unlabelled_site_file_before_flower(
        recipes: Path, signal_hospitals: dict[str, Path], tmp_path: Path) -> None:
    cfg = RunConfig(recipe=RECIPE)
    sites = [f"north={signal_hospitals['north']}", f"south={signal_hospitals['south']}"]
    gone = Experiment(cfg=cfg, out=tmp_path, site_files=[*sites, "east=data/gone.h5"])
    with pytest.raises(HospitalFailure, match=r"^hospital east, reading its data: data file "
                                              r"data/gone.h5 does not exist"):
        prepare_tables(gone)
    bad = Experiment(cfg=cfg, out=tmp_path, site_files=[
        *sites, f"east={signal_hospitals['unlabelled']}"])
    with pytest.raises(HospitalFailure, match=r"^hospital east, reading its data: KeyError"):
        prepare_tables(bad)


def test_a_run_that_trained_nothing_says_why_per_hospital() -> None:
    record = RunRecord.from_json({"status": "running", "rounds": [
        {"round": r, "train": {"sites": [
            {"site": "east", "excluded": True,
             "reason": "hospital east, training: ValueError: broken (at my.py:3 in train_step)"},
            {"site": "west", "excluded": True, "reason": "no train reply within round-timeout"}]},
         "error": "no usable training replies; global model unchanged"} for r in (1, 2)]})
    why = record.failure()
    assert why == ("0 of 2 round(s) trained a model; hospitals left out: hospital east, training: "
                   "ValueError: broken (at my.py:3 in train_step); west: no train reply within "
                   "round-timeout")
    trained = RunRecord.from_json({"status": "finished", "rounds": [
        {"round": 1, "model": "models/round-001.h5"}]})
    assert trained.failure() is None


def test_predict_names_a_missing_input(recipes: Path, tmp_path: Path) -> None:
    from fedsplit.orchestration.predict import predict_file

    with pytest.raises(ConfigError, match=r"data/gone\.h5, do not exist"):
        predict_file(tmp_path / "global.h5", Path("data/gone.h5"), tmp_path / "p.csv",
                     recipe=RECIPE)
    assert not (tmp_path / "p.csv").exists()


def test_the_signal_recipe_in_the_docs_is_the_file_the_tests_run() -> None:
    """docs/recipes.md's worked example 3 shows tests/recipes/examples/signal_bn.py as it is."""
    docs = (Path(__file__).parents[2] / "docs" / "recipes.md").read_text()
    example = (Path(__file__).parent / "examples" / "signal_bn.py").read_text()
    section = docs.split("## Worked example 3", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == example

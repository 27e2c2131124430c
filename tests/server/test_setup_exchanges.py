"""Set-up in as few exchanges as the data allows (issue 32), moving one model (issue 43):
``query.setup`` carries the column report, the statistics and the model check (a fingerprint,
no weights) under each hospital's own schema; ``query.stats`` (with its model check under the
agreed schema) goes again only to hospitals whose own schema is not the agreed one;
``query.init`` to hospitals without a model check for the agreed model, and to the reference
alone for the starting weights. The starting model is the same, to the bit, as when every
hospital is asked every question.

The real hospital agent (`client.app`) answers in-process through a scripted Flower Grid.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.app import app
from fedsplit.client.data import load_bundled
from fedsplit.protocol import RunConfig
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.errors import ConfigError, FedsplitError
from fedsplit.server import setup as coordinator_setup
from fedsplit.server.setup import prepare_model
from flwr.app import Context, Message, RecordDict


class Agents:
    """A Flower Grid whose nodes run fedsplit's ClientApp in this process."""

    def __init__(self, files: dict[int, Path], cfg: RunConfig,
                 recipes: dict[int, str] | None = None) -> None:
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={
            "data-path": str(path), "site-name": f"h{n}",
            # each hospital runs the run's recipe as its own (its policy allows only built-ins)
            **({"recipe": recipes[n]} if recipes else
               {"recipe": cfg.recipe, "recipe-params": cfg.recipe_params} if cfg.recipe else {})},
            state=RecordDict(),
            run_config=cfg.to_flower()) for n, path in files.items()}
        self.exchanges: list[tuple[str, list[int]]] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        self.exchanges.append((messages[0].metadata.message_type,
                               sorted(m.metadata.dst_node_id for m in messages)))
        return [app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]


def hospitals(tmp_path: Path, wards: dict[int, list[str]] | None = None,
              sites: tuple[int, ...] = (1, 2, 3), regression: bool = False) -> dict[int, Path]:
    """Breast-cancer hospitals (90 rows each); ``wards``: a text column per hospital;
    ``regression``: the target is a measurement (its first feature) instead of the diagnosis."""
    data = load_bundled("breast-cancer")
    files = {}
    for n in sites:
        rows = slice((n - 1) * 90, n * 90)
        frame = pd.DataFrame(data.x[rows], columns=data.feature_names)
        if wards is not None:
            frame["ward"] = [wards[n][i % len(wards[n])] for i in range(90)]
        frame["diagnosis"] = data.y[rows]
        if regression:
            frame["diagnosis"] = frame.pop(data.feature_names[0]) * 10.0
        files[n] = tmp_path / f"h{n}.csv"
        frame.to_csv(files[n], index=False)
    return files


def setup_arrays(grid: Agents, cfg: RunConfig) -> dict[str, np.ndarray]:
    made = prepare_model(grid, grid.get_node_ids(), cfg)
    return {k: a.numpy() for k, a in made.arrays.items()}


def asking_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hospitals whose set-up replies carry neither stats nor model check: each is asked
    query.stats and query.init (the set-up of three exchanges)."""
    monkeypatch.setattr(coordinator_setup.wire, "parse_setup_reply", lambda msg: wire.SetupReply(
        wire.parse_schema_reply(_as_schema_reply(msg)), None))
    monkeypatch.setattr(coordinator_setup.wire, "parse_stats_check", lambda msg: None)


def assert_same(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert list(arrays) == list(reference)
    for name in arrays:
        assert arrays[name].dtype == reference[name].dtype, name
        np.testing.assert_array_equal(arrays[name], reference[name], err_msg=name)


def test_agreeing_hospitals_set_up_with_one_model_moved(tmp_path: Path, monkeypatch) -> None:
    cfg = RunConfig(target="diagnosis", min_nodes=3)
    grid = Agents(hospitals(tmp_path), cfg)
    arrays = setup_arrays(grid, cfg)
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3]), (wire.INIT, [1])]
    # the pooled statistics are in the model, not any one hospital's own
    assert not np.allclose(arrays["norm.mean"], 0.0)
    # the same model, to the bit, as when every hospital is asked every question
    asking_everything(monkeypatch)
    again = Agents(hospitals(tmp_path), cfg)
    reference = setup_arrays(again, cfg)
    assert [kind for kind, _ in again.exchanges] == [wire.SETUP_QUERY, wire.STATS, wire.INIT]
    assert_same(arrays, reference)


def test_the_model_check_names_the_tensors_that_hold_the_statistics(tmp_path: Path) -> None:
    cfg = RunConfig(target="diagnosis", task="regression", min_nodes=3)
    grid = Agents(hospitals(tmp_path, regression=True), cfg)
    reply = app(Message(wire.build_setup_instruction(), dst_node_id=1,
                        message_type=wire.SETUP_QUERY), grid.contexts[1])
    check = wire.parse_setup_reply(reply).check
    assert check is not None and check.statistics == {
        "norm.mean": "mean", "norm.std": "std", "target_mean": "y-mean",
        "target_std": "y-std"}
    assert check.key[:2] == ("mlp", "regression") and check.key[3] == 1


def test_a_regression_federation_sets_up_with_one_model_moved(tmp_path: Path,
                                                             monkeypatch) -> None:
    """The target's pooled mean and std land in the model as query.init would put them."""
    cfg = RunConfig(target="diagnosis", task="regression", min_nodes=3)
    grid = Agents(hospitals(tmp_path, regression=True), cfg)
    arrays = setup_arrays(grid, cfg)
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3]), (wire.INIT, [1])]
    asking_everything(monkeypatch)
    again = Agents(hospitals(tmp_path, regression=True), cfg)
    reference = setup_arrays(again, cfg)
    assert again.exchanges[-1][0] == wire.INIT
    assert float(arrays["target_std"][0]) > 1.0
    assert_same(arrays, reference)


def test_only_hospitals_whose_own_schema_differs_are_asked_again(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """h3 has a ward the others lack: the agreed schema is h3's own, so only h1 and h2 send
    their statistics (and model check) again, encoded with the agreed one-hot columns; only the
    reference (h1) is asked query.init."""
    cfg = RunConfig(target="diagnosis", min_nodes=3)
    wards = {1: ["a", "b"], 2: ["a", "b"], 3: ["a", "b", "c"]}
    grid = Agents(hospitals(tmp_path, wards), cfg)
    made = prepare_model(grid, grid.get_node_ids(), cfg)
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3]), (wire.STATS, [1, 2]),
                              (wire.INIT, [1])]
    features = [c["name"] for c in json.loads(made.schema)["columns"]]
    assert "ward" in features
    asking_everything(monkeypatch)
    again = Agents(hospitals(tmp_path, wards), cfg)
    reference = prepare_model(again, again.get_node_ids(), cfg)
    assert again.exchanges == [(wire.SETUP_QUERY, [1, 2, 3]), (wire.STATS, [1, 2, 3]),
                               (wire.INIT, [1, 2, 3])]
    assert made.model_id == reference.model_id and made.schema == reference.schema
    assert_same({k: a.numpy() for k, a in made.arrays.items()},
                {k: a.numpy() for k, a in reference.arrays.items()})


RECIPES = '''"""Table recipes for the set-up tests: a plain one, one that derives a tensor from the
statistics, and one with another layer width under the same name, version and parameters."""

from collections import OrderedDict

import torch
from fedsplit.client.recipes import Recipe, Standardize
from torch import nn


class Plain(Recipe):
    name = "plain-mlp"
    version = "1.0"

    def build_model(self, inputs):
        (features,) = inputs.input_shape
        return nn.Sequential(Standardize((features,)), nn.Linear(features, 8), nn.ReLU(),
                             nn.Linear(8, inputs.num_outputs))


class Inverse(Plain):
    name = "inverse-mlp"

    def build_model(self, inputs):
        model = super().build_model(inputs)
        model.register_buffer("inv_std", torch.ones(inputs.input_shape))
        return model

    def set_statistics(self, model, mean, std, target_mean=0.0, target_std=1.0):
        super().set_statistics(model, mean, std, target_mean, target_std)
        with torch.no_grad():
            model.inv_std.copy_(1.0 / model[0].std)


class Batch(Plain):
    def build_model(self, inputs):
        model = super().build_model(inputs)
        model.insert(2, nn.BatchNorm1d(8))
        return model


class Wider(Plain):
    def build_model(self, inputs):
        model = super().build_model(inputs)
        model[1] = nn.Linear(inputs.input_shape[0], 16)
        model[3] = nn.Linear(16, inputs.num_outputs)
        return model


class Double(Plain):
    def build_model(self, inputs):
        model = super().build_model(inputs)
        model[3] = model[3].double()
        return model


class Renamed(Plain):
    def build_model(self, inputs):
        model = super().build_model(inputs)
        return nn.Sequential(OrderedDict([("0", model[0]), ("1", model[1]), ("2", model[2]),
                                          ("head", model[3])]))


class Reseeded(Plain):
    def build_model(self, inputs):
        model = super().build_model(inputs)
        with torch.no_grad():
            model[1].weight.mul_(0.5)
        return model


class Large(Plain):
    def build_model(self, inputs):
        (features,) = inputs.input_shape
        return nn.Sequential(Standardize((features,)), nn.Linear(features, 4096), nn.ReLU(),
                             nn.Linear(4096, 512), nn.ReLU(), nn.Linear(512, inputs.num_outputs))
'''


@pytest.fixture
def table_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "setup_recipes.py").write_text(RECIPES)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("setup_recipes", None)


def test_a_recipe_that_derives_from_the_statistics_builds_the_start_by_query_init(
        tmp_path: Path, table_recipes: Path, monkeypatch) -> None:
    """inv_std = 1 / std is no placement: the model checks still decide the majority in the
    first exchange, and only the reference (h1) builds the starting weights."""
    cfg = RunConfig(target="diagnosis", min_nodes=3, recipe="setup_recipes:Inverse")
    grid = Agents(hospitals(tmp_path), cfg)
    arrays = setup_arrays(grid, cfg)
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3]), (wire.INIT, [1])]
    np.testing.assert_allclose(arrays["inv_std"], 1.0 / arrays["0.std"], rtol=1e-6)
    assert not np.allclose(arrays["0.std"], 1.0)
    asking_everything(monkeypatch)
    again = Agents(hospitals(tmp_path), cfg)
    assert_same(arrays, setup_arrays(again, cfg))


def test_a_hospital_with_other_code_is_refused_in_the_first_exchange(
        tmp_path: Path, table_recipes: Path) -> None:
    """Same recipe name, version and parameters, another layer width at h3: refused by name,
    with the difference, from the set-up replies alone; two hospitals that differ: a tie."""
    cfg = RunConfig(target="diagnosis", min_nodes=3, recipe="setup_recipes:Plain")
    recipes = {1: "setup_recipes:Plain", 2: "setup_recipes:Plain", 3: "setup_recipes:Wider"}
    grid = Agents(hospitals(tmp_path), cfg, recipes)
    with pytest.raises(ConfigError) as refused:
        prepare_model(grid, grid.get_node_ids(), cfg)
    line = str(refused.value)
    assert line.startswith("Hospital h3 builds another model than the majority (h1, h2)"), line
    assert "1.weight (16, 30) float32 vs (8, 30) float32" in line and "\n" not in line
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3])]
    two = Agents(hospitals(tmp_path, sites=(1, 3)), cfg, {1: recipes[1], 3: recipes[3]})
    with pytest.raises(ConfigError, match=r"no majority agrees on one \(h1; h3\)"):
        prepare_model(two, two.get_node_ids(), cfg)
    assert two.exchanges == [(wire.SETUP_QUERY, [1, 3])]


@pytest.mark.parametrize(("variant", "difference"), [
    ("Wider", "1.weight (16, 30) float32 vs (8, 30) float32"),
    ("Double", "3.weight (2, 8) float64 vs (2, 8) float32"),
    ("Renamed", "3.weight only in h1's"),
    ("Reseeded", "1.weight has other starting values (h3's digest "),
])
def test_a_differing_hospital_is_refused_by_its_fingerprint(
        tmp_path: Path, table_recipes: Path, variant: str, difference: str) -> None:
    """Another shape, dtype, tensor name or seeded starting weights at h3: refused by name with
    the tensor, from the fingerprints alone (no model moved)."""
    cfg = RunConfig(target="diagnosis", min_nodes=3, recipe="setup_recipes:Plain")
    recipes = {1: "setup_recipes:Plain", 2: "setup_recipes:Plain", 3: f"setup_recipes:{variant}"}
    grid = Agents(hospitals(tmp_path), cfg, recipes)
    with pytest.raises(ConfigError) as refused:
        prepare_model(grid, grid.get_node_ids(), cfg)
    line = str(refused.value)
    assert line.startswith("Hospital h3 builds another model than the majority (h1, h2)"), line
    assert difference in line and "\n" not in line, line
    assert grid.exchanges == [(wire.SETUP_QUERY, [1, 2, 3])]


def test_the_set_up_reply_does_not_grow_with_the_model(tmp_path: Path,
                                                       table_recipes: Path) -> None:
    """A 2.2M-parameter recipe's query.setup reply is as small as an 8-unit one's: the model
    check is a fingerprint; its weights move once, from the reference's query.init."""
    from flwr.common.serde import recorddict_to_proto

    sizes, made = {}, {}
    for variant in ("Plain", "Large"):
        cfg = RunConfig(target="diagnosis", min_nodes=3, recipe=f"setup_recipes:{variant}")
        grid = Agents(hospitals(tmp_path), cfg)
        reply = app(Message(wire.build_setup_instruction(), dst_node_id=1,
                            message_type=wire.SETUP_QUERY), grid.contexts[1])
        assert wire.parse_setup_reply(reply).check is not None
        sizes[variant] = recorddict_to_proto(reply.content).ByteSize()
        made[variant] = setup_arrays(grid, cfg)
    model_bytes = sum(a.nbytes for a in made["Large"].values())
    assert model_bytes > 8_000_000
    assert sizes["Large"] < 40_000 and sizes["Large"] - sizes["Plain"] < 2_000, sizes


def test_a_model_the_hospitals_cannot_build_is_named_by_query_init(
        tmp_path: Path, table_recipes: Path) -> None:
    """Patient-level DP cannot train BatchNorm: the set-up replies carry no model check, so
    query.init asks again and names every hospital's failure as before."""
    cfg = RunConfig(target="diagnosis", min_nodes=3, dp="epsilon=1,delta=1e-3,level=patient",
                    recipe="setup_recipes:Batch")
    grid = Agents(hospitals(tmp_path), cfg)
    with pytest.raises(FedsplitError, match=r"3 of 3 hospitals failed before round 1 "
                                            r"\(query.init\): hospitals h1, h2, h3, building "
                                            r"the model: ConfigError: Patient-level DP"):
        prepare_model(grid, grid.get_node_ids(), cfg)
    assert [kind for kind, _ in grid.exchanges] == [wire.SETUP_QUERY, wire.INIT]


def _as_schema_reply(msg: Message) -> Message:
    """A query.setup reply reduced to its column report (as a query.schema reply)."""
    content = RecordDict({wire.COLUMNS: msg.content.config_records[wire.COLUMNS]})
    return Message(content, reply_to=Message(RecordDict({}), dst_node_id=msg.metadata.src_node_id,
                                             message_type=wire.SCHEMA_QUERY))

"""The recipe interface: identity, references, the built-ins, user recipes and their refusals."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fedsplit.client.models import ModelSpec, SiteModel, build_model, load_model, recipe_of
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.recipes import CNN, MLP, ModelInputs, load_recipe
from fedsplit.client.site import load_site, site_columns
from fedsplit.client.train import fit, score, set_statistics
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import (
    RecipeIdentity,
    RecipeModelId,
    check_same_recipe,
    parse_reference,
)
from fedsplit.protocol.update import Update
from fedsplit.protocol.weights import write_weights


def test_identity_differences_and_the_hospital_named() -> None:
    """A hospital on another version or other params is refused, named, with the difference."""
    a = RecipeIdentity(name="png-cnn", version="1.0", params={"channels": 16, "clip": 5.0})
    b = RecipeIdentity(name="png-cnn", version="1.1", params={"channels": 16, "clip": 5.0})
    c = RecipeIdentity(name="png-cnn", version="1.0", params={"channels": 8, "clip": 5.0})
    assert check_same_recipe({"north": a, "south": a}) == a
    with pytest.raises(ConfigError, match=r"hospital south runs png-cnn version 1.1 \(version "
                                          r"'1.1' vs '1.0'\)"):
        check_same_recipe({"north": a, "south": b, "east": a})
    with pytest.raises(ConfigError, match=r"hospital east .*param channels=8 vs 16"):
        check_same_recipe({"north": a, "south": a, "east": c})


def test_recipe_model_id_round_trips() -> None:
    """The model id records name, version, params, task, shape, outputs and selection metric."""
    ident = RecipeIdentity(name="focal-mlp", version="1.0", params={"gamma": 2.0, "width": 32})
    ref = RecipeModelId(ident, "classification", (30,), 2, "balanced-accuracy")
    assert RecipeModelId.from_id(ref.to_id()) == ref
    spec = ModelSpec.from_id(ref.to_id())
    assert (spec.kind, spec.recipe, spec.selection) == ("recipe", ident, "balanced-accuracy")
    assert spec.to_id() == ref.to_id()
    with pytest.raises(ConfigError, match="recipe model id"):
        RecipeModelId.from_id('recipe:{"name": "x"}')


@pytest.mark.parametrize("text", ["my.mod:Cls", "mlp", "focal-mlp", "a.b:C.D"])
def test_references_parse(text: str) -> None:
    """module:attribute and entry-point names are references."""
    ref = parse_reference(text)
    assert (ref.module and ref.attribute) or ref.entry_point


@pytest.mark.parametrize("text", ["", "a b:C", "mod:", ":Cls", "x/y"])
def test_bad_references_are_refused(text: str) -> None:
    """Anything else gets the two accepted forms in the error."""
    with pytest.raises(ConfigError, match="module:Attribute"):
        parse_reference(text)


def test_builtins_keep_their_ids_and_weights() -> None:
    """The MLP and CNN recipes build the same SiteModel, seeded the same, with the short ids."""
    mlp = MLP({"hidden": "64-32"}).model_spec(ModelInputs("classification", (30,), 2))
    assert mlp.to_id() == "mlp/classification/30/2/64-32"
    cnn = CNN().model_spec(ModelInputs("classification", (1, 8, 8), 10))
    assert cnn.to_id() == "cnn/classification/1x8x8/10/-"
    for spec in (mlp, cnn):
        via_recipe = build_model(spec, seed=3)
        with torch.random.fork_rng():
            torch.manual_seed(3)
            direct = SiteModel(spec)
        assert isinstance(via_recipe, SiteModel)
        for (k, a), (_, b) in zip(via_recipe.state_dict().items(), direct.state_dict().items(),
                                  strict=True):
            assert torch.equal(a, b), k
    assert MLP({"hidden": "64-32"}).identity == mlp.identity
    with pytest.raises(ConfigError, match="hidden"):
        MLP({"hidden": "64-x"})


def test_user_recipe_needs_its_path(recipe_dir: Path) -> None:
    """The example recipes are not importable until their folder is on the path."""
    with pytest.raises(ConfigError, match="Cannot import recipe module 'png_cnn'"):
        load_recipe("png_cnn:PngCNN")
    assert str(recipe_dir) not in sys.path


def test_user_recipe_trains_scores_and_rebuilds_from_its_weight_file(on_path: Path,
                                                                      tmp_path: Path) -> None:
    """A tabular recipe with a custom loss: its loss drops, its metrics come back, and its weight
    file rebuilds it with the recorded params."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x, y = data.data.astype(np.float32), data.target.astype(np.int64)
    recipe = load_recipe("tabular_loss:FocalMLP", '{"width": 16, "gamma": 1.0}')
    assert recipe.identity.params == {"width": 16, "gamma": 1.0}
    spec = recipe.model_spec(ModelInputs("classification", (30,), 2))
    model = build_model(spec, seed=0, recipe=recipe)
    set_statistics(model, x.mean(0), x.std(0))
    before = score(model, x, y)
    fit(model, x, y, epochs=5, lr=0.01, batch_size=32, seed=0)
    after = score(model, x, y)
    assert set(after) == {"loss", "accuracy", "balanced-accuracy"}
    assert after["loss"] < before["loss"] and after["accuracy"] > 0.9
    path = tmp_path / "global.h5"
    write_weights(Update.from_state_dict(model.state_dict(), num_examples=len(x),
                                         model=spec.to_id()), path)
    other = load_recipe("tabular_loss:FocalMLP")  # default params: the file's win
    again = load_model(path, recipe=other)
    assert recipe_of(again).identity == recipe.identity
    assert score(again, x, y) == pytest.approx(after)


def test_bad_params_and_non_recipes_are_refused(on_path: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Params are validated; a non-recipe attribute or a built-in's name is refused."""
    with pytest.raises(ConfigError, match=r"focal-mlp version 1.0 refuses its parameters.*width"):
        load_recipe("tabular_loss:FocalMLP", '{"width": 0}')
    with pytest.raises(ConfigError, match="JSON object"):
        load_recipe("tabular_loss:FocalMLP", "[1]")
    with pytest.raises(ConfigError, match=r"subclass of fedsplit\.client\.recipes\.Recipe"):
        load_recipe("tabular_loss:FocalParams")
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        load_recipe("tabular_loss:Missing")
    (tmp_path / "clash.py").write_text(
        "from tabular_loss import FocalMLP\n\nclass Mine(FocalMLP):\n    name = 'mlp'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="belongs to a built-in recipe"):
        load_recipe("clash:Mine")


def test_entry_point_recipe(on_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package's entry point in the fedsplit.recipes group is found by name."""
    dist = tmp_path / "hospital_recipes-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hospital-recipes\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedsplit.recipes]\nfocal = tabular_loss:FocalMLP\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert load_recipe("focal").identity.name == "focal-mlp"
    with pytest.raises(ConfigError, match=r"No recipe named 'nope'.*installed: \['focal'\]"):
        load_recipe("nope")


def test_png_reader_feeds_the_agent(on_path: Path, png_hospitals: dict[str, Path]) -> None:
    """A hospital agent whose recipe reads PNG folders: images, labels, no table report."""
    cfg = RunConfig(recipe="png_cnn:PngCNN")
    node = NodeConfig(data_path=str(png_hospitals["north"]), site_name="north")
    site = load_site(node, 1, cfg)
    assert site.train.x.shape[1:] == (1, 8, 8) and site.train.x.dtype == np.float32
    assert site.train.x.min() >= 0.0 and site.train.x.max() <= 1.0
    assert set(np.unique(site.train.y)) == set(range(10))
    report = site_columns(node, 1, cfg)
    assert not report.table and report.rows == len(site.train)


def test_dp_refusal_names_the_layer(on_path: Path) -> None:
    """Opacus cannot give per-sample gradients through BatchNorm: the layer is named."""
    from fedsplit.client.privacy.dpsgd import check_private_model

    (on_path / "bn_recipe.py").write_text(
        "from torch import nn\nfrom png_cnn import PngCNN\n\n"
        "class BatchNormCNN(PngCNN):\n    name = 'bn-cnn'\n\n"
        "    def build_model(self, inputs):\n"
        "        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),\n"
        "                             nn.Linear(144, inputs.num_outputs))\n")
    recipe = load_recipe("bn_recipe:BatchNormCNN")
    model = build_model(recipe.model_spec(ModelInputs("classification", (1, 8, 8), 10)),
                        recipe=recipe)
    with pytest.raises(ConfigError, match=r"layer\(s\) 1 \(BatchNorm2d\)"):
        check_private_model(model, 0.0)
    sys.modules.pop("bn_recipe", None)


def test_dp_refuses_a_loss_that_is_not_per_patient(on_path: Path) -> None:
    """A recipe whose loss couples rows (per_sample_loss = False) cannot run DP-SGD."""
    from fedsplit.client.privacy.agent import train_private
    from fedsplit.client.privacy.ledger import LedgerAccount
    from fedsplit.protocol.privacy import DPSpec

    (on_path / "coupled.py").write_text(
        "from tabular_loss import FocalMLP\n\n"
        "class Coupled(FocalMLP):\n    name = 'coupled'\n    per_sample_loss = False\n")
    recipe = load_recipe("coupled:Coupled")
    model = build_model(recipe.model_spec(ModelInputs("classification", (4,), 2)), recipe=recipe)
    cfg = RunConfig(dp="level=patient,epsilon=5,delta=1e-5,rounds=3")
    x = np.zeros((20, 4), np.float32)
    with pytest.raises(ConfigError, match="loss must be a sum over patients"):
        train_private(model, x, np.zeros(20, np.int64), DPSpec.parse(cfg.dp), cfg, steps=2,
                      server_round=1, seed=0, proximal_mu=0.0, device=torch.device("cpu"),
                      account=LedgerAccount(on_path / "state", "north", on_path, "run", None))
    sys.modules.pop("coupled", None)


def _focal_model(x: np.ndarray) -> torch.nn.Module:
    recipe = load_recipe("tabular_loss:FocalMLP", '{"width": 8}')
    model = build_model(recipe.model_spec(ModelInputs("classification", (x.shape[1],), 2)),
                        seed=0, recipe=recipe)
    set_statistics(model, x.mean(0), x.std(0))
    return model


def test_personalize_fine_tunes_a_recipe_model(on_path: Path) -> None:
    """--personalize STEPS and --personalize-scope bias work on a recipe's model: each hospital
    gets its own copy scored with the recipe's metrics; bias scope moves only the final bias."""
    from fedsplit.client.data import Dataset
    from fedsplit.orchestration.personalize import personalize
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x, y = data.data.astype(np.float32), data.target.astype(np.int64)
    model = _focal_model(x)
    fit(model, x[:300], y[:300], epochs=2, lr=0.01, batch_size=32, seed=0)
    sets = {name: Dataset(x[i::3][:150], y[i::3][:150], "classification", "mlp", [])
            for i, name in enumerate(("north", "south", "east"))}
    tests = [(name, Dataset(x[i::3][150:], y[i::3][150:], "classification", "mlp", []))
             for i, name in enumerate(("north", "south", "east"))]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tuned = personalize(model, sets, tests, RunConfig(), 20, "all")
    assert set(tuned.per_site) == {"north", "south", "east"}
    assert set(tuned.mean_per_site) == {"loss", "accuracy", "balanced-accuracy"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # copies tuned
    bias = personalize(model, sets, tests, RunConfig(), 20, "bias")
    assert bias.scope == "bias" and bias.mean_per_site["accuracy"] > 0.8


def test_a_folder_without_a_reader_points_to_recipes(png_hospitals: dict[str, Path]) -> None:
    """A hospital folder and no recipe that reads it: the error names --recipe."""
    from fedsplit.client.data import load_site_file

    with pytest.raises(ConfigError, match=r"give --recipe \(docs/recipes\.md\)"):
        load_site_file(png_hospitals["north"], target="y")

"""In-site parallel training of a hospital's own recipe (docs/recipes.md, "In-site parallel
training"): the worked examples run from a folder on the path, on CPU "devices" (gloo processes
for ``data`` and ``pipeline``, two CPU stages in one process for ``model``), against
`client.train.fit` on one device where the math says they are the same steps."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fedsplit.client.models import build_model
from fedsplit.client.parallel import fit_parallel, layer_names
from fedsplit.client.recipes import ModelInputs, Recipe, load_recipe
from fedsplit.client.train import fit, set_statistics
from fedsplit.protocol.errors import ConfigError
from torch import nn

KW = {"lr": 1e-2, "seed": 3, "proximal_mu": 0.05}


@pytest.fixture
def examples(on_path: Path) -> Iterator[Path]:
    yield on_path
    sys.modules.pop("signal_bn", None)


def _signals(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 5, n)
    x = rng.normal(size=(n, 2, 32)).astype(np.float32) + y[:, None, None].astype(np.float32)
    return x, y.astype(np.int64)


def _table(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(2.0, 3.0, size=(n, 6)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 4).astype(np.int64)


def _model(recipe: Recipe, inputs: ModelInputs, x: np.ndarray) -> nn.Module:
    model = build_model(recipe.model_spec(inputs), seed=1, recipe=recipe)
    flat = x.reshape(len(x), -1) if x.ndim == 2 else x.reshape(-1, 1)
    set_statistics(model, flat.mean(0), flat.std(0))
    return model


def _same(a: nn.Module, b: nn.Module, atol: float) -> None:
    for (name, wa), wb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(wb, wa, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _counting(base: type[Recipe]) -> type[Recipe]:
    """The recipe with its own train_step counting its calls (in this process)."""

    class Counting(base):  # type: ignore[valid-type, misc]
        calls = 0

        def train_step(self, model, xb, yb, optimizers, penalty):  # type: ignore[no-untyped-def]
            type(self).calls += 1
            return super().train_step(model, xb, yb, optimizers, penalty)

    return Counting


def test_model_mode_trains_a_batchnorm_recipe_with_its_own_step_like_one_device(examples: Path) -> None:
    """signal_bn (BatchNorm, a frozen Conv1d, label smoothing, its own train_step with
    clipping) cut into 3 stages: the steps fit takes on one device, its train_step each time."""
    cls = _counting(type(load_recipe("signal_bn:SignalNet")))
    x, y = _signals(45)  # batches of 16, 16, 13
    inputs = ModelInputs("classification", (2, 32), 5)
    ref, model = _model(cls(), inputs, x), _model(cls(), inputs, x)
    frozen = model[0].weight.detach().clone()
    ref_loss = fit(ref, x, y, epochs=2, batch_size=16, **KW)
    calls = cls.calls
    result = fit_parallel(model, x, y, epochs=2, batch_size=16, parallel="model:stages=3", **KW)
    assert cls.calls - calls == 6  # the recipe's own step, once per batch
    assert result.config == "model:stages=3,map=0/1-5/6-8"  # an nn.Sequential's children
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    _same(ref, model, atol=1e-6)  # BatchNorm statistics and counters included
    assert torch.equal(model[0].weight, frozen)  # frozen: never trained


def test_data_replicas_of_a_recipe_equal_one_device(examples: Path) -> None:
    """FocalMLP (custom loss) with 2 gloo replicas: shards of 8/7 rows and a last batch of one
    row (fewer rows than replicas: trained whole by both) give fit's weights."""
    recipe = load_recipe("tabular_loss:FocalMLP", '{"width": 8}')
    x, y = _table(46)  # batches 15, 15, 15, 1
    inputs = ModelInputs("classification", (6,), 2)
    ref, model = _model(recipe, inputs, x), _model(recipe, inputs, x)
    ref_loss = fit(ref, x, y, epochs=2, batch_size=15, **KW)
    result = fit_parallel(model, x, y, epochs=2, batch_size=15,
                          parallel="data:replicas=2,timeout=120", **KW)
    assert (result.mode, result.workers) == ("data", 2)
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    _same(ref, model, atol=1e-6)


def test_data_replicas_run_a_batchnorm_recipe_with_its_step(examples: Path) -> None:
    """signal_bn on 2 replicas: it trains (each replica's BatchNorm normalises its own shard, so
    it is not fit's step: the math differs), the frozen layer stays, the counters count."""
    recipe = load_recipe("signal_bn:SignalNet")
    x, y = _signals(40)
    model = _model(recipe, ModelInputs("classification", (2, 32), 5), x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = fit_parallel(model, x, y, epochs=1, batch_size=20, lr=1e-2, seed=0,
                          parallel="data:replicas=2,timeout=120")
    after = model.state_dict()
    assert np.isfinite(result.loss)
    assert torch.equal(after["0.weight"], before["0.weight"])  # frozen
    assert not torch.equal(after["5.weight"], before["5.weight"])  # trained
    assert int(after["1.num_batches_tracked"]) == 2  # two steps


def test_pipeline_of_a_recipe_equals_one_device(examples: Path) -> None:
    """FocalMLP in 2 pipeline stages x 3 micro-batches (padded): fit's steps with its loss."""
    recipe = load_recipe("tabular_loss:FocalMLP", '{"width": 8}')
    x, y = _table(40)  # batches 16, 16, 8: micro-batches of 6 rows, some padded
    inputs = ModelInputs("classification", (6,), 2)
    ref, model = _model(recipe, inputs, x), _model(recipe, inputs, x)
    assert layer_names(model) == ["0", "1", "2", "3"]
    ref_loss = fit(ref, x, y, epochs=2, batch_size=16, **KW)
    result = fit_parallel(model, x, y, epochs=2, batch_size=16,
                          parallel="pipeline:stages=2,microbatches=3,timeout=120", **KW)
    assert result.config == "pipeline:microbatches=3,map=0-2/3,timeout=120"
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    _same(ref, model, atol=2e-6)


class Blocks(nn.Module):
    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(features, 8), nn.ReLU())
        self.head = nn.Linear(8, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BlockRecipe(Recipe):
    """A model that is not an nn.Sequential; its recipe names its layers."""

    name = "blocks"
    version = "1"

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        return Blocks(inputs.input_shape[0], inputs.num_outputs)

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]] | None:
        return [("features", model.features), ("head", model.head)]


class Opaque(BlockRecipe):
    name = "opaque"

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]] | None:
        return None


class Skipping(BlockRecipe):
    name = "skipping"

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        model = super().build_model(inputs)
        model.forward = lambda x: model.head(model.features(x)) + 1.0  # more than the chain
        return model


def test_a_recipe_layers_hook_cuts_its_model(examples: Path) -> None:
    x, y = _table(30)
    inputs = ModelInputs("classification", (6,), 2)
    ref, model = _model(BlockRecipe(), inputs, x), _model(BlockRecipe(), inputs, x)
    ref_loss = fit(ref, x, y, epochs=1, batch_size=10, **KW)
    result = fit_parallel(model, x, y, epochs=1, batch_size=10, parallel="model:map=features/head",
                          **KW)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    _same(ref, model, atol=1e-7)


@pytest.mark.parametrize(("recipe", "parallel", "needle"), [
    (Opaque(), "model:stages=2", r"recipe opaque version 1 builds a Blocks that is not an "
                                 r"nn.Sequential.*layers\(model\).*parallel mode 'model'"),
    (Skipping(), "model:stages=2", r"do not compute the model's forward"),
])
def test_a_model_that_cannot_be_cut_is_refused(recipe: Recipe, parallel: str, needle: str) -> None:
    x, y = _table(20)
    model = _model(recipe, ModelInputs("classification", (6,), 2), x)
    with pytest.raises(ConfigError, match=needle):
        fit_parallel(model, x, y, epochs=1, batch_size=10, lr=0.01, seed=0, parallel=parallel)


def test_pipeline_refuses_batchnorm_and_an_own_train_step(examples: Path) -> None:
    x, y = _signals(20)
    model = _model(load_recipe("signal_bn:SignalNet"), ModelInputs("classification", (2, 32), 5), x)
    with pytest.raises(ConfigError, match=r"recipe signal-bn version 1\.0's model has BatchNorm.*"
                                          r"Use parallel=model:stages=S"):
        fit_parallel(model, x, y, epochs=1, batch_size=10, lr=0.01, seed=0, parallel="pipeline")
    png = load_recipe("png_cnn:PngCNN", '{"channels": 4}')  # its own train_step (clipping, AMP)
    images = np.random.default_rng(0).random((12, 1, 8, 8)).astype(np.float32)
    model = _model(png, ModelInputs("classification", (1, 8, 8), 10), images)
    with pytest.raises(ConfigError, match=r"cannot call recipe png-cnn version 1\.0's own "
                                          r"train_step \(PngCNN\.train_step"):
        fit_parallel(model, images, np.arange(12) % 10, epochs=1, batch_size=6, lr=0.01, seed=0,
                     parallel="pipeline")


def test_a_loss_that_couples_rows_is_refused_for_shards(examples: Path) -> None:
    class Coupled(BlockRecipe):
        name = "coupled"
        per_sample_loss = False

    x, y = _table(20)
    model = _model(Coupled(), ModelInputs("classification", (6,), 2), x)
    with pytest.raises(ConfigError, match=r"recipe coupled version 1's loss couples the rows.*"
                                          r"parallel=model:stages=S"):
        fit_parallel(model, x, y, epochs=1, batch_size=10, lr=0.01, seed=0, parallel="data")

"""Patient-level DP-SGD trains with a recipe's own ``train_step`` (docs/recipes.md, "DP-SGD and
a recipe's train_step"): its step runs on Opacus's private module and optimizer, and the
privacy accounting is the plan's, as for the built-in models."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch
from fedsplit.client.models import build_model
from fedsplit.client.privacy.agent import check_dp_model, train_private
from fedsplit.client.privacy.dpsgd import plan_noise
from fedsplit.client.privacy.ledger import LedgerAccount, compose_epsilon
from fedsplit.client.recipes import ModelInputs, Recipe
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import DPSpec
from torch import nn

CFG = RunConfig(dp="level=patient,epsilon=5,delta=1e-5,rounds=3", batch_size=32, lr=0.05)


class Clipping(Recipe):
    """A recipe with its own step: it counts its calls, sees the model's own attributes and
    clips the gradient (which Opacus's per-sample clipping then supersedes)."""

    name: ClassVar[str] = "clipping"
    version: ClassVar[str] = "1"
    tasks: ClassVar[tuple[str, ...]] = ("classification",)
    calls: ClassVar[list[int]] = []

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        return nn.Sequential(nn.Linear(inputs.input_shape[0], 8), nn.ReLU(),
                             nn.Linear(8, inputs.num_outputs))

    def train_step(self, model, xb, yb, optimizers, penalty):  # type: ignore[no-untyped-def]
        assert model.spec.task == "classification"  # the model's own attribute, through the view
        (opt,) = optimizers
        opt.zero_grad()
        loss = self.loss(model, model(xb), yb)
        (loss + penalty()).backward()
        assert all(p.grad_sample is not None for p in model.parameters())  # Opacus's module ran
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        type(self).calls.append(len(xb))
        return float(loss.item())


class TwoOptimizers(Clipping):
    name: ClassVar[str] = "two-optimizers"

    def optimizers(self, model, lr):  # type: ignore[no-untyped-def]
        return [torch.optim.Adam(model[0].parameters(), lr=lr),
                torch.optim.SGD(model[2].parameters(), lr=lr)]


def _model(recipe: Recipe) -> nn.Module:
    return build_model(recipe.model_spec(ModelInputs("classification", (4,), 2)), seed=0,
                       recipe=recipe)


def test_dp_sgd_runs_the_recipes_own_step_and_accounts_as_planned(tmp_path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "north.csv").write_text("x,y\n1,0\n")
    account = LedgerAccount(tmp_path / "state", "north", tmp_path / "north.csv", "run", None)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = _model(Clipping())
    before = [p.detach().clone() for p in model.parameters()]
    spec = DPSpec.parse(CFG.dp)
    Clipping.calls.clear()
    epsilons = []
    for server_round in (1, 2):
        loss, epsilon = train_private(model, x, y, spec, CFG, steps=6, server_round=server_round,
                                      account=account, seed=server_round, proximal_mu=0.0,
                                      device=torch.device("cpu"))
        assert np.isfinite(loss)
        epsilons.append(epsilon)
    assert len(Clipping.calls) == 12 and all(n > 0 for n in Clipping.calls)  # its step, every batch
    plan = plan_noise(spec, len(x), CFG.batch_size, 6)
    one = (plan.noise_multiplier, plan.sample_rate, plan.steps_per_round)
    assert epsilons == [pytest.approx(compose_epsilon([one], spec.delta)),
                        pytest.approx(compose_epsilon([one, one], spec.delta))]
    assert 0 < epsilons[0] < epsilons[1] <= spec.epsilon  # the accounting advances as before
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_a_recipe_with_several_optimizers_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"recipe two-optimizers version 1's optimizers\(model, "
                                          r"lr\) returns 2.*Received: \['Adam', 'SGD'\]"):
        check_dp_model(_model(TwoOptimizers()), DPSpec.parse(CFG.dp), CFG)

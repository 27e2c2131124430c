"""The model a hospital trains, and how any party rebuilds it from its id.

A model is fully described by a `ModelSpec`, whose id string travels with the weights
(weight-file attribute ``model``, Flower config ``model-id``) so any party can rebuild it. The
code that builds it is a recipe (`client.recipes`): the built-in MLP (tables) and the seed's small
CNN (images) keep their short ids (``mlp/classification/30/2/64-32``); any other recipe's id is
``recipe:`` + JSON with the recipe's name, version and parameters (`protocol.recipe`), so a
weight file records the recipe it was trained with.

Input standardisation (and, for regression, target scaling) are buffers inside the model,
so a weight file scores raw features on its own. With ``norm="batch"`` the MLP has a
BatchNorm1d after each hidden layer (Linear -> BatchNorm1d -> ReLU); its running statistics and
its integer ``num_batches_tracked`` counter are buffers that travel and are aggregated like
every parameter (integers as float64 on the wire: `protocol.update.state_dict_arrays`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fedsplit.client.recipes import Recipe, Standardize, recipe_for
from fedsplit.client.recipes.builtin import SiteModel
from fedsplit.client.recipes.spec import KINDS, NORMS, RECIPE_KIND, ModelSpec
from fedsplit.protocol.errors import ConfigError
from torch import nn

__all__ = ["KINDS", "NORMS", "RECIPE_KIND", "ModelSpec", "SiteModel", "Standardize",
           "build_model", "has_batch_norm", "load_model", "recipe_of"]


def build_model(spec: ModelSpec | str, *, seed: int | None = None, recipe: Recipe | None = None,
                strict: bool = False) -> nn.Module:
    """Build a model from a spec or its id with its recipe; ``seed`` makes the initial weights
    reproducible.

    ``recipe``: this party's own recipe, which must match the one the spec names (with ``strict``
    also its parameters: `client.recipes.recipe_for`); without it, built-ins and recipes this
    process has loaded are found by name. The model gets ``spec`` (when the recipe did not set
    one) and ``fedsplit_recipe`` attributes, read by the trainer (`recipe_of`).
    """
    if isinstance(spec, str):
        spec = ModelSpec.from_id(spec)
    impl = recipe_for(spec.identity, recipe, strict=strict, where=spec.where)
    if seed is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = impl.build_model(spec.inputs)
    else:
        model = impl.build_model(spec.inputs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"Recipe {impl.name}'s build_model must return a torch.nn.Module. "
                          f"Received: {type(model).__name__}")
    if getattr(model, "spec", None) is None:
        model.spec = spec
    model.fedsplit_recipe = impl
    return model


def recipe_of(model: nn.Module) -> Recipe:
    """The recipe a model built by `build_model` trains and scores with."""
    impl = getattr(model, "fedsplit_recipe", None)
    if impl is not None:
        return impl
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ConfigError(f"This model was not built by fedsplit's build_model, so its recipe is "
                          f"unknown. Received: {type(model).__name__}")
    impl = recipe_for(spec.identity)
    model.fedsplit_recipe = impl
    return impl


def load_model(path: str | Path, *, recipe: Recipe | None = None) -> Any:
    """Rebuild the model stored in a fedsplit weight file (needs its ``model`` attribute).

    A recipe model needs its recipe installed and loaded here (``recipe``, or loaded earlier in
    this process); the parameters are the ones the file records.
    """
    from fedsplit.protocol.weights import read_weights

    update = read_weights(path)
    if not update.model:
        raise ConfigError(
            f"{path} has no 'model' attribute, so its architecture is unknown. Use a model written "
            f"by the fedsplit coordinator (global.h5). Received: model=None"
        )
    model = build_model(update.model, recipe=recipe)
    model.load_state_dict(update.to_state_dict(like=model.state_dict()))
    return model


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` holds a BatchNorm layer (it cannot train on a batch of one row)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())

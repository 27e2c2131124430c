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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fedsplit.client.recipes import ModelInputs, Recipe, Standardize, builtin_recipe, recipe_for
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import RecipeIdentity, RecipeModelId, is_recipe_id
from torch import nn

KINDS = ("mlp", "cnn")  # the built-in recipes' models; any other recipe's spec has kind "recipe"
RECIPE_KIND = "recipe"
TASKS = ("classification", "regression")  # the built-ins' tasks; a recipe may define others
NORMS = ("none", "batch")

__all__ = ["KINDS", "NORMS", "RECIPE_KIND", "TASKS", "ModelSpec", "SiteModel", "Standardize",
           "build_model", "has_batch_norm", "load_model", "recipe_of"]


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a site model.

    Parameters
    ----------
    kind : str
        ``"mlp"`` (tables) or ``"cnn"`` (images: Conv2D 32 -> max-pool -> dense 128 -> classes).
    task : str
        ``"classification"`` (softmax over ``num_outputs`` classes) or ``"regression"`` (one output).
    input_shape : tuple[int, ...]
        ``(num_features,)`` for an MLP, ``(channels, height, width)`` for a CNN.
    num_outputs : int
        Number of classes (classification) or 1 (regression).
    hidden : tuple[int, ...] (default: (64, 32))
        MLP hidden layer widths (``()``: no hidden layer, i.e. logistic / linear regression,
        id part ``-``); ignored by the CNN.
    norm : str (default: "none")
        ``"batch"``: a BatchNorm1d after each MLP hidden layer. The CNN takes ``"none"`` only.
    recipe : RecipeIdentity | None (default: None)
        With ``kind="recipe"``: the recipe (name, version, params) that builds the model; its
        task may be any the recipe trains, and ``hidden``/``norm`` are unused.
    selection : str (default: "")
        With ``kind="recipe"``: the recipe's selection metric (it travels in the model id, so the
        coordinator keeps rounds by it without running recipe code).
    """

    kind: str
    task: str
    input_shape: tuple[int, ...]
    num_outputs: int
    hidden: tuple[int, ...] = field(default=(64, 32))
    norm: str = "none"
    recipe: RecipeIdentity | None = field(default=None, hash=False)
    selection: str = ""

    def __post_init__(self) -> None:
        if self.kind == RECIPE_KIND:
            if self.recipe is None or not self.task or self.num_outputs < 1 or (
                    not self.input_shape or min(self.input_shape) < 1):
                raise ConfigError(
                    f"A recipe model needs its recipe identity, a task, positive input dimensions "
                    f"and at least one output. Received: recipe={self.recipe}, task={self.task!r}, "
                    f"input_shape={self.input_shape}, num_outputs={self.num_outputs}"
                )
            return
        if self.recipe is not None and self.recipe != self.identity:
            raise ConfigError(f"A built-in {self.kind} spec carries another recipe. "
                              f"Received: {self.recipe}")
        if self.kind not in KINDS:
            raise ConfigError(f"Model kind must be one of {KINDS}. Received: {self.kind!r}")
        if self.task not in TASKS:
            raise ConfigError(f"Task must be one of {TASKS}. Received: {self.task!r}")
        want = 1 if self.kind == "mlp" else 3
        if len(self.input_shape) != want or min(self.input_shape) < 1:
            raise ConfigError(
                f"A {self.kind} needs an input shape of {want} positive dimension(s). "
                f"Received: {self.input_shape}"
            )
        if self.task == "regression" and self.num_outputs != 1:
            raise ConfigError(f"Regression has one output. Received: {self.num_outputs}")
        if self.task == "classification" and self.num_outputs < 2:
            raise ConfigError(
                f"Classification needs at least 2 classes. Received: {self.num_outputs}"
            )
        if self.norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}. Received: {self.norm!r}")
        if self.norm != "none" and self.kind != "mlp":
            raise ConfigError(
                f"norm={self.norm} adds BatchNorm after the MLP's hidden layers; the {self.kind} "
                f"has none. Use model=mlp or norm=none. Received: kind={self.kind!r}, "
                f"norm={self.norm!r}"
            )

    @property
    def identity(self) -> RecipeIdentity:
        """The recipe that builds this model (the built-in ``mlp``/``cnn`` or the spec's own)."""
        if self.kind == RECIPE_KIND:
            assert self.recipe is not None
            return self.recipe
        return builtin_recipe(self.kind, hidden=self.hidden, norm=self.norm).identity

    @property
    def inputs(self) -> ModelInputs:
        """Task, input shape and outputs (what the recipe builds the model for)."""
        return ModelInputs(self.task, tuple(self.input_shape), int(self.num_outputs))

    def to_id(self) -> str:
        """Return the id string, e.g. ``mlp/classification/30/2/64-32`` (``.../64-32/batch``
        with BatchNorm; ids without the sixth part, as older runs wrote them, mean no norm), or
        ``recipe:{...}`` for a recipe's model."""
        if self.kind == RECIPE_KIND:
            assert self.recipe is not None
            return RecipeModelId(self.recipe, self.task, tuple(self.input_shape),
                                 int(self.num_outputs), self.selection or "accuracy").to_id()
        shape = "x".join(map(str, self.input_shape))
        hidden = ("-".join(map(str, self.hidden)) or "-") if self.kind == "mlp" else "-"
        norm = "" if self.norm == "none" else f"/{self.norm}"
        return f"{self.kind}/{self.task}/{shape}/{self.num_outputs}/{hidden}{norm}"

    @classmethod
    def from_id(cls, model_id: str) -> ModelSpec:
        """Parse an id made by `to_id`."""
        if is_recipe_id(model_id):
            ref = RecipeModelId.from_id(model_id)
            return cls(kind=RECIPE_KIND, task=ref.task, input_shape=ref.input_shape,
                       num_outputs=ref.num_outputs, recipe=ref.recipe, selection=ref.selection)
        parts = model_id.split("/")
        try:
            if len(parts) not in (5, 6):
                raise ValueError(f"{len(parts)} parts")
            kind, task, shape, outputs, hidden = parts[:5]
            norm = parts[5] if len(parts) == 6 else "none"
            if len(parts) == 6 and norm == "none":
                raise ValueError("the norm part is written only when it is not none")
            return cls(
                kind=kind,
                task=task,
                input_shape=tuple(int(d) for d in shape.split("x")),
                num_outputs=int(outputs),
                hidden=tuple(int(h) for h in hidden.split("-")) if hidden != "-" else (),
                norm=norm,
            )
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"Not a fedsplit model id (expected kind/task/shape/outputs/hidden[/norm], e.g. "
                f"'mlp/classification/30/2/64-32' or 'mlp/classification/30/2/64-32/batch'). "
                f"Received: {model_id!r}"
            ) from e


class SiteModel(nn.Module):
    """Standardisation, a body (MLP or CNN), and for regression an output rescaling."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.norm = Standardize(spec.input_shape if spec.kind == "mlp" else (1,))
        if spec.kind == "mlp":
            layers: list[nn.Module] = []
            width = spec.input_shape[0]
            for h in spec.hidden:
                layers.append(nn.Linear(width, h))
                if spec.norm == "batch":
                    layers.append(nn.BatchNorm1d(h))
                layers.append(nn.ReLU())
                width = h
            layers.append(nn.Linear(width, spec.num_outputs))
            self.body = nn.Sequential(*layers)
        else:
            channels, height, width = spec.input_shape
            flat = 32 * (height // 2) * (width // 2)
            self.body = nn.Sequential(
                nn.Conv2d(channels, 32, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(flat, 128),
                nn.ReLU(),
                nn.Linear(128, spec.num_outputs),
            )
        self.register_buffer("target_mean", torch.zeros(1))
        self.register_buffer("target_std", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits, or the standardised regression output."""
        return self.body(self.norm(x))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Return class indices, or regression values in target units."""
        out = self.forward(x)
        if self.spec.task == "classification":
            return out.argmax(dim=1)
        return out.squeeze(1) * self.target_std + self.target_mean


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
    where = "The model" if spec.kind == RECIPE_KIND else f"Model {spec.to_id()}"
    impl = recipe_for(spec.identity, recipe, strict=strict, where=where)
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

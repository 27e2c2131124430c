"""What any party needs to rebuild a model: its `ModelSpec` (and so its id) and `ModelInputs`.

The built-in MLP and CNN keep their short ids (``mlp/classification/30/2/64-32``); any other
recipe's model id is ``recipe:`` + JSON (`protocol.recipe.RecipeModelId`). Nothing here runs
recipe code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.recipe import (
    BUILTIN_RECIPES,
    BUILTIN_VERSION,
    RECIPE_KIND,
    RecipeIdentity,
    RecipeModelId,
    builtin_identity,
    is_recipe_id,
)
from fedsplit.protocol.tasks import task_kind

KINDS = BUILTIN_RECIPES  # the built-in recipes' models; any other recipe's spec has kind "recipe"
NORMS = ("none", "batch")
__all__ = ["BUILTIN_VERSION", "KINDS", "NORMS", "RECIPE_KIND", "ModelInputs", "ModelSpec"]


@dataclass(frozen=True)
class ModelInputs:
    """What the federation agreed about a model's inputs and outputs before round 1.

    Parameters
    ----------
    task : str
        The task (``classification``, ``regression``, or one a recipe defines).
    input_shape : tuple[int, ...]
        One row's shape: ``(features,)`` for a table, ``(channels, height, width)`` for images.
    num_outputs : int
        Classes for classification, else what the task needs (1 for regression).
    """

    task: str
    input_shape: tuple[int, ...]
    num_outputs: int


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
        task = task_kind(self.task)  # the built-ins train kinds whose labels are classes or values
        if not (task.classes or task.values):
            raise ConfigError(f"The built-in {self.kind} trains tasks whose labels are classes or "
                              f"values; {self.task}'s are {task.labels}: use its recipe "
                              f"({task.recipe or 'a recipe for it'}). Received: {self.task!r}")
        want = 1 if self.kind == "mlp" else 3
        if len(self.input_shape) != want or min(self.input_shape) < 1:
            raise ConfigError(
                f"A {self.kind} needs an input shape of {want} positive dimension(s). "
                f"Received: {self.input_shape}"
            )
        if task.values and self.num_outputs != 1:
            raise ConfigError(f"A task of values ({self.task}) has one output. "
                              f"Received: {self.num_outputs}")
        if task.classes and self.num_outputs < 2:
            raise ConfigError(
                f"A task of classes ({self.task}) needs at least 2 classes. "
                f"Received: {self.num_outputs}"
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
        return builtin_identity(self.kind, self.hidden, self.norm)

    @property
    def where(self) -> str:
        """How messages name the model: ``Model <short id>``, or ``The model`` (a recipe's id is
        long JSON; messages name its recipe instead)."""
        return "The model" if self.kind == RECIPE_KIND else f"Model {self.to_id()}"

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

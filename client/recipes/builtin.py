"""The built-in recipes: the MLP for tables and the lecture's small CNN for images.

Both train classification (cross-entropy, accuracy) and regression (mean squared error on
standardised targets, r2, rmse) with the `Recipe` defaults; they only build their model
(`client.models.SiteModel`) and keep the short model ids older weight files carry
(``mlp/classification/30/2/64-32``, ``cnn/classification/1x8x8/10/-``). Their identity
(name ``mlp`` or ``cnn``, version `BUILTIN_VERSION`, the MLP's ``hidden`` and ``norm``) is
compared between hospitals like any recipe's.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from fedsplit.client.recipes.base import Recipe, Standardize
from fedsplit.client.recipes.spec import BUILTIN_VERSION, ModelInputs, ModelSpec
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.tasks import task_kind
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn


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
        if task_kind(self.spec.task).classes:
            return out.argmax(dim=1)
        return out.squeeze(1) * self.target_std + self.target_mean


class MLPParams(BaseModel):
    """Parameters of the built-in MLP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: list[int] = Field(default_factory=lambda: [64, 32],
                              description="Hidden layer widths ([]: logistic/linear regression).")
    norm: Literal["none", "batch"] = Field("none", description="BatchNorm1d after each hidden layer.")

    @field_validator("hidden", mode="before")
    @classmethod
    def _dashes(cls, value: Any) -> Any:
        if isinstance(value, str):  # the run config's "64-32" form
            try:
                return [int(h) for h in value.split("-") if h.strip()]
            except ValueError as e:
                raise ValueError(f"hidden is dash-separated widths like 64-32; got {value!r}") from e
        return value

    @field_validator("hidden")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(h < 1 for h in value):
            raise ValueError(f"hidden widths must be >= 1; got {value}")
        return value


class MLP(Recipe):
    """Standardisation, Linear/ReLU hidden layers (optionally BatchNorm), a linear output."""

    name: ClassVar[str] = "mlp"
    version: ClassVar[str] = BUILTIN_VERSION
    Params: ClassVar[type[BaseModel]] = MLPParams

    def model_spec(self, inputs: ModelInputs) -> ModelSpec:
        """The short-form spec ``mlp/task/features/outputs/hidden[/norm]``."""
        self.check_task(inputs.task)
        return ModelSpec(kind="mlp", task=inputs.task, input_shape=tuple(inputs.input_shape),
                         num_outputs=int(inputs.num_outputs), hidden=tuple(self.params.hidden),
                         norm=self.params.norm)

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """The `SiteModel` MLP."""
        return SiteModel(self.model_spec(inputs))

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """``norm``, ``body.0`` ... ``body.N`` (`site_model_layers`)."""
        return site_model_layers(model)


class CNN(Recipe):
    """The lecture's CNN: Conv2d 32 (3x3) -> ReLU -> max-pool 2 -> dense 128 -> outputs."""

    name: ClassVar[str] = "cnn"
    version: ClassVar[str] = BUILTIN_VERSION

    def model_spec(self, inputs: ModelInputs) -> ModelSpec:
        """The short-form spec ``cnn/task/CxHxW/outputs/-``."""
        self.check_task(inputs.task)
        return ModelSpec(kind="cnn", task=inputs.task, input_shape=tuple(inputs.input_shape),
                         num_outputs=int(inputs.num_outputs))

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """The `SiteModel` CNN."""
        return SiteModel(self.model_spec(inputs))

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """``norm``, ``body.0`` ... ``body.N`` (`site_model_layers`)."""
        return site_model_layers(model)


def site_model_layers(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """A `SiteModel`'s layers in forward order: ``norm``, then ``body.0`` ... ``body.N`` (the
    names device maps use, docs/site-parallel.md)."""
    if not isinstance(model, SiteModel):
        return None
    return [("norm", model.norm), *((f"body.{i}", m) for i, m in enumerate(model.body))]


BUILTINS: dict[str, type[Recipe]] = {"mlp": MLP, "cnn": CNN}


def builtin_recipe(kind: str, *, hidden: tuple[int, ...] | list[int] = (64, 32),
                   norm: str = "none") -> Recipe:
    """The built-in recipe of a model kind (``mlp`` with its hidden widths and norm, or ``cnn``)."""
    if kind == "mlp":
        return MLP({"hidden": list(hidden), "norm": norm})
    if kind == "cnn":
        if norm != "none":
            raise ConfigError(f"norm={norm} adds BatchNorm after the MLP's hidden layers; the cnn "
                              f"has none. Use norm=none. Received: norm={norm!r}")
        return CNN()
    raise ConfigError(f"Built-in models are {', '.join(BUILTINS)}. Received: {kind!r}")


def builtin_for_data(model: str, data_kind: str, *, hidden: tuple[int, ...] | list[int] = (64, 32),
                     norm: str = "none") -> Recipe:
    """The built-in recipe a hospital without a recipe trains: the run config's ``model``, or
    with ``auto`` the MLP for tables (data kind ``mlp``) and the CNN for anything else."""
    kind = model if model != "auto" else ("mlp" if data_kind == "mlp" else "cnn")
    return builtin_recipe(kind, hidden=hidden, norm=norm)

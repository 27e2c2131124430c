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

from fedsplit.client.recipes.base import ModelInputs, Recipe
from fedsplit.protocol.errors import ConfigError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

BUILTIN_VERSION = "1"


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

    def model_spec(self, inputs: ModelInputs) -> Any:
        """The short-form spec ``mlp/task/features/outputs/hidden[/norm]``."""
        from fedsplit.client.models import ModelSpec

        self.check_task(inputs.task)
        return ModelSpec(kind="mlp", task=inputs.task, input_shape=tuple(inputs.input_shape),
                         num_outputs=int(inputs.num_outputs), hidden=tuple(self.params.hidden),
                         norm=self.params.norm)

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """The `SiteModel` MLP."""
        from fedsplit.client.models import SiteModel

        return SiteModel(self.model_spec(inputs))


class CNN(Recipe):
    """The lecture's CNN: Conv2d 32 (3x3) -> ReLU -> max-pool 2 -> dense 128 -> outputs."""

    name: ClassVar[str] = "cnn"
    version: ClassVar[str] = BUILTIN_VERSION

    def model_spec(self, inputs: ModelInputs) -> Any:
        """The short-form spec ``cnn/task/CxHxW/outputs/-``."""
        from fedsplit.client.models import ModelSpec

        self.check_task(inputs.task)
        return ModelSpec(kind="cnn", task=inputs.task, input_shape=tuple(inputs.input_shape),
                         num_outputs=int(inputs.num_outputs))

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """The `SiteModel` CNN."""
        from fedsplit.client.models import SiteModel

        return SiteModel(self.model_spec(inputs))


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

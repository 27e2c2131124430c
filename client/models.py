"""The models a hospital trains: an MLP for tables and the seed's small CNN for images.

A model is fully described by a `ModelSpec`, whose id string travels with the weights
(weight-file attribute ``model``, Flower config ``model-id``) so any party can rebuild it.
Input standardisation (and, for regression, target scaling) are buffers inside the model,
so a weight file scores raw features on its own. With ``norm="batch"`` the MLP has a
BatchNorm1d after each hidden layer (Linear -> BatchNorm1d -> ReLU); its running statistics and
its integer ``num_batches_tracked`` counter are buffers that travel and are aggregated like
every parameter (integers as float64 on the wire: `protocol.update.state_dict_arrays`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from fedsplit.protocol.errors import ConfigError
from torch import nn

KINDS = ("mlp", "cnn")
TASKS = ("classification", "regression")
NORMS = ("none", "batch")


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
    """

    kind: str
    task: str
    input_shape: tuple[int, ...]
    num_outputs: int
    hidden: tuple[int, ...] = field(default=(64, 32))
    norm: str = "none"

    def __post_init__(self) -> None:
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

    def to_id(self) -> str:
        """Return the id string, e.g. ``mlp/classification/30/2/64-32`` (``.../64-32/batch``
        with BatchNorm; ids without the sixth part, as older runs wrote them, mean no norm)."""
        shape = "x".join(map(str, self.input_shape))
        hidden = ("-".join(map(str, self.hidden)) or "-") if self.kind == "mlp" else "-"
        norm = "" if self.norm == "none" else f"/{self.norm}"
        return f"{self.kind}/{self.task}/{shape}/{self.num_outputs}/{hidden}{norm}"

    @classmethod
    def from_id(cls, model_id: str) -> ModelSpec:
        """Parse an id made by `to_id`."""
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


class Standardize(nn.Module):
    """``(x - mean) / std`` with the statistics stored as buffers (they travel with weights)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("std", torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standardise ``x``; missing values (NaN) become the mean."""
        z = (x - self.mean) / self.std
        return torch.nan_to_num(z, nan=0.0)


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


def build_model(spec: ModelSpec | str, *, seed: int | None = None) -> SiteModel:
    """Build a model from a spec or its id; ``seed`` makes the initial weights reproducible."""
    if isinstance(spec, str):
        spec = ModelSpec.from_id(spec)
    if seed is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return SiteModel(spec)
    return SiteModel(spec)


def load_model(path: str | Path) -> SiteModel:
    """Rebuild the model stored in a fedsplit weight file (needs its ``model`` attribute)."""
    from fedsplit.protocol.weights import read_weights

    update = read_weights(path)
    if not update.model:
        raise ConfigError(
            f"{path} has no 'model' attribute, so its architecture is unknown. Use a model written "
            f"by the fedsplit coordinator (global.h5). Received: model=None"
        )
    model = build_model(update.model)
    model.load_state_dict(update.to_state_dict(like=model.state_dict()))
    return model


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` holds a BatchNorm layer (it cannot train on a batch of one row)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())

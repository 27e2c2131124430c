"""A tabular recipe with a custom loss: an MLP for binary outcomes trained with the focal loss.

Lives outside fedsplit (docs/recipes.md, worked example 2): put this file's folder on PYTHONPATH
(or install it in a package) and run ``fedsplit simulate --recipe tabular_loss:FocalMLP``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from fedsplit.client.recipes import ModelInputs, Recipe, Standardize
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class FocalParams(BaseModel):
    """The recipe's parameters: validated, recorded with the run and in every weight file."""

    model_config = ConfigDict(extra="forbid")

    width: int = Field(32, ge=1, description="Hidden layer width.")
    gamma: float = Field(2.0, ge=0, description="Focal loss focusing parameter (0: cross-entropy).")


class FocalMLP(Recipe):
    """Standardised features -> one hidden layer -> class logits, trained with the focal loss."""

    name: ClassVar[str] = "focal-mlp"
    version: ClassVar[str] = "1.0"
    Params: ClassVar[type[BaseModel]] = FocalParams
    tasks: ClassVar[tuple[str, ...]] = ("classification",)

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """Standardize (the federation's pooled statistics land here) + a small MLP."""
        (features,) = inputs.input_shape
        return nn.Sequential(Standardize((features,)), nn.Linear(features, self.params.width),
                             nn.ReLU(), nn.Linear(self.params.width, inputs.num_outputs))

    def loss(self, model: nn.Module, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Focal loss (Lin et al. 2017): cross-entropy down-weighted on easy rows."""
        logp = torch.log_softmax(output, dim=1).gather(1, target[:, None]).squeeze(1)
        return (-(1 - logp.exp()) ** self.params.gamma * logp).mean()

    def metric_names(self, task: str) -> tuple[str, ...]:
        """The metrics `metrics` returns."""
        return ("loss", "accuracy", "balanced-accuracy")

    def selection_metric(self, task: str) -> str:
        """Rounds are kept by balanced accuracy (the classes are imbalanced)."""
        return "balanced-accuracy"

    @torch.no_grad()
    def metrics(self, model: nn.Module, x: np.ndarray, y: np.ndarray,
                device: torch.device) -> dict[str, float]:
        """Loss, accuracy and balanced accuracy (mean recall over the classes present)."""
        base = super().metrics(model, x, y, device)
        pred = self.forward_all(model, x, device).argmax(1).cpu().numpy()
        recalls = [float((pred[y == k] == k).mean()) for k in np.unique(y)]
        return {**base, "balanced-accuracy": float(np.mean(recalls))}

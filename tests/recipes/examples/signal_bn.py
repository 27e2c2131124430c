"""A hospital's own model for 2-lead signals: BatchNorm, a frozen layer, its own reader and loss.

Each hospital's data is one HDF5 file holding ``signals`` (N x 2 x L, float) and ``label`` (N,
integers). The model is a frozen random-feature Conv1d (never trained: ``requires_grad`` off),
two BatchNorm1d layers, and a small head trained with a label-smoothed cross-entropy; its
metrics are balanced accuracy and macro AUROC, and rounds are kept by balanced accuracy. It has
its own `train_step` (gradient clipping) and `predict` (probability of each class and the
predicted class). docs/recipes.md, "Worked example 3", shows this file.
"""

from pathlib import Path
from typing import ClassVar

import h5py
import numpy as np
import torch
from fedsplit.client.data import Dataset
from fedsplit.client.recipes import ModelInputs, Recipe
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class SignalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(16, ge=2, le=256)
    smoothing: float = Field(0.1, ge=0, lt=1)


class SignalNet(Recipe):
    name: ClassVar[str] = "signal-bn"
    version: ClassVar[str] = "1.0"
    Params: ClassVar[type[BaseModel]] = SignalParams
    tasks: ClassVar[tuple[str, ...]] = ("classification",)

    def read_data(self, path: Path) -> Dataset | None:
        if path.suffix != ".h5":
            return None
        with h5py.File(path, "r") as f:
            x = np.asarray(f["signals"], dtype=np.float32)
            y = np.asarray(f["label"], dtype=np.int64)
        return Dataset(x, y, "classification", "signal", [])

    def read_inputs(self, path: Path):
        if path.suffix != ".h5":
            return None
        with h5py.File(path, "r") as f:
            x = np.asarray(f["signals"], dtype=np.float32)
        return x, [str(i) for i in range(len(x))]

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        leads, _length = inputs.input_shape
        k = self.params.width
        features = nn.Conv1d(leads, k, kernel_size=5, padding=2)
        features.requires_grad_(False)  # random features: frozen, never trained
        return nn.Sequential(
            features, nn.BatchNorm1d(k), nn.ReLU(), nn.AdaptiveAvgPool1d(4), nn.Flatten(),
            nn.Linear(4 * k, 32), nn.BatchNorm1d(32), nn.ReLU(),
            nn.Linear(32, inputs.num_outputs),
        )

    def loss(self, model, output, target):
        return nn.functional.cross_entropy(output, target, label_smoothing=self.params.smoothing)

    def metric_names(self, task: str) -> tuple[str, ...]:
        return ("loss", "balanced-accuracy", "macro-auroc")

    def selection_metric(self, task: str) -> str:
        return "balanced-accuracy"

    @torch.no_grad()
    def metrics(self, model, x, y, device) -> dict[str, float]:
        from sklearn.metrics import balanced_accuracy_score, roc_auc_score

        model.eval()
        out = self.forward_all(model, x, device).cpu()
        loss = float(self.loss(model, out, torch.as_tensor(y, dtype=torch.long)))
        probs = torch.softmax(out, dim=1).numpy()
        classes = np.arange(probs.shape[1])
        try:
            auroc = float(roc_auc_score(y, probs, multi_class="ovr", average="macro",
                                        labels=classes)) if probs.shape[1] > 2 else float(
                roc_auc_score(y, probs[:, 1]))
        except ValueError:  # a class missing from these rows
            auroc = 0.5
        return {"loss": loss, "balanced-accuracy": float(balanced_accuracy_score(
            y, probs.argmax(1))), "macro-auroc": auroc}

    def train_step(self, model, xb, yb, optimizers, penalty):
        (opt,) = optimizers
        opt.zero_grad()
        loss = self.loss(model, model(xb), yb)
        (loss + penalty()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        return float(loss.item())

    @torch.no_grad()
    def predict(self, model, x) -> dict[str, np.ndarray]:
        model.eval()
        probs = torch.softmax(self.forward_all(model, x, torch.device("cpu")), dim=1).numpy()
        return {**{f"p_{k}": probs[:, k] for k in range(probs.shape[1])},
                "predicted": probs.argmax(1)}

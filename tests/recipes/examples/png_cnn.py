"""An image recipe: a small CNN on each hospital's folder of PNG files.

Lives outside fedsplit (docs/recipes.md, worked example 1). A hospital's data is a folder with
one sub-folder per class, named by the class index (``0/``, ``1/``, ...), holding grayscale PNG
files; ``fedsplit predict`` also takes a flat folder of PNG files (no labels).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from fedsplit.client.data import Dataset
from fedsplit.client.recipes import ModelInputs, Recipe, Standardize
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class PngParams(BaseModel):
    """The recipe's parameters."""

    model_config = ConfigDict(extra="forbid")

    channels: int = Field(16, ge=1, le=256, description="Filters of the convolution.")
    clip: float = Field(5.0, gt=0, description="Gradient norm clipping in each training step.")


def _image(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("L"), dtype=np.float32) / 255.0


class PngCNN(Recipe):
    """Conv 3x3 -> ReLU -> max-pool -> dense 64 -> classes, on standardised grayscale pixels."""

    name: ClassVar[str] = "png-cnn"
    version: ClassVar[str] = "1.0"
    Params: ClassVar[type[BaseModel]] = PngParams
    tasks: ClassVar[tuple[str, ...]] = ("classification",)

    def read_data(self, path: Path) -> Dataset | None:
        """FOLDER/<class index>/*.png -> images (N x 1 x H x W) and labels; None otherwise."""
        if not path.is_dir():
            return None
        classes = sorted((p for p in path.iterdir() if p.is_dir() and p.name.isdigit()),
                         key=lambda p: int(p.name))
        if not classes:
            return None
        files = [(f, int(c.name)) for c in classes for f in sorted(c.glob("*.png"))]
        x = np.stack([_image(f) for f, _ in files])[:, None]
        y = np.array([label for _, label in files], dtype=np.int64)
        return Dataset(x, y, "classification", "image", [])

    def read_inputs(self, path: Path) -> tuple[np.ndarray, list[str]] | None:
        """Every PNG under ``path`` (labelled sub-folders or flat), named by its relative path."""
        if not path.is_dir():
            return None
        files = sorted(path.rglob("*.png"))
        if not files:
            return None
        return (np.stack([_image(f) for f in files])[:, None],
                [str(f.relative_to(path)) for f in files])

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """A Standardize layer gets the federation's pooled pixel mean and std before round 1."""
        channels, height, width = inputs.input_shape
        k = self.params.channels
        return nn.Sequential(
            Standardize((1,)),
            nn.Conv2d(channels, k, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(k * (height // 2) * (width // 2), 64), nn.ReLU(),
            nn.Linear(64, inputs.num_outputs),
        )

    def metric_names(self, task: str) -> tuple[str, ...]:
        """The metrics `metrics` returns."""
        return ("loss", "accuracy", "macro-f1")

    @torch.no_grad()
    def metrics(self, model: nn.Module, x: np.ndarray, y: np.ndarray,
                device: torch.device) -> dict[str, float]:
        """Loss, accuracy and the macro-averaged F1 over the classes present."""
        base = super().metrics(model, x, y, device)
        pred = self.forward_all(model, x, device).argmax(1).cpu().numpy()
        f1 = []
        for k in np.unique(y):
            tp = float(((pred == k) & (y == k)).sum())
            denom = float((pred == k).sum() + (y == k).sum())
            f1.append(2 * tp / denom if denom else 0.0)
        return {**base, "macro-f1": float(np.mean(f1))}

    def train_step(self, model, xb, yb, optimizers, penalty):
        """One step with gradient-norm clipping (and mixed precision on a GPU)."""
        (opt,) = optimizers
        opt.zero_grad()
        with torch.autocast(device_type=xb.device.type, enabled=xb.device.type == "cuda"):
            loss = self.loss(model, model(xb).float(), yb)
        (loss + penalty()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.params.clip)
        opt.step()
        return float(loss.item())

"""A hospital's own recipe for the deployment tests: one HDF5 file per hospital.

Each file holds ``signals`` (N x 2 x L, float) and ``label`` (N, integers); the reader raises
KeyError on a file without labels (as h5py does). ``fail_training`` makes every `train_step`
raise, as a broken hospital's code would. The tests copy this file to a folder that only
PYTHONPATH (or ``sys.path``) reaches, as a hospital's own code would be.
"""

from pathlib import Path
from typing import ClassVar

import h5py
import numpy as np
from fedsplit.client.data import Dataset
from fedsplit.client.recipes import ModelInputs, Recipe
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class SignalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(8, ge=2, le=64)
    fail_training: bool = False


class H5Signals(Recipe):
    name: ClassVar[str] = "h5-signals"
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

    def build_model(self, inputs: ModelInputs) -> nn.Module:
        leads, length = inputs.input_shape
        return nn.Sequential(nn.Flatten(), nn.Linear(leads * length, self.params.width), nn.ReLU(),
                             nn.Linear(self.params.width, inputs.num_outputs))

    def train_step(self, model, xb, yb, optimizers, penalty):
        if self.params.fail_training:
            raise RuntimeError("this hospital's train_step is broken")
        return super().train_step(model, xb, yb, optimizers, penalty)


def write_hospital(path: Path, rows: int, *, seed: int, labels: bool = True, length: int = 32) -> Path:
    """A hospital's file: two leads, the class shifts lead 0's mean (learnable)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, rows)
    x = rng.normal(size=(rows, 2, length)).astype(np.float32)
    x[:, 0] += 1.5 * y[:, None]
    with h5py.File(path, "w") as f:
        f["signals"] = x
        if labels:
            f["label"] = y
    return path

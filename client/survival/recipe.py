"""The survival recipe: a Cox risk model trained by ``fedsplit simulate`` like any recipe.

    fedsplit simulate --site north=north_train.csv:north_test.csv --site ... \\
        --recipe fedsplit.client.survival.recipe:Cox \\
        --recipe-params '{"time": "days", "event": "died", "id_column": "pid", "hidden": []}'

- **Data** (`Cox.read_data`): each hospital's CSV/Parquet table, its time and event columns read
  by `protocol.survival.read_survival` (refused with counts and the fix); covariates are every
  other column except the ID and ``ignore``d ones, in name order, numbers or booleans (1/0,
  TRUE/FALSE, yes/no); a text column is refused (one-hot encode it, or ignore it). The target
  is two columns, (time, event).
- **Model**: the federation's standardisation, then ``Linear(p, 1)`` (``hidden: []``: the linear
  Cox model, FLamby's baseline) or an MLP; its output is the log relative hazard.
- **Loss**: torchsurv's negative Cox partial log-likelihood (Efron ties), divided by the batch's
  number of events. A mini-batch's risk sets hold only the batch's patients, so the mini-batch loss is an
  approximation of the full partial likelihood (docs/survival.md); a batch without an event adds
  nothing. ``penalizer`` P adds lifelines' ridge ``n P ||w||^2 / 2`` (n: the batch's rows) on
  the weights, per event like the likelihood term. It is not a sum over patients, so DP-SGD is
  refused (``per_sample_loss`` False).
- **Metrics**: ``loss`` and Harrell's ``c_index`` (lifelines' ``concordance_index(T, -risk, E)``,
  FLamby's metric), which picks the round.
- **predict**: the log relative hazard per patient (``risk``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from fedsplit.client.data import Dataset, read_table
from fedsplit.client.recipes.base import ModelInputs, Recipe, Standardize
from fedsplit.protocol import survival as sv
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import FALSE_WORDS, TRUE_WORDS, na_set
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

SURVIVAL = "survival"


class CoxParams(BaseModel):
    """Parameters of the survival recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    time: str = Field("T", min_length=1, description="Follow-up time column (positive).")
    event: str = Field("E", min_length=1, description="Event column (1/0, TRUE/FALSE, yes/no).")
    id_column: str = Field("", description="Patient ID column (never a covariate).")
    ignore: list[str] = Field(default_factory=list, description="Columns left out.")
    hidden: list[int] = Field(default_factory=list,
                              description="Hidden widths ([]: the linear Cox model).")
    penalizer: float = Field(0.0, ge=0.0, description="Ridge penalty in lifelines' convention "
                             "(n * P * ||w||^2 / 2 on the standardized inputs' weights).")

    @field_validator("hidden", mode="before")
    @classmethod
    def _dashes(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [] if value in ("", "none") else [int(h) for h in value.split("-")]
        return value


class Cox(Recipe):
    """Cox proportional-hazards risk model (linear or MLP), see the module docstring."""

    name: ClassVar[str] = "cox"
    version: ClassVar[str] = "1"
    Params: ClassVar[type[BaseModel]] = CoxParams
    tasks: ClassVar[tuple[str, ...]] = (SURVIVAL,)
    per_sample_loss: ClassVar[bool] = False

    # --- data -------------------------------------------------------------------------------
    def read_data(self, path: Path) -> Dataset | None:
        """A hospital's survival table as x (covariates) and y = (time, event)."""
        path = Path(path)
        if path.is_dir():  # a hospital's folder: its one table (or the rows a simulation staged)
            files = sorted(f for f in path.iterdir()
                           if f.suffix.lower() in (".csv", ".parquet", ".pq", ".npz"))
            if len(files) != 1:
                raise ConfigError(f"{path} must hold exactly one table (.csv/.parquet) or staged "
                                  f".npz file. Received: {[f.name for f in files]}")
            path = files[0]
        if path.suffix.lower() == ".npz":  # rows a simulation staged for the hospital's agent
            return _staged(path)
        if path.suffix.lower() not in (".csv", ".parquet", ".pq"):
            return None
        p: CoxParams = self.params  # type: ignore[assignment]
        frame = read_table(path)
        t, e = sv.read_survival(str(path), frame, p.time, p.event)
        skip = {p.time, p.event, p.id_column, *p.ignore} - {""}
        names = sorted(str(c) for c in frame.columns if str(c) not in skip)
        if not names:
            raise ConfigError(f"{path} has no covariate besides time, event and ID. "
                              f"Received: columns {list(frame.columns)}")
        x = np.column_stack([_numbers(frame[n].tolist(), n, path) for n in names])
        return Dataset(x.astype(np.float32), np.c_[t, e].astype(np.float32), SURVIVAL, "mlp",
                       names)

    def read_inputs(self, path: Path) -> tuple[np.ndarray, list[str]] | None:
        """Covariates of patients to score (time and event may be absent), ids from the ID column."""
        path = Path(path)
        if path.suffix.lower() not in (".csv", ".parquet", ".pq"):
            return None
        p: CoxParams = self.params  # type: ignore[assignment]
        frame = read_table(path)
        skip = {p.time, p.event, p.id_column, *p.ignore} - {""}
        names = sorted(str(c) for c in frame.columns if str(c) not in skip)
        x = np.column_stack([_numbers(frame[n].tolist(), n, path) for n in names])
        ids = ([str(v) for v in frame[p.id_column]] if p.id_column in frame.columns
               else [str(i) for i in range(len(frame))])
        return x.astype(np.float32), ids

    # --- model ------------------------------------------------------------------------------
    def build_model(self, inputs: ModelInputs) -> nn.Module:
        """Standardisation, then Linear(p, 1) or an MLP with one output (log relative hazard)."""
        p: CoxParams = self.params  # type: ignore[assignment]
        width = int(np.prod(inputs.input_shape))
        layers: list[nn.Module] = [Standardize((width,))]
        for h in p.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        return nn.Sequential(*layers)

    # --- targets, loss, metrics ---------------------------------------------------------------
    def targets(self, model: nn.Module, y: np.ndarray) -> torch.Tensor:
        """(time, event) as an N x 2 float tensor."""
        y = np.asarray(y, dtype=np.float32)
        if y.ndim != 2 or y.shape[1] != 2:
            raise ConfigError(f"The survival recipe's targets are (time, event) pairs. "
                              f"Received: shape {y.shape}")
        return torch.as_tensor(y)

    def loss(self, model: nn.Module, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Negative Cox partial log-likelihood of the batch (torchsurv, Efron ties)."""
        from torchsurv.loss.cox import neg_partial_log_likelihood

        event = target[:, 1] > 0.5
        log_hz = output.reshape(-1)
        if not bool(event.any()):
            return (log_hz * 0.0).sum()  # no event: no risk-set term, no gradient
        with warnings.catch_warnings():  # torchsurv warns that it handles ties: it is asked to
            warnings.simplefilter("ignore", UserWarning)
            total = neg_partial_log_likelihood(log_hz, event, target[:, 0], ties_method="efron",
                                               reduction="sum")
        loss = total / event.sum()
        p: CoxParams = self.params  # type: ignore[assignment]
        if p.penalizer > 0:  # lifelines' n * P * ||w||^2 / 2, per event as the likelihood term
            squares = sum((m.weight ** 2).sum() for m in model.modules()
                          if isinstance(m, nn.Linear))
            loss = loss + p.penalizer * len(log_hz) / event.sum() * 0.5 * squares
        return loss

    def metric_names(self, task: str) -> tuple[str, ...]:
        """``loss`` and ``c_index``."""
        return ("loss", "c_index")

    def selection_metric(self, task: str) -> str:
        """Harrell's C-index picks the round."""
        return "c_index"

    @torch.no_grad()
    def metrics(self, model: nn.Module, x: np.ndarray, y: np.ndarray,
                device: torch.device) -> dict[str, float]:
        """``loss`` and Harrell's ``c_index`` (lifelines, FLamby's convention)."""
        from lifelines.utils import concordance_index

        out = self.forward_all(model, x, device)
        target = self.targets(model, y)
        loss = float(self.loss(model, out, target.to(device)))
        risk = out.reshape(-1).cpu().numpy().astype(np.float64)
        t, e = np.asarray(y, np.float64)[:, 0], np.asarray(y, np.float64)[:, 1]
        try:
            c = float(concordance_index(t, -risk, e))
        except ZeroDivisionError:  # no comparable pair (e.g. no event among these patients)
            c = 0.5
        return {"loss": loss, "c_index": c}

    @torch.no_grad()
    def predict(self, model: nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
        """The log relative hazard per patient."""
        model.eval()
        out = self.forward_all(model, x, torch.device("cpu"))
        return {"risk": out.reshape(-1).numpy().astype(np.float64)}


def _staged(path: Path) -> Dataset:
    """x and (time, event) from the NPZ file `fedsplit simulate` writes for a hospital's agent."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            x, y = npz["x"].astype(np.float32), npz["y"].astype(np.float32)
    except (KeyError, ValueError, OSError) as e:
        raise ConfigError(f"{path} must be an NPZ file with 'x' (covariates) and 'y' (time, "
                          f"event). ({e}) Received: {path.name}") from e
    if x.ndim != 2 or y.ndim != 2 or y.shape[1] != 2 or len(x) != len(y):
        raise ConfigError(f"{path}: 'x' must be N x p and 'y' N x 2 (time, event). "
                          f"Received: x {x.shape}, y {y.shape}")
    return Dataset(x, y, SURVIVAL, "mlp", [f"x_{i}" for i in range(x.shape[1])])


def _numbers(cells: list[Any], column: str, path: Path) -> np.ndarray:
    missing = na_set((), column)
    out = np.empty(len(cells))
    for i, cell in enumerate(cells):
        text = str(cell).strip()
        low = text.lower()
        if low in missing:
            raise ConfigError(f"{path}: column {column!r} has a missing value in row {i + 1}; the "
                              f"survival recipe needs every covariate. Fill it or leave the column "
                              f"out (\"ignore\"). Received: {text!r}")
        try:
            out[i] = float(text)
        except ValueError:
            if low in TRUE_WORDS or low in FALSE_WORDS:
                out[i] = 1.0 if low in TRUE_WORDS else 0.0
            else:
                raise ConfigError(f"{path}: column {column!r} holds text ({text!r}); the survival "
                                  f"recipe reads numbers and yes/no. One-hot encode it or leave it "
                                  f"out (\"ignore\"). Received: {text!r}") from None
    return out

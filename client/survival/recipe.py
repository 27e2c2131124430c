"""The survival recipe: a Cox risk model, trained by ``fedsplit simulate --task survival``.

    fedsplit simulate --site north=north_train.csv:north_test.csv --site ... \\
        --task survival --time days --event died --id-column pid --hidden none --penalizer 0.01

``--task survival`` without ``--recipe`` picks this recipe, with ``--hidden`` (``none``: the
linear Cox model, FLamby's baseline) and ``--penalizer`` as its parameters. It adds no special
case to the trainer:

- **Data**: the hospitals' tables are read like any table (`protocol.schema`): the schema the
  federation agrees on carries both target columns (the time as ``target``, the ``event``), the
  covariates are encoded as for classification (one-hot text, missing indicators), and every
  row's time and event are checked (`protocol.survival.read_survival`: refused with counts and
  the fix). The target is two columns, (time, event).
- **Model**: the federation's standardisation, then ``Linear(p, 1)`` (``hidden: []``) or an MLP;
  its output is the log relative hazard.
- **Loss**: torchsurv's negative Cox partial log-likelihood (Efron ties), divided by the batch's
  number of events. A batch's risk sets hold only the batch's patients, so the trainer gives
  this recipe (``per_sample_loss`` False) whole risk sets: each local step sees all of the
  hospital's training rows, or a sample of ``risk_set_rows`` patients at a larger hospital
  (`client.train.step_batch_size`, docs/survival.md); a batch without an event adds nothing.
  ``penalizer`` P adds lifelines' ridge ``n P ||w||^2 / 2`` (n: the batch's rows) on the
  weights, per event like the likelihood term. It is not a sum over patients, so DP-SGD is
  refused (``per_sample_loss`` False).
- **Metrics**: ``loss`` and Harrell's ``c_index`` (lifelines' ``concordance_index(T, -risk, E)``,
  FLamby's metric), ``auc``, and the pair counts per row (`protocol.survival.pair_rates`): the
  round is picked by the C-index over the hospitals' summed pairs
  (`protocol.survival.pooled_concordance`), not the mean of their noisy C-indices.
- **predict**: the log relative hazard per patient (``risk``).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import numpy as np
import torch
from fedsplit.client.recipes.base import ModelInputs, Recipe, Standardize
from fedsplit.client.survival.cox import concordance_counts
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.survival import pair_rates
from fedsplit.protocol.survival_exact import SOLVERS
from fedsplit.protocol.tasks import SURVIVAL
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn


class CoxParams(BaseModel):
    """Parameters of the survival recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: list[int] = Field(default_factory=list,
                              description="Hidden widths ([]: the linear Cox model).")
    penalizer: float = Field(0.0, ge=0.0, description="Ridge penalty in lifelines' convention "
                             "(n * P * ||w||^2 / 2 on the standardized inputs' weights).")
    solver: str = Field(
        "auto", description="How the federation fits the model (protocol.survival_exact): newton "
        "(the linear model's exact Cox fit, as fedsplit cox), sgd (rounds of local steps), auto "
        "(newton for the linear model under plain FedAvg, else sgd).")

    @model_validator(mode="before")
    @classmethod
    def _columns_are_the_runs(cls, data: Any) -> Any:
        moved = sorted({"time", "event", "id_column", "ignore"} & set(data or {}))
        if moved:
            raise ValueError(f"the survival recipe's columns are the run's: --time, --event, "
                             f"--id-column and --ignore-column (the schema the hospitals agree "
                             f"on carries them). Received: recipe params {moved}")
        return data

    @field_validator("solver")
    @classmethod
    def _solver(cls, value: str) -> str:
        if value not in SOLVERS:
            raise ValueError(f"solver is one of {', '.join(SOLVERS)}. Received: {value!r}")
        return value

    @field_validator("hidden", mode="before")
    @classmethod
    def _dashes(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [] if value in ("", "none") else [int(h) for h in value.split("-")]
        return value


class Cox(Recipe):
    """Cox proportional-hazards risk model (linear or MLP), see the module docstring."""

    name: ClassVar[str] = "cox"
    version: ClassVar[str] = "2"
    Params: ClassVar[type[BaseModel]] = CoxParams
    tasks: ClassVar[tuple[str, ...]] = (SURVIVAL.name,)
    per_sample_loss: ClassVar[bool] = False

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
        """``loss``, ``c_index`` and ``auc`` (the integrated time-dependent AUC)."""
        return ("loss", "c_index", "auc")

    def selection_metric(self, task: str) -> str:
        """Harrell's C-index picks the round."""
        return "c_index"

    @torch.no_grad()
    def metrics(self, model: nn.Module, x: np.ndarray, y: np.ndarray,
                device: torch.device) -> dict[str, float]:
        """``loss``, Harrell's ``c_index`` (lifelines, FLamby's convention) and ``auc``: torchsurv's
        cumulative/dynamic time-dependent AUC at each event time, weighted by the inverse
        probability of censoring estimated on the same patients, integrated over time. Both
        are 0.5 (no information) where the patients allow no comparison (e.g. no event)."""
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
        pairs = pair_rates(*concordance_counts(t, e > 0.5, risk), len(t))
        return {"loss": loss, "c_index": c, "auc": _time_auc(risk, t, e), **pairs}

    @torch.no_grad()
    def predict(self, model: nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
        """The log relative hazard per patient."""
        model.eval()
        out = self.forward_all(model, x, torch.device("cpu"))
        return {"risk": out.reshape(-1).numpy().astype(np.float64)}


def _time_auc(risk: np.ndarray, t: np.ndarray, e: np.ndarray) -> float:
    """torchsurv's integrated cumulative/dynamic AUC with IPCW weights (0.5 when undefined)."""
    from torchsurv.metrics.auc import Auc
    from torchsurv.stats.ipcw import get_ipcw

    event = torch.as_tensor(e > 0.5)
    time = torch.as_tensor(t, dtype=torch.float64)
    if int(event.sum()) < 1 or len(np.unique(t[e > 0.5])) < 2 or len(t) < 3:
        return 0.5
    with warnings.catch_warnings():  # torchsurv warns about ties and small samples
        warnings.simplefilter("ignore")
        try:
            auc = Auc()
            auc(torch.as_tensor(risk, dtype=torch.float64), event, time,
                weight=get_ipcw(event, time))
            value = float(auc.integral())
        except (ValueError, RuntimeError, IndexError, AssertionError):  # too few to compare
            return 0.5
    return value if np.isfinite(value) else 0.5

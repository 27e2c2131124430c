"""What the hospital agent does differently under patient-level DP (`client/app.py` calls it)."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from fedsplit.client.models import SiteModel
from fedsplit.client.privacy.dpsgd import check_budget, check_private_model, fit_private, plan_noise
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import DPSpec


def patient_dp(cfg: RunConfig) -> DPSpec | None:
    """The run's patient-level DP spec, or None (off, or hospital level: the coordinator's)."""
    spec = DPSpec.parse(cfg.dp)
    return spec if spec is not None and spec.level == "patient" else None


def train_private(model: SiteModel, x: np.ndarray, y: np.ndarray, spec: DPSpec, cfg: RunConfig, *,
                  steps: int, server_round: int, site: str, seed: int, proximal_mu: float,
                  device: torch.device) -> tuple[float, float]:
    """DP-SGD for one round within the hospital's budget: (last epoch's loss, epsilon spent).

    Raises `PrivacyBudgetError` (and trains nothing) when this round would exceed the budget.
    """
    if cfg.parallel.split(":", 1)[0].strip() != "none":
        raise ConfigError(f"Patient-level DP trains with Opacus on one device; use parallel=none. "
                          f"Received: parallel={cfg.parallel!r}")
    check_private_model(model, proximal_mu)
    plan = plan_noise(spec, len(x), cfg.batch_size, steps)
    epsilon = check_budget(plan, server_round, site)
    if model.spec.task == "classification":
        targets = torch.as_tensor(y, dtype=torch.long)
        loss_fn: torch.nn.Module = torch.nn.CrossEntropyLoss()
    else:
        scaled = (np.asarray(y, np.float32) - float(model.target_mean)) / float(model.target_std)
        targets = torch.as_tensor(scaled, dtype=torch.float32).reshape(-1, 1)
        loss_fn = torch.nn.MSELoss()
    with warnings.catch_warnings():  # Opacus's notes on secure RNG and backward hooks
        warnings.simplefilter("ignore", UserWarning)
        loss = fit_private(model, x, targets, plan, loss_fn=loss_fn, lr=cfg.lr, seed=seed,
                           device=device)
    for p in model.parameters():  # drop Opacus's per-sample gradients
        p.grad_sample = None
        p.grad = None
    return loss, epsilon

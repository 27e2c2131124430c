"""What the hospital agent does differently under patient-level DP (`client/app.py` calls it)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from fedsplit.client.models import SiteModel, recipe_of
from fedsplit.client.privacy.dpsgd import (
    check_private_model,
    fit_private,
    plan_noise,
    private_optimizer,
)
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import DPSpec

if TYPE_CHECKING:
    from fedsplit.client.privacy.ledger import LedgerAccount


def patient_dp(cfg: RunConfig) -> DPSpec | None:
    """The run's patient-level DP spec, or None (off, or hospital level: the coordinator's)."""
    spec = DPSpec.parse(cfg.dp)
    return spec if spec is not None and spec.level == "patient" else None


def check_dp_model(model: SiteModel, spec: DPSpec, cfg: RunConfig, proximal_mu: float | None = None
                   ) -> None:
    """Refuse, before any training, a model or run that patient-level DP-SGD cannot serve: in-site
    parallelism, layers Opacus cannot compute per-patient gradients for (BatchNorm: use
    GroupNorm), the FedProx term, a recipe whose loss is not a sum over patients, and one whose
    step uses several optimizers (Opacus makes one private). The
    hospitals run it when they build the initial model, so the run stops before round 1."""
    if cfg.parallel.split(":", 1)[0].strip() != "none":
        raise ConfigError(f"Patient-level DP trains with Opacus on one device; use parallel=none. "
                          f"Received: parallel={cfg.parallel!r}")
    check_private_model(model, cfg.proximal_mu if proximal_mu is None else proximal_mu)
    private_optimizer(model, cfg.lr)  # one optimizer, else refused naming the recipe
    recipe = recipe_of(model)
    if not recipe.per_sample_loss:
        raise ConfigError(
            f"Patient-level DP (DP-SGD) clips each patient's gradient, so the loss must be a sum "
            f"over patients; recipe {recipe.name}'s loss is not (per_sample_loss = False: e.g. a "
            f"Cox partial likelihood couples the patients of a risk set). Use dp level=hospital, "
            f"or train without --dp. Received: recipe {recipe.identity.label()}"
        )


def check_dp_travel(model: SiteModel, federated: list[str], spec: DPSpec) -> None:
    """Refuse hospital-level DP when BatchNorm running statistics travel: the coordinator's
    Gaussian noise falls on every travelling tensor, and a noised running variance can turn
    negative (the model then outputs NaN). Keep BatchNorm at each hospital (the recipe's
    ``local_batch_norm = True``, FedBN) or use GroupNorm."""
    if spec.level != "hospital":
        return
    norms = {name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    stats = [n for n in federated if n.rpartition(".")[0] in norms
             and n.rpartition(".")[2] in ("running_mean", "running_var")]
    if stats:
        raise ConfigError(
            f"Hospital-level DP adds noise to every tensor that travels, and BatchNorm's running "
            f"statistics travel here; a noised running variance can turn negative and the model "
            f"then outputs NaN. Keep BatchNorm at each hospital (recipe attribute "
            f"local_batch_norm = True: FedBN), or replace it with GroupNorm. Received: "
            f"{stats[:4]}{' ...' if len(stats) > 4 else ''}")


def train_private(model: SiteModel, x: np.ndarray, y: np.ndarray, spec: DPSpec, cfg: RunConfig, *,
                  steps: int, server_round: int, account: LedgerAccount, seed: int,
                  proximal_mu: float, device: torch.device) -> tuple[float, float]:
    """DP-SGD for one round within the hospital's budgets: (the round's loss, the data file's
    epsilon after it, over every training the hospital's ledger records for it).

    The training is recorded in the hospital's ledger (``account``) before it runs; when it
    would go above the hospital's budget or the run's, `PrivacyBudgetError` is raised and
    nothing is trained or recorded (`client.privacy.ledger.LedgerAccount.charge`).
    ``server_round`` is recorded as the coordinator claimed it, never counted.
    """
    model.train()  # scoring first (evaluate-first) leaves it in eval mode, which Opacus refuses
    check_dp_model(model, spec, cfg, proximal_mu)
    plan = plan_noise(spec, len(x), cfg.batch_size, steps)
    epsilon = account.charge(plan, server_round)
    targets = recipe_of(model).targets(model, y)
    with warnings.catch_warnings():  # Opacus's notes on secure RNG and backward hooks
        warnings.simplefilter("ignore", UserWarning)
        loss = fit_private(model, x, targets, plan, lr=cfg.lr, seed=seed, device=device)
    for p in model.parameters():  # drop Opacus's per-sample gradients
        p.grad_sample = None
        p.grad = None
    return loss, epsilon

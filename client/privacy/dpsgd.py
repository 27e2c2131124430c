"""DP-SGD at one hospital (Opacus), planned for the whole run, with a budget that stops it.

Plan (`plan_noise`): every round a hospital with ``n`` training rows takes the same number of
optimizer steps as without DP (``client.train.local_steps_per_round``: ``local-steps``, or
``local-epochs`` epochs of batches, at least 10), each on a Poisson-sampled batch (every row
joins with probability ``q = min(1, batch_size / n)``). Opacus's
``get_noise_multiplier`` (RDP accountant) picks the smallest noise multiplier whose epsilon
after ``rounds * steps_per_round`` steps stays below the budget at the run's delta.

Accounting and budget: the hospital's own privacy ledger (`client.privacy.ledger`) records every
DP-SGD training before it runs and composes epsilon with Opacus's ``RDPAccountant`` over every
training recorded for the data file, across runs; it refuses (`PrivacyBudgetError`) a training
that would go above the hospital's budget (its policy's ``dp_budget``) or the run's (the ``dp``
spec's epsilon over this run's recorded trainings). The coordinator's round number is never
counted.

Models must allow per-sample gradients: BatchNorm mixes the rows of a batch and is refused
(``norm=none``); the FedProx term is not a per-sample loss and is refused too.

Training (`fit_private`) is the model's recipe's own step (`Recipe.train_step`, with its loss)
on Opacus's private module and optimizer; the recipe must use one optimizer
(`private_optimizer`; several are refused, naming the recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from fedsplit.protocol.errors import ConfigError, one_line
from fedsplit.protocol.privacy import DPSpec


@dataclass(frozen=True)
class DPPlan:
    """A hospital's DP-SGD plan for the whole run."""

    noise_multiplier: float
    sample_rate: float
    steps_per_round: int
    rounds: int
    epsilon: float
    delta: float
    clip: float


@lru_cache(maxsize=32)
def plan_noise(spec: DPSpec, rows: int, batch_size: int, steps_per_round: int) -> DPPlan:
    """The noise multiplier that keeps ``spec.rounds`` rounds within ``spec.epsilon`` (planned
    once per process and plan: Opacus's search takes seconds, and every round asks again)."""
    if spec.level != "patient":
        raise ConfigError(f"DP-SGD plans patient-level DP. Received: level={spec.level}")
    if spec.rounds < 1:
        raise ConfigError("A DP-SGD plan needs the planned rounds (dp spec rounds=R; the runners "
                          f"write it from num-server-rounds). Received: rounds={spec.rounds}")
    if rows < 1:
        raise ConfigError(f"A hospital needs training rows for DP-SGD. Received: rows={rows}")
    from opacus.accountants.utils import get_noise_multiplier

    if steps_per_round < 1:
        raise ConfigError(f"A DP-SGD round takes at least one step. Received: {steps_per_round}")
    q = min(1.0, batch_size / rows)
    steps = int(steps_per_round)
    sigma = get_noise_multiplier(target_epsilon=spec.epsilon, target_delta=spec.delta,
                                 sample_rate=q, steps=spec.rounds * steps, accountant="rdp")
    return DPPlan(float(sigma), q, steps, spec.rounds, spec.epsilon, spec.delta, spec.clip)


def check_private_model(model: torch.nn.Module, proximal_mu: float) -> None:
    """Refuse a model or objective that per-sample gradients cannot serve."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
        layers = [f"{name or 'the model'} ({type(sub).__name__})"
                  for name, sub in model.named_modules()
                  if type(sub) in ModuleValidator.VALIDATORS and ModuleValidator.VALIDATORS[type(sub)](sub)]
        raise ConfigError(
            f"Patient-level DP (DP-SGD) needs per-sample gradients, which Opacus cannot compute "
            f"for layer(s) {', '.join(layers) or 'of this model'} (e.g. BatchNorm mixes the rows "
            f"of a batch; an LSTM needs opacus.layers.DPLSTM): use norm=none for the built-in MLP, "
            f"or replace the layer in the recipe (opacus ModuleValidator.fix suggests "
            f"replacements: GroupNorm for BatchNorm), or keep BatchNorm local "
            f"(local_batch_norm = True) and use --dp ...,level=hospital. Received: "
            f"{one_line(str(errors[0]), limit=120)}{more}"
        )
    if proximal_mu > 0:
        raise ConfigError(f"Patient-level DP clips per-sample gradients; the FedProx term is not a "
                          f"per-sample loss. Use proximal-mu=0 with --dp. Received: "
                          f"proximal_mu={proximal_mu}")


def private_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The one optimizer Opacus makes private: the model's recipe's `Recipe.optimizers` (default
    one Adam at ``lr``). A recipe whose step uses several optimizers is refused, naming it: Opacus
    clips and noises the per-sample gradients of one optimizer's parameters."""
    from fedsplit.client.models import recipe_of

    recipe = recipe_of(model)
    optimizers = list(recipe.optimizers(model, lr))
    if len(optimizers) != 1:
        raise ConfigError(
            f"Patient-level DP (DP-SGD) makes one optimizer private (Opacus make_private clips "
            f"and noises its parameters' per-sample gradients), but recipe "
            f"{recipe.identity.label()}'s optimizers(model, lr) returns {len(optimizers)}. Return "
            f"one optimizer (with parameter groups for different learning rates), or use dp "
            f"level=hospital. Received: {[type(o).__name__ for o in optimizers]}"
        )
    return optimizers[0]


def fit_private(model: torch.nn.Module, x: np.ndarray, y: torch.Tensor, plan: DPPlan, *,
                lr: float, seed: int, device: torch.device | None = None) -> float:
    """Train ``model`` in place with DP-SGD (Opacus) and its recipe's step; return the round's
    mean loss.

    ``y`` holds the training targets as the loss expects them (`Recipe.targets`). Exactly
    ``plan.steps_per_round`` steps, each on a Poisson-sampled batch at ``plan.sample_rate``.
    Every non-empty batch is one call of the recipe's `Recipe.train_step` with Opacus's private
    module (through a `ModelView`, so the step sees the model's own attributes and tensors) and
    its private optimizer (the recipe's one optimizer, `private_optimizer`): its loss, its
    forward, its extra work (e.g. gradient clipping, which the private optimizer's per-sample
    clipping then supersedes) run under DP. An empty batch (Poisson sampling can draw one) is a
    step with noise only.
    """
    from fedsplit.client.models import recipe_of
    from fedsplit.client.recipes.base import ModelView, no_penalty
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    device = device or torch.device("cpu")
    check_private_model(model, 0.0)
    recipe = recipe_of(model)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.as_tensor(x, dtype=torch.float32), y)
    batch = max(1, round(plan.sample_rate * len(data)))
    loader = DataLoader(data, batch_size=batch, generator=gen)
    model.to(device).train()
    optimizer = private_optimizer(model, lr)
    engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=plan.noise_multiplier, max_grad_norm=plan.clip,
        poisson_sampling=True,
    )
    view = ModelView(private, model)
    total, seen, steps = 0.0, 0, 0
    while steps < plan.steps_per_round:
        for xb, yb in loader:
            if steps == plan.steps_per_round:
                break
            steps += 1
            if len(xb) == 0:  # Poisson sampling can draw an empty batch: a step with noise only
                optimizer.zero_grad()
                optimizer.step()
                continue
            loss = recipe.train_step(view, xb.to(device), yb.to(device), [optimizer], no_penalty)
            total += float(loss) * len(xb)
            seen += len(xb)
    private.remove_hooks()
    model.cpu()
    return total / max(seen, 1)

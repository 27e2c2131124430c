"""Local training and scoring of a model on one site's rows, and the local step budget.

Everything task- or model-specific comes from the model's recipe (`client.recipes.Recipe`:
targets, loss, optimizers, training step, metrics; `client.models.recipe_of`); this module only
orders the batches, adds the FedProx penalty and moves the model to its device.

`local_steps_per_round` fixes how many optimizer steps (mini-batches) a hospital takes per
round; the simulation's baselines get the same budget (`baseline_steps`), so a centralized or
single-site model is never compared after less training than the federation had.

`step_batch_size` fixes how many rows one step sees. A loss that is a sum over rows uses
``--batch-size``. A loss that couples rows (``per_sample_loss = False``: a Cox partial
likelihood, whose risk sets hold every patient still at risk) would be computed over risk sets
cut to a 32-row mini-batch, a different objective from the hospital's; so each step sees the
hospital's **whole training rows** (a full-batch step) up to the recipe's ``risk_set_rows``
(default `RISK_SET_ROWS`), and beyond that random batches of up to that many patients,
reshuffled every pass over the rows (risk-set sampling, as DeepSurv/torchsurv train on large
data: each step's risk sets are those of a random subsample; where a pass ends inside a batch,
as `step_rows` cuts exact step counts, that batch may hold a patient of both passes twice).
Every caller that trains (the hospital agent, the baselines, personalization) takes the same
rule, so the step budgets stay comparable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from fedsplit.client.models import has_batch_norm, recipe_of
from fedsplit.client.optim import training_optimizers
from fedsplit.protocol.errors import ConfigError
from torch import nn

#: The fewest mini-batches a hospital trains per round when ``local-steps`` is 0 (one epoch of
#: a 38-row site is 2 steps: too little to move the model).
MIN_LOCAL_STEPS = 10

#: The most rows one local step of a loss that couples rows (``per_sample_loss = False``) sees:
#: a hospital with up to this many training rows takes full-batch steps, a larger one samples
#: this many patients per step. A recipe overrides it with a class attribute ``risk_set_rows``
#: (0: plain ``--batch-size`` mini-batches, the risk sets cut to each batch).
RISK_SET_ROWS = 4096


def step_batch_size(recipe: object, rows: int, batch_size: int) -> int:
    """The rows one optimizer step trains on (module docstring): ``batch_size`` for a loss that
    is a sum over rows; for one that couples rows (``recipe.per_sample_loss`` False) all
    ``rows`` up to the recipe's ``risk_set_rows`` (default `RISK_SET_ROWS`), never fewer than
    ``batch_size``. ``recipe``: a `client.recipes.Recipe` (or a model built by one)."""
    if isinstance(recipe, nn.Module):
        recipe = recipe_of(recipe)
    if getattr(recipe, "per_sample_loss", True):
        return batch_size
    cap = getattr(recipe, "risk_set_rows", RISK_SET_ROWS)
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
        raise ConfigError(f"A recipe's risk_set_rows is the most rows one local step of its "
                          f"coupled loss sees: an int >= 0 (0: --batch-size mini-batches). "
                          f"Received: {type(recipe).__name__}.risk_set_rows = {cap!r}")
    return max(batch_size, min(rows, cap)) if cap else batch_size


def batches_per_epoch(rows: int, batch_size: int) -> int:
    """Mini-batches in one pass over ``rows`` rows."""
    return max(1, math.ceil(rows / batch_size))


def local_steps_per_round(rows: int, *, local_steps: int, local_epochs: int,
                          batch_size: int) -> int:
    """Optimizer steps a site with ``rows`` training rows takes per round.

    ``local_steps`` > 0: exactly that many. 0: ``local_epochs`` epochs, but at least
    `MIN_LOCAL_STEPS`.
    """
    if local_steps > 0:
        return local_steps
    return max(local_epochs * batches_per_epoch(rows, batch_size), MIN_LOCAL_STEPS)


def step_rows(rows: int, steps: int, batch_size: int, seed: int) -> np.ndarray | None:
    """Row indices that make exactly ``steps`` mini-batches, or None when whole epochs do.

    Consecutive reshuffled passes over the rows, cut to ``steps`` batches of
    ``min(batch_size, rows)`` rows; training on them for one epoch takes ``steps`` steps.
    """
    if rows >= batch_size and steps % batches_per_epoch(rows, batch_size) == 0:
        return None
    batch = min(batch_size, rows)
    need = steps * batch
    rng = np.random.default_rng(seed)
    passes = [rng.permutation(rows) for _ in range(math.ceil(need / rows))]
    return np.concatenate(passes)[:need]


def pick_device(prefer: str = "auto") -> torch.device:
    """Return ``cuda`` when available (or requested), else ``cpu``."""
    if prefer == "cpu":
        return torch.device("cpu")
    if prefer.startswith("cuda") or prefer == "auto":
        if torch.cuda.is_available():
            return torch.device(prefer if prefer.startswith("cuda") else "cuda")
        if prefer.startswith("cuda"):
            raise RuntimeError(f"Device {prefer!r} was requested but CUDA is not available")
    return torch.device("cpu")


def set_statistics(
    model: nn.Module,
    mean: np.ndarray,
    std: np.ndarray,
    target_mean: float = 0.0,
    target_std: float = 1.0,
) -> None:
    """Store the federation's standardisation statistics in the model (its recipe's
    `Recipe.set_statistics`: `Standardize` buffers and target scaling; std floored at 1e-6)."""
    recipe_of(model).set_statistics(model, mean, std, target_mean, target_std)


def training_targets(model: nn.Module, y: np.ndarray) -> torch.Tensor:
    """The targets as the training loss sees them (the recipe's `Recipe.targets`)."""
    return recipe_of(model).targets(model, y)


def loss_function(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of one batch, ``loss(output, target)`` (the recipe's `Recipe.loss`)."""
    recipe = recipe_of(model)
    return lambda output, target: recipe.loss(model, output, target)


def fit(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device | None = None,
    proximal_mu: float = 0.0,
) -> float:
    """Train ``model`` in place with its recipe's training step (default: Adam on the recipe's
    loss); return the mean loss of the last epoch.

    With ``proximal_mu > 0`` the FedProx term ``mu/2 * ||w - w_start||^2`` keeps the weights
    near the ones training started from (the global model).

    BatchNorm cannot normalise a batch of one row, so for a model with BatchNorm a last batch of
    one row joins the batch before it (every row is still trained on every epoch).
    """
    batch_norm = has_batch_norm(model)
    if batch_norm and (len(x) < 2 or batch_size < 2):
        raise ConfigError(
            f"A model with BatchNorm (norm=batch) computes statistics over each batch, so it needs "
            f"batch-size >= 2 and at least 2 training rows per site. Raise batch-size or use "
            f"norm=none. Received: batch_size={batch_size}, rows={len(x)}"
        )
    device = device or torch.device("cpu")
    model.to(device).train()
    recipe = recipe_of(model)
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = recipe.targets(model, y)
    start = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    optimizers = training_optimizers(recipe, model, lr)  # default Adam: no torch._dynamo import

    def penalty() -> torch.Tensor:
        """FedProx: mu/2 * ||w - w_start||^2 (zero without it)."""
        if not start:
            return torch.zeros((), device=device)
        prox = sum(((p - s) ** 2).sum() for p, s in zip(model.parameters(), start, strict=True))
        return proximal_mu / 2 * prox

    gen = torch.Generator().manual_seed(seed)
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        total, seen = 0.0, 0
        for i, j in batch_bounds(len(order), batch_size, merge_single=batch_norm):
            idx = order[i:j]
            xb, yb = xt[idx].to(device), yt[idx].to(device)
            loss = recipe.train_step(model, xb, yb, optimizers, penalty)
            total += float(loss) * len(idx)
            seen += len(idx)
        last = total / max(seen, 1)
    model.cpu()
    return last


def batch_bounds(n: int, batch_size: int, *, merge_single: bool = False) -> list[tuple[int, int]]:
    """``(start, stop)`` of each batch of ``n`` rows; ``merge_single``: a last 1-row batch joins
    the one before it."""
    bounds = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    if merge_single and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def fit_steps(model: nn.Module, x: np.ndarray, y: np.ndarray, *, steps: int, lr: float,
              batch_size: int, seed: int, device: torch.device | None = None,
              proximal_mu: float = 0.0) -> float:
    """Train ``model`` in place for exactly ``steps`` mini-batches (see `step_rows`) of
    `step_batch_size` rows (``batch_size``, or the whole risk sets of a loss that couples rows)."""
    batch_size = step_batch_size(model, len(x), batch_size)
    idx = step_rows(len(x), steps, batch_size, seed)
    if idx is None:
        return fit(model, x, y, epochs=steps // batches_per_epoch(len(x), batch_size), lr=lr,
                   batch_size=batch_size, seed=seed, device=device, proximal_mu=proximal_mu)
    return fit(model, x[idx], y[idx], epochs=1, lr=lr, batch_size=min(batch_size, len(x)),
               seed=seed, device=device, proximal_mu=proximal_mu)


@torch.no_grad()
def score(
    model: nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device | None = None
) -> dict[str, float]:
    """The recipe's metrics on held-out rows (`Recipe.metrics`: ``loss`` and ``accuracy`` for
    classification, ``loss``, ``r2`` and ``rmse`` for regression, unless the recipe says)."""
    device = device or torch.device("cpu")
    model.to(device).eval()
    result = {k: float(v) for k, v in recipe_of(model).metrics(model, x, y, device).items()}
    model.cpu()
    return result

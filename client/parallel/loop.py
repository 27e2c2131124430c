"""Pieces every mode shares with `client.train.fit`, so each mode sees the same batches.

The batch order is fit's: one `torch.Generator` seeded with ``seed``, one ``randperm`` per
epoch, consecutive slices of ``batch_size`` (`client.train.batch_bounds`: for a model with
BatchNorm a last batch of one row joins the one before it, as in fit). Every mode trains with
the model's recipe (`client.recipes.Recipe`: targets, loss, optimizers and, where the mode
can call it, its own ``train_step``), so the built-in MLP and CNN and a hospital's own recipe
take one path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from fedsplit.client.models import has_batch_norm, recipe_of
from fedsplit.client.train import batch_bounds
from fedsplit.protocol.errors import ConfigError
from torch import nn


def batch_order(n: int, *, epochs: int, batch_size: int, seed: int, merge_single: bool = False
                ) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(epoch, row indices)`` for every batch, exactly as `client.train.fit` draws them
    (``merge_single``: fit's rule for a model with BatchNorm)."""
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen)
        for i, j in batch_bounds(n, batch_size, merge_single=merge_single):
            yield epoch, order[i:j]


def targets(model: nn.Module, y: np.ndarray) -> torch.Tensor:
    """Targets as fit trains on them (the recipe's `Recipe.targets`)."""
    return recipe_of(model).targets(model, y)


def proximal_penalty(model: nn.Module, mu: float, device: torch.device
                     ) -> Callable[[], torch.Tensor]:
    """Fit's FedProx term ``mu/2 * ||w - w_start||^2`` from ``model``'s weights now (zero when
    ``mu`` is 0), as the ``penalty`` a recipe's ``train_step`` adds; summed on ``device``."""
    params = list(model.parameters())
    start = [p.detach().clone() for p in params] if mu > 0 else []

    def penalty() -> torch.Tensor:
        if not start:
            return torch.zeros((), device=device)
        prox = sum(((p - s) ** 2).sum().to(device) for p, s in zip(params, start, strict=True))
        return mu / 2 * prox

    return penalty


def check_inputs(x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int) -> None:
    """Refuse what fit would silently mishandle in a multi-process run."""
    if len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"x and y need the same, non-zero number of rows. "
                          f"Received: {len(x)} and {len(y)}")
    if batch_size < 1 or epochs < 0:
        raise ConfigError(f"batch_size must be >= 1 and epochs >= 0. "
                          f"Received: batch_size={batch_size}, epochs={epochs}")


def check_batch_norm_batches(model: nn.Module, x: np.ndarray, batch_size: int) -> None:
    """Fit's refusal for a BatchNorm model that would see a one-row batch."""
    if has_batch_norm(model) and (len(x) < 2 or batch_size < 2):
        raise ConfigError(
            f"A model with BatchNorm computes statistics over each batch, so it needs "
            f"batch-size >= 2 and at least 2 training rows per site. Received: "
            f"batch_size={batch_size}, rows={len(x)}"
        )


def add_proximal_grad(params: list[torch.Tensor], start: list[torch.Tensor], mu: float) -> None:
    """Add the FedProx gradient ``mu * (w - w_start)`` (the gradient of fit's prox term)."""
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            if p.grad is not None:
                p.grad.add_(p - s, alpha=mu)

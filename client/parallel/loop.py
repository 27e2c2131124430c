"""Pieces every mode shares with `client.train.fit`, so each mode sees the same batches.

The batch order is fit's: one `torch.Generator` seeded with ``seed``, one ``randperm`` per
epoch, consecutive slices of ``batch_size``. Losses are per-sample sums divided by the global
batch size, so shards and micro-batches of any size add up to fit's batch mean exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from fedsplit.client.models import SiteModel
from torch import nn

IGNORE = -100  # target of padding rows (classification); regression pads with NaN


def batch_order(n: int, *, epochs: int, batch_size: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(epoch, row indices)`` for every batch, exactly as `client.train.fit` draws them."""
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            yield epoch, order[i : i + batch_size]


def targets(model: SiteModel, y: np.ndarray) -> torch.Tensor:
    """Targets as fit trains on them: class indices, or scaled regression values (N x 1)."""
    if model.spec.task == "classification":
        return torch.as_tensor(np.asarray(y), dtype=torch.long)
    scaled = (np.asarray(y, dtype=np.float32) - float(model.target_mean)) / float(model.target_std)
    return torch.as_tensor(scaled, dtype=torch.float32).reshape(-1, 1)


def loss_sum(task: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of per-sample losses (cross-entropy or squared error); padding rows count zero."""
    if task == "classification":
        return nn.functional.cross_entropy(out, target, reduction="sum", ignore_index=IGNORE)
    keep = ~torch.isnan(target)
    diff = torch.where(keep, out - torch.nan_to_num(target), torch.zeros_like(out))
    return (diff**2).sum()


def check_inputs(x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int) -> None:
    """Refuse what fit would silently mishandle in a multi-process run."""
    from fedsplit.protocol.errors import ConfigError

    if len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"x and y need the same, non-zero number of rows. "
                          f"Received: {len(x)} and {len(y)}")
    if batch_size < 1 or epochs < 0:
        raise ConfigError(f"batch_size must be >= 1 and epochs >= 0. "
                          f"Received: batch_size={batch_size}, epochs={epochs}")


def add_proximal_grad(params: list[torch.Tensor], start: list[torch.Tensor], mu: float) -> None:
    """Add the FedProx gradient ``mu * (w - w_start)`` (the gradient of fit's prox term)."""
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            if p.grad is not None:
                p.grad.add_(p - s, alpha=mu)

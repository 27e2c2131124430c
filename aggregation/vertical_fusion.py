"""Vertical fusion: sites hold different columns of the same patients; fuse embeddings, not weights.

Averaging needs every site to hold the same model; here each site holds a branch over its own
columns, so instead (seed lecture 1.7.2, split learning):

    e_k = branch_k(x_k)                 at site k, for a mini-batch of aligned rows
    z   = head(concat(e_1, ..., e_K))   at the label holder, which also holds y
    L   = loss(z, y);  head <- Adam step on dL/dhead
    g_k = dL/de_k                       the slice of dL/dconcat for site k, sent back
    branch_k <- Adam step on g_k . de_k/dbranch_k     at site k

Only embeddings (up) and their gradients (down) cross the network. Because Adam is per
parameter, this reaches the same parameters as training the joint model in one process.
Classification uses cross-entropy over ``num_outputs`` logits; regression a linear head with
squared error on the standardised target.

This module holds the head side (`FusionHead`) and registers ``vertical-fusion`` so it is named
and documented with the other strategies; it is run by ``fedsplit vertical simulate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from aggregation.errors import IncompatibleUpdatesError
from aggregation.registry import register
from protocol.update import UpdateSource

if TYPE_CHECKING:  # torch is imported when a head is built, not when the registry loads
    import torch

Fill = Literal["nearest", "mean", "zero", "drop"]


class VerticalFusionParams(StrategyParams):
    """Split-training knobs; every site and the head use the same optimiser settings."""

    embedding_dim: int = Field(16, ge=1, le=4096, description="Width of each site's embedding.")
    branch_hidden: int = Field(0, ge=0, le=4096,
                               description="Hidden width inside each branch (0 = one layer).")
    head_hidden: int = Field(16, ge=0, le=4096,
                             description="Hidden width of the head (0 = linear head).")
    lr: float = Field(0.01, gt=0, le=1, description="Adam learning rate of head and branches.")
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Aligned rows per step.")
    steps_per_round: int = Field(20, ge=1, le=100_000, description="Mini-batch steps per Flower round.")
    fill: Fill = Field("nearest", description="Missing views: nearest (borrow the closest linked "
                                              "patient's row), mean, zero or drop.")
    min_overlap: float = Field(0.2, ge=0, le=1, description="Refuse when a site shares fewer than "
                                                             "this share of the label holder's IDs.")


class FusionHead:
    """The label holder's head: concatenates embeddings, computes loss, returns gradient slices."""

    def __init__(self, embedding_dims: Sequence[int], num_outputs: int, task: str, hidden: int,
                 lr: float, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        self.dims = [int(d) for d in embedding_dims]
        self.task = task
        width = sum(self.dims)
        layers: list[torch.nn.Module] = []
        if hidden and task == "classification":
            layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_outputs)]
        else:  # regression: linear head, squared error
            layers += [torch.nn.Linear(width, num_outputs)]
        self.module = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=lr)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import torch

        if self.task == "classification":
            return torch.nn.functional.cross_entropy(out, y.long())
        return torch.nn.functional.mse_loss(out.squeeze(1), y.float())

    def _check(self, embeddings: Sequence[np.ndarray]) -> None:
        got = [int(e.shape[1]) for e in embeddings]
        if got != self.dims or len({len(e) for e in embeddings}) != 1:
            raise IncompatibleUpdatesError(
                f"Each site must send one embedding row per batch row with the agreed width "
                f"{self.dims}. Received: {[tuple(e.shape) for e in embeddings]}"
            )

    def step(self, embeddings: Sequence[np.ndarray], y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """One head update; returns the loss and dL/de_k for every site (same row order)."""
        import torch

        self._check(embeddings)
        fused = torch.from_numpy(np.concatenate(embeddings, axis=1).astype(np.float32)).requires_grad_()
        self.module.train()
        self.optimizer.zero_grad()
        loss = self._loss(self.module(fused), torch.from_numpy(np.asarray(y)))
        loss.backward()
        self.optimizer.step()
        grad = fused.grad.numpy()
        cuts = np.cumsum(self.dims)[:-1]
        return float(loss.item()), [g.copy() for g in np.split(grad, cuts, axis=1)]

    def outputs(self, embeddings: Sequence[np.ndarray]) -> np.ndarray:
        """Logits (classification) or standardised predictions (regression)."""
        import torch

        self._check(embeddings)
        self.module.eval()
        fused = torch.from_numpy(np.concatenate(embeddings, axis=1).astype(np.float32))
        with torch.no_grad():
            return self.module(fused).numpy()

    def loss(self, embeddings: Sequence[np.ndarray], y: np.ndarray) -> float:
        """Loss without updating anything."""
        import torch

        out = torch.from_numpy(self.outputs(embeddings))
        with torch.no_grad():
            return float(self._loss(out, torch.from_numpy(np.asarray(y))).item())


@register
class VerticalFusion(AggregationStrategy):
    """Embedding fusion with split training (see the module docstring)."""

    name = "vertical-fusion"
    summary = ("Sites with different columns of the same patients: concatenate their embeddings "
               "into a joint head; gradients flow back to each branch. Run with `fedsplit vertical "
               "simulate`.")
    Params = VerticalFusionParams

    def aggregate(self, updates: Sequence[UpdateSource]) -> AggregateResult:
        """Vertical fusion never averages weights: refuse, saying what to run instead."""
        raise IncompatibleUpdatesError(
            "vertical-fusion does not average site models: each site trains a branch over its own "
            "columns and only embeddings and gradients are exchanged, step by step. Run it with "
            "`fedsplit vertical simulate` (or the vertical Flower app), not `fedsplit simulate` or "
            f"`fedsplit aggregate`. Received: {len(updates)} weight update(s)"
        )

    def head(self, embedding_dims: Sequence[int], num_outputs: int, task: str, seed: int) -> FusionHead:
        """A fresh head for these sites' embedding widths."""
        p = self.params
        assert isinstance(p, VerticalFusionParams)
        return FusionHead(embedding_dims, num_outputs, task, p.head_hidden, p.lr, seed)

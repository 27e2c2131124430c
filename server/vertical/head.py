"""The label holder's fusion head: split training fuses embeddings, not weights.

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
squared error on the standardised target. `server.vertical.coordinator` trains it;
``fedsplit vertical predict`` loads a saved one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from fedsplit.protocol.errors import ConfigError, ReplyError
from fedsplit.protocol.tasks import task_kind
from fedsplit.protocol.vertical.saved import HeadMeta


class FusionHead:
    """Concatenates the sites' embeddings, computes the loss, returns each site's gradient slice."""

    def __init__(self, embedding_dims: Sequence[int], num_outputs: int, task: str, hidden: int,
                 lr: float, seed: int) -> None:
        torch.manual_seed(seed)
        self.dims = [int(d) for d in embedding_dims]
        self.task = task
        width = sum(self.dims)
        layers: list[torch.nn.Module] = []
        if hidden and task_kind(task).classes:
            layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_outputs)]
        else:  # values (regression): linear head, squared error
            layers += [torch.nn.Linear(width, num_outputs)]
        self.module = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=lr)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if task_kind(self.task).classes:
            return torch.nn.functional.cross_entropy(out, y.long())
        return torch.nn.functional.mse_loss(out.squeeze(1), y.float())

    def _check(self, embeddings: Sequence[np.ndarray]) -> None:
        got = [int(e.shape[1]) if e.ndim == 2 else -1 for e in embeddings]
        if got != self.dims or len({len(e) for e in embeddings}) != 1:
            raise ReplyError(
                f"Each site must send one embedding row per batch row with the agreed width "
                f"{self.dims}. Received: {[tuple(e.shape) for e in embeddings]}"
            )

    def step(self, embeddings: Sequence[np.ndarray], y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """One head update; returns the loss and dL/de_k for every site (same row order)."""
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
        self._check(embeddings)
        self.module.eval()
        fused = torch.from_numpy(np.concatenate(embeddings, axis=1).astype(np.float32))
        with torch.no_grad():
            return self.module(fused).numpy()

    def loss(self, embeddings: Sequence[np.ndarray], y: np.ndarray) -> float:
        """Loss without updating anything."""
        out = torch.from_numpy(self.outputs(embeddings))
        with torch.no_grad():
            return float(self._loss(out, torch.from_numpy(np.asarray(y))).item())

    def save(self, folder: Path, meta: HeadMeta) -> None:
        """Write the parameters (``head.npz``) and what predict needs (``head.json``)."""
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / "head.npz", **{k: v.detach().numpy() for k, v in self.module.state_dict().items()})
        meta.save(folder / "head.json")

    @classmethod
    def load(cls, folder: Path) -> tuple[FusionHead, HeadMeta]:
        """A head saved by `save`, and its metadata (`protocol.vertical.saved.HeadMeta`)."""
        if not (folder / "head.json").is_file() or not (folder / "head.npz").is_file():
            raise ConfigError(f"{folder} holds no saved fusion head (head.json + head.npz from "
                              f"`fedsplit vertical simulate`). Received: {folder}")
        meta = HeadMeta.load(folder / "head.json")
        p = meta.params
        head = cls([p.embedding_dim] * len(meta.sites), meta.num_outputs, meta.task,
                   p.head_hidden, p.lr, meta.seed)
        with np.load(folder / "head.npz", allow_pickle=False) as npz:
            head.module.load_state_dict({k: torch.from_numpy(npz[k]) for k in npz.files})
        return head, meta

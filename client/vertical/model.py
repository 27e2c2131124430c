"""A vertical site's branch: its columns in, an embedding out, trained from gradients it is sent.

The branch never sees labels. Each training step the site embeds the rows it is asked for; when
the gradient of the loss with respect to those embeddings comes back, it recomputes the same
embeddings (parameters have not changed in between, and the branch has no randomness) and
back-propagates, so no autograd graph has to survive between Flower messages.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def build_branch(in_dim: int, embedding_dim: int, hidden: int,
                 seed: int | None) -> torch.nn.Sequential:
    """``Linear -> ReLU`` (seed lecture: Dense relu) with an optional hidden layer first.

    ``seed`` seeds torch's global generator for the initial weights; ``None`` leaves it alone,
    for a module whose parameters are loaded next (a site rebuilds its branch for every message)."""
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    width = in_dim
    if hidden:
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    layers += [torch.nn.Linear(width, embedding_dim), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


class Branch:
    """A branch module and its Adam optimiser."""

    def __init__(self, module: torch.nn.Module, lr: float) -> None:
        self.module = module
        self.optimizer = torch.optim.Adam(module.parameters(), lr=lr)

    def embed(self, x: np.ndarray) -> np.ndarray:
        """Embeddings of rows ``x`` (no gradient kept)."""
        with torch.no_grad():
            return self.module(torch.from_numpy(np.asarray(x, dtype=np.float32))).numpy()

    def backward(self, x: np.ndarray, grad: np.ndarray) -> None:
        """Apply dL/d(embedding of ``x``) = ``grad``: one Adam step on the branch."""
        if grad.shape[0] != x.shape[0]:
            raise ValueError(f"One gradient row per embedded row is needed. Received: {grad.shape[0]} "
                             f"gradients for {x.shape[0]} rows")
        self.optimizer.zero_grad()
        out = self.module(torch.from_numpy(np.asarray(x, dtype=np.float32)))
        out.backward(torch.from_numpy(np.asarray(grad, dtype=np.float32)))
        self.optimizer.step()

    def state(self) -> dict[str, np.ndarray]:
        """Parameters and Adam moments as named arrays (kept in Flower's ``context.state``)."""
        out = {f"param.{k}": v.detach().numpy().copy() for k, v in self.module.state_dict().items()}
        for i, st in self.optimizer.state_dict()["state"].items():
            out[f"adam.{i}.step"] = np.asarray([float(st["step"])], dtype=np.float64)
            out[f"adam.{i}.exp_avg"] = st["exp_avg"].numpy().copy()
            out[f"adam.{i}.exp_avg_sq"] = st["exp_avg_sq"].numpy().copy()
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of `state`."""
        params = {k[len("param."):]: torch.from_numpy(np.array(v)) for k, v in arrays.items()
                  if k.startswith("param.")}
        self.module.load_state_dict(params)
        opt = self.optimizer.state_dict()
        steps = sorted({int(k.split(".")[1]) for k in arrays if k.startswith("adam.")})
        for i in steps:
            opt["state"][i] = {
                "step": torch.tensor(float(np.asarray(arrays[f"adam.{i}.step"]).reshape(-1)[0])),
                "exp_avg": torch.from_numpy(np.array(arrays[f"adam.{i}.exp_avg"])),
                "exp_avg_sq": torch.from_numpy(np.array(arrays[f"adam.{i}.exp_avg_sq"])),
            }
        self.optimizer.load_state_dict(opt)

    def save(self, path: Path) -> None:
        """Write the parameters (no optimiser state) as an .npz file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **{k: v.detach().numpy() for k, v in self.module.state_dict().items()})

    @staticmethod
    def load_params(module: torch.nn.Module, path: Path) -> None:
        """Load parameters written by `save` into ``module``."""
        with np.load(path, allow_pickle=False) as npz:
            module.load_state_dict({k: torch.from_numpy(npz[k]) for k in npz.files})

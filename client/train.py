"""Local training and scoring of a `SiteModel` on one site's rows, and the local step budget.

`local_steps_per_round` fixes how many optimizer steps (mini-batches) a hospital takes per
round; the simulation's baselines get the same budget (`baseline_steps`), so a centralized or
single-site model is never compared after less training than the federation had.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from fedsplit.client.models import SiteModel, has_batch_norm
from fedsplit.protocol.errors import ConfigError
from torch import nn

#: The fewest mini-batches a hospital trains per round when ``local-steps`` is 0 (one epoch of
#: a 38-row site is 2 steps: too little to move the model).
MIN_LOCAL_STEPS = 10


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
    model: SiteModel,
    mean: np.ndarray,
    std: np.ndarray,
    target_mean: float = 0.0,
    target_std: float = 1.0,
) -> None:
    """Store standardisation statistics in the model's buffers (std floored at 1e-6)."""
    with torch.no_grad():
        model.norm.mean.copy_(torch.as_tensor(mean, dtype=torch.float32).reshape(model.norm.mean.shape))
        safe = np.where(np.asarray(std) > 1e-6, std, 1.0)
        model.norm.std.copy_(torch.as_tensor(safe, dtype=torch.float32).reshape(model.norm.std.shape))
        model.target_mean.fill_(float(target_mean))
        model.target_std.fill_(float(target_std) if target_std > 1e-6 else 1.0)


def training_targets(model: SiteModel, y: np.ndarray) -> torch.Tensor:
    """The targets as the training loss sees them: class indices, or standardized values."""
    if model.spec.task == "classification":
        return torch.as_tensor(y, dtype=torch.long)
    scaled = (np.asarray(y, dtype=np.float32) - float(model.target_mean)) / float(model.target_std)
    return torch.as_tensor(scaled, dtype=torch.float32).reshape(-1, 1)


def loss_function(model: SiteModel) -> nn.Module:
    """The training loss: cross-entropy (classification) or mean squared error (regression)."""
    return nn.CrossEntropyLoss() if model.spec.task == "classification" else nn.MSELoss()


def fit(
    model: SiteModel,
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
    """Train ``model`` in place with Adam; return the mean loss of the last epoch.

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
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = training_targets(model, y)
    start = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = loss_function(model)
    gen = torch.Generator().manual_seed(seed)
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        total, seen = 0.0, 0
        for i, j in batch_bounds(len(order), batch_size, merge_single=batch_norm):
            idx = order[i:j]
            xb, yb = xt[idx].to(device), yt[idx].to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            objective = loss
            if start:
                prox = sum(((p - s) ** 2).sum() for p, s in zip(model.parameters(), start, strict=True))
                objective = loss + proximal_mu / 2 * prox
            objective.backward()
            optimizer.step()
            total += loss.item() * len(idx)
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


def fit_steps(model: SiteModel, x: np.ndarray, y: np.ndarray, *, steps: int, lr: float,
              batch_size: int, seed: int, device: torch.device | None = None,
              proximal_mu: float = 0.0) -> float:
    """Train ``model`` in place for exactly ``steps`` mini-batches (see `step_rows`)."""
    idx = step_rows(len(x), steps, batch_size, seed)
    if idx is None:
        return fit(model, x, y, epochs=steps // batches_per_epoch(len(x), batch_size), lr=lr,
                   batch_size=batch_size, seed=seed, device=device, proximal_mu=proximal_mu)
    return fit(model, x[idx], y[idx], epochs=1, lr=lr, batch_size=min(batch_size, len(x)),
               seed=seed, device=device, proximal_mu=proximal_mu)


@torch.no_grad()
def score(
    model: SiteModel, x: np.ndarray, y: np.ndarray, device: torch.device | None = None
) -> dict[str, float]:
    """Return ``loss`` and ``accuracy`` (classification) or ``r2`` and ``rmse`` (regression)."""
    device = device or torch.device("cpu")
    model.to(device).eval()
    xt = torch.as_tensor(x, dtype=torch.float32).to(device)
    out = model(xt)
    loss = float(loss_function(model)(out, training_targets(model, y).to(device)))
    if model.spec.task == "classification":
        acc = float((out.argmax(1).cpu().numpy() == np.asarray(y)).mean())
        result = {"loss": loss, "accuracy": acc}
    else:
        pred = model.predict(xt).cpu().numpy().astype(np.float64)
        truth = np.asarray(y, dtype=np.float64)
        ss_res = float(((truth - pred) ** 2).sum())
        ss_tot = float(((truth - truth.mean()) ** 2).sum())
        result = {
            "loss": loss,
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0,
            "rmse": float(np.sqrt(ss_res / len(truth))),
        }
    model.cpu()
    return result

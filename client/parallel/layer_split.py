"""``model`` mode: the model's layers spread over devices by a device map, in one process.

`LayerSplit` wraps a `SiteModel` without copying it: stage ``i``'s layers are moved to
``devices[i]`` and ``forward`` hands the activation to the next stage's device, so
activations cross forward once per boundary and autograd sends gradients back once.
The caller still runs one ordinary train step (forward, loss, backward, optimizer step).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from fedsplit.client.models import SiteModel
from fedsplit.client.parallel.device_map import DeviceMap
from fedsplit.client.parallel.loop import batch_order, loss_sum, targets
from torch import nn


class LayerSplit(nn.Module):
    """A `SiteModel` whose stages live on their own devices (shares the model's modules)."""

    def __init__(self, model: SiteModel, device_map: DeviceMap, devices: list[torch.device]) -> None:
        super().__init__()
        if len(devices) != len(device_map):
            raise ValueError(f"one device per stage needed: {len(device_map)} stages, {len(devices)} devices")
        self.stages = nn.ModuleList(device_map.build(model))
        self.devices = list(devices)
        self.handoffs = 0  # activations moved to the next stage's device (forward crossings)
        for stage, device in zip(self.stages, self.devices, strict=True):
            stage.to(device)

    @property
    def output_device(self) -> torch.device:
        """Where the logits land (compute the loss there)."""
        return self.devices[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every stage on its device, handing the activation over at each boundary."""
        for i, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            if i > 0:
                self.handoffs += 1
            x = stage(x.to(device, non_blocking=True))
        return x


def fit_layer_split(
    model: SiteModel,
    x: np.ndarray,
    y: np.ndarray,
    *,
    device_map: DeviceMap,
    devices: list[torch.device],
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    proximal_mu: float,
) -> tuple[float, float]:
    """Train ``model`` in place across ``devices``; return (last-epoch mean loss, train seconds)."""
    model.train()
    split = LayerSplit(model, device_map, devices)
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = targets(model, y)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params] if proximal_mu > 0 else []
    optimizer = torch.optim.Adam(params, lr=lr)
    task = model.spec.task
    totals: dict[int, list[float]] = {}
    began = time.perf_counter()
    for epoch, idx in batch_order(len(xt), epochs=epochs, batch_size=batch_size, seed=seed):
        xb, yb = xt[idx].to(devices[0]), yt[idx].to(split.output_device)
        optimizer.zero_grad()
        loss = loss_sum(task, split(xb), yb) / len(idx)
        objective = loss
        if start:
            prox = sum(((p - s) ** 2).sum() for p, s in zip(params, start, strict=True))
            objective = loss + proximal_mu / 2 * prox
        objective.backward()
        optimizer.step()
        total = totals.setdefault(epoch, [0.0, 0])
        total[0] += float(loss.detach()) * len(idx)
        total[1] += len(idx)
    seconds = time.perf_counter() - began
    model.cpu()
    last = totals.get(epochs - 1, [float("nan"), 1])
    return last[0] / max(last[1], 1), seconds

"""``model`` mode: the model's layers spread over devices by a device map, in one process.

`LayerSplit` wraps a model without copying it: stage ``i``'s layers (the recipe's
`Recipe.layers`) are moved to ``devices[i]`` and ``forward`` hands the activation to the next
stage's device, so activations cross forward once per boundary and autograd sends gradients
back once. Training is fit's own loop: the recipe's ``train_step`` with its optimizers, called
with a `ModelView` whose forward is the split, so one step is the step fit takes (BatchNorm,
several optimizers and gradient clipping included), only spread over devices.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from fedsplit.client.models import has_batch_norm, recipe_of
from fedsplit.client.parallel.device_map import DeviceMap
from fedsplit.client.parallel.loop import batch_order, proximal_penalty
from fedsplit.client.recipes.base import ModelView
from torch import nn


class LayerSplit(nn.Module):
    """A model whose stages live on their own devices (shares the model's modules)."""

    def __init__(self, model: nn.Module, device_map: DeviceMap, devices: list[torch.device]) -> None:
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
        """Where the outputs land (compute the loss there)."""
        return self.devices[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every stage on its device, handing the activation over at each boundary."""
        for i, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            if i > 0:
                self.handoffs += 1
            x = stage(x.to(device, non_blocking=True))
        return x


def fit_layer_split(
    model: nn.Module,
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
    recipe = recipe_of(model)
    split = LayerSplit(model, device_map, devices)
    view = ModelView(split, model)
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = recipe.targets(model, y)
    optimizers = list(recipe.optimizers(model, lr))
    penalty = proximal_penalty(model, proximal_mu, split.output_device)
    totals: dict[int, list[float]] = {}
    began = time.perf_counter()
    for epoch, idx in batch_order(len(xt), epochs=epochs, batch_size=batch_size, seed=seed,
                                  merge_single=has_batch_norm(model)):
        xb, yb = xt[idx].to(devices[0]), yt[idx].to(split.output_device)
        loss = recipe.train_step(view, xb, yb, optimizers, penalty)
        total = totals.setdefault(epoch, [0.0, 0])
        total[0] += float(loss) * len(idx)
        total[1] += len(idx)
    seconds = time.perf_counter() - began
    model.cpu()
    last = totals.get(epochs - 1, [float("nan"), 1])
    return last[0] / max(last[1], 1), seconds

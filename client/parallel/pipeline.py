"""``pipeline`` mode: S stages in S processes, M micro-batches per batch, GPipe schedule.

Built on `torch.distributed.pipelining` (`PipelineStage` + `ScheduleGPipe`), which runs on
CPU over gloo. Each process owns one stage of the device map and steps the recipe's optimizers
over that stage's weights (Adam is per-weight, so S optimizers step exactly like one).

Two details make a step equal fit's full-batch step:

* Fixed micro-batch shapes. `PipelineStage` infers activation shapes on the first step and
  reuses those receive buffers on every later step (measured: a 7-row batch after 9-row ones
  fails with "Expected input batch_size (3) to match target batch_size (2)"). So every batch
  is padded to ``M * ceil(batch_size / M)`` rows; the schedule's target is each row's position,
  and the loss scores only the positions of real rows (their targets looked up in the batch),
  so padding adds exactly zero to the loss and gradients. The layers must treat rows independently (no
  BatchNorm: refused, `client.parallel.api`), so padding changes nothing else.
* Exact scaling. Each micro-batch loss is the recipe's loss (a mean over rows) on its real rows
  times their share of the batch, and the schedule runs with ``scale_grads=False``: accumulated
  over the M micro-batches that is the gradient of fit's batch mean.

The schedule runs forward and backward itself, so a recipe's own ``train_step`` cannot run here
(refused, with ``model`` and ``data`` modes named as the modes that call it); its loss, targets
and optimizers do (each stage steps the recipe's optimizers; only its own weights have
gradients).
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from fedsplit.client.models import recipe_of
from fedsplit.client.parallel.device_map import DeviceMap
from fedsplit.client.parallel.launch import WorkerRun, collect, launch, save_result
from fedsplit.client.parallel.loop import add_proximal_grad, batch_order
from fedsplit.protocol.errors import ConfigError
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def padded_rows(n: int, batch_size: int, microbatches: int) -> int:
    """Rows every padded batch has: ``M * ceil(min(batch_size, n) / M)``."""
    return microbatches * math.ceil(min(batch_size, n) / microbatches)


def pad(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """``t`` followed by ``rows - len(t)`` rows of ``fill``."""
    if len(t) == rows:
        return t
    extra = torch.full((rows - len(t), *t.shape[1:]), fill, dtype=t.dtype)
    return torch.cat([t, extra])


def pipeline_worker(rank: int, world: int, out_dir: Path, template: nn.Module,
                    stages: tuple[tuple[str, ...], ...], x: np.ndarray, y: np.ndarray, epochs: int,
                    lr: float, batch_size: int, seed: int, proximal_mu: float, microbatches: int,
                    devices: list[str], keep_grads: bool) -> None:
    """Stage ``rank``: run the GPipe schedule on every batch and step its own weights."""
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = copy.deepcopy(template)
    recipe = recipe_of(model)
    device_map = DeviceMap(stages)
    module = device_map.build(model)[rank].to(device).train()
    batch: dict[str, torch.Tensor] = {}  # the current batch's real targets, read by the loss

    def loss_fn(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The recipe's loss on the micro-batch's real rows, times their share of the batch.
        The schedule's "target" is each row's position in the padded batch: positions past the
        batch's real rows are padding (they come last) and are left out."""
        target = batch["y"]
        real = int((rows < len(target)).sum())
        if real == 0:
            return out.sum() * 0.0
        return recipe.loss(model, out[:real], target[rows[:real]]) * (real / len(target))

    stage = PipelineStage(module, rank, world, device)
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    first, last = rank == 0, rank == world - 1
    params = [p for p in module.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params] if proximal_mu > 0 else []
    # the recipe's optimizers over the whole model: only this stage's weights have gradients
    optimizers = list(recipe.optimizers(model, lr)) if params else []
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = recipe.targets(model, y)
    rows = padded_rows(len(xt), batch_size, microbatches)
    epoch_sum, current = 0.0, -1
    dist.barrier()
    began = time.perf_counter()
    for epoch, idx in batch_order(len(xt), epochs=epochs, batch_size=batch_size, seed=seed):
        if epoch != current:
            epoch_sum, current = 0.0, epoch
        batch["y"] = yt[idx].to(device)
        for opt in optimizers:
            opt.zero_grad()
        args = (pad(xt[idx], rows, 0.0).to(device),) if first else ()
        losses: list[torch.Tensor] = []
        if last:
            schedule.step(*args, target=torch.arange(rows, device=device), losses=losses)
            epoch_sum += float(sum(loss.detach() for loss in losses)) * len(idx)
        else:
            schedule.step(*args)
        if start:
            add_proximal_grad(params, start, proximal_mu)
        for opt in optimizers:
            opt.step()
    dist.barrier()
    seconds = time.perf_counter() - began
    mine = {id(t) for t in (*module.parameters(), *module.buffers())}
    result: dict[str, object] = {"seconds": seconds, "state": {
        k: v.detach().cpu() for k, v in model.state_dict(keep_vars=True).items() if id(v) in mine}}
    if keep_grads:
        result["grads"] = {k: p.grad.detach().cpu() for k, p in model.named_parameters()
                           if p.grad is not None}
    if last:
        result["loss"] = epoch_sum / len(xt) if epochs > 0 else float("nan")
    save_result(out_dir, rank, result)


def train_pipeline(model: nn.Module, x: np.ndarray, y: np.ndarray, *, device_map: DeviceMap,
                   devices: list[torch.device], microbatches: int, epochs: int, lr: float,
                   batch_size: int, seed: int, proximal_mu: float, start_method: str,
                   timeout_s: float, keep_grads: bool = False) -> WorkerRun:
    """Train ``model`` in place, one pipeline stage per device; ``keep_grads`` also returns the
    gradients of the last step (each stage's, merged)."""
    if microbatches > min(batch_size, len(x)):
        raise ConfigError(
            f"A batch of {min(batch_size, len(x))} rows cannot fill {microbatches} micro-batches; "
            f"use microbatches <= batch_size. Received: microbatches={microbatches}"
        )
    results = launch(model, pipeline_worker, devices, device_map.stages, x, y, epochs, lr,
                     batch_size, seed, proximal_mu, microbatches, [str(d) for d in devices],
                     keep_grads, start_method=start_method, timeout_s=timeout_s,
                     what=f"pipeline training ({len(devices)} stages x {microbatches} micro-batches)")
    return collect(model, results)

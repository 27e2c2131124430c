"""``pipeline`` mode: S stages in S processes, M micro-batches per batch, GPipe schedule.

Built on `torch.distributed.pipelining` (`PipelineStage` + `ScheduleGPipe`), which runs on
CPU over gloo. Each process owns one stage of the device map and its own Adam over that
stage's weights (Adam is per-weight, so S optimizers step exactly like one).

Two details make a step equal fit's full-batch step:

* Fixed micro-batch shapes. `PipelineStage` infers activation shapes on the first step and
  reuses those receive buffers on every later step (measured: a 7-row batch after 9-row ones
  fails with "Expected input batch_size (3) to match target batch_size (2)"). So every batch
  is padded to ``M * ceil(batch_size / M)`` rows; padding rows have target -100 (ignored by
  cross-entropy) or NaN (masked out of the squared error) and add exactly zero to the loss and
  gradients. Our layers treat rows independently (no batch norm), so padding changes nothing else.
* Exact scaling. Each micro-batch loss is its per-sample sum divided by the real batch size,
  and the schedule runs with ``scale_grads=False``: accumulated over the M micro-batches that
  is the gradient of fit's batch mean.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from fedsplit.client.models import SiteModel, build_model
from fedsplit.client.parallel.device_map import DeviceMap
from fedsplit.client.parallel.launch import WorkerRun, collect, launch, save_result
from fedsplit.client.parallel.loop import IGNORE, add_proximal_grad, batch_order, loss_sum, targets
from fedsplit.protocol.errors import ConfigError
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


def pipeline_worker(rank: int, world: int, out_dir: Path, model_id: str,
                    state: dict[str, torch.Tensor], stages: tuple[tuple[str, ...], ...],
                    x: np.ndarray, y: np.ndarray, epochs: int, lr: float, batch_size: int, seed: int,
                    proximal_mu: float, microbatches: int, devices: list[str], keep_grads: bool) -> None:
    """Stage ``rank``: run the GPipe schedule on every batch and step its own weights."""
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(model_id)
    model.load_state_dict(state)
    device_map = DeviceMap(stages)
    module = device_map.build(model)[rank].to(device).train()
    task = model.spec.task
    batch_rows = [1]  # real rows in the current batch, read by the loss

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_sum(task, out, target) / batch_rows[0]

    stage = PipelineStage(module, rank, world, device)
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    first, last = rank == 0, rank == world - 1
    params = list(module.parameters())
    start = [p.detach().clone() for p in params] if proximal_mu > 0 else []
    optimizer = torch.optim.Adam(params, lr=lr) if params else None
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = targets(model, y)
    rows = padded_rows(len(xt), batch_size, microbatches)
    fill = IGNORE if task == "classification" else float("nan")
    epoch_sum, current = 0.0, -1
    dist.barrier()
    began = time.perf_counter()
    for epoch, idx in batch_order(len(xt), epochs=epochs, batch_size=batch_size, seed=seed):
        if epoch != current:
            epoch_sum, current = 0.0, epoch
        batch_rows[0] = len(idx)
        if optimizer is not None:
            optimizer.zero_grad()
        args = (pad(xt[idx], rows, 0.0).to(device),) if first else ()
        losses: list[torch.Tensor] = []
        if last:
            schedule.step(*args, target=pad(yt[idx], rows, fill).to(device), losses=losses)
            epoch_sum += float(sum(loss.detach() for loss in losses)) * len(idx)
        else:
            schedule.step(*args)
        if start:
            add_proximal_grad(params, start, proximal_mu)
        if optimizer is not None:
            optimizer.step()
    dist.barrier()
    seconds = time.perf_counter() - began
    owner = device_map.owner()
    mine = {
        k: v.detach().cpu() for k, v in model.state_dict().items()
        if owner.get(k.split(".")[0] if k.startswith("norm.") else ".".join(k.split(".")[:2])) == rank
    }
    result: dict[str, object] = {"state": mine, "seconds": seconds}
    if keep_grads:
        result["grads"] = {k: p.grad.detach().cpu() for k, p in model.named_parameters()
                           if p.grad is not None}
    if last:
        result["loss"] = epoch_sum / len(xt) if epochs > 0 else float("nan")
    save_result(out_dir, rank, result)


def train_pipeline(model: SiteModel, x: np.ndarray, y: np.ndarray, *, device_map: DeviceMap,
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

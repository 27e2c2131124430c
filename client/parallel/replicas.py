"""``data`` mode: R replicas under `DistributedDataParallel`, gradients all-reduced every step.

Every replica draws fit's batch order (same seed), takes shard ``rank`` of each global batch
(`torch.tensor_split`, so shards differ by at most one row) and computes the per-sample loss
sum times ``R / B`` (``B`` = rows in the global batch). DDP averages gradients over the R
replicas, which turns that into exactly the gradient of the mean loss over the global batch,
for uneven shards too. Every replica then takes the same Adam step, so the copies never drift.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from fedsplit.client.models import SiteModel, build_model
from fedsplit.client.parallel.launch import WorkerRun, collect, launch, save_result
from fedsplit.client.parallel.loop import batch_order, loss_sum, targets
from torch.nn.parallel import DistributedDataParallel


def data_worker(rank: int, world: int, out_dir: Path, model_id: str, state: dict[str, torch.Tensor],
                x: np.ndarray, y: np.ndarray, epochs: int, lr: float, batch_size: int, seed: int,
                proximal_mu: float, devices: list[str], keep_grads: bool) -> None:
    """One replica: train on shard ``rank`` of every batch; rank 0 saves the weights."""
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(model_id)
    model.load_state_dict(state)
    model.to(device).train()
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # the only buffers are standardisation statistics: never trained
    )
    params = list(model.parameters())
    start = [p.detach().clone() for p in params] if proximal_mu > 0 else []
    optimizer = torch.optim.Adam(params, lr=lr)
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = targets(model, y)
    task = model.spec.task
    epoch_sum = torch.zeros((), device=device)
    current = -1
    dist.barrier()
    began = time.perf_counter()
    for epoch, idx in batch_order(len(xt), epochs=epochs, batch_size=batch_size, seed=seed):
        if epoch != current:
            epoch_sum.zero_()
            current = epoch
        shard = idx.tensor_split(world)[rank]
        xb, yb = xt[shard].to(device), yt[shard].to(device)
        optimizer.zero_grad()
        local = loss_sum(task, ddp(xb), yb)
        objective = local * (world / len(idx))
        if start:
            prox = sum(((p - s) ** 2).sum() for p, s in zip(params, start, strict=True))
            objective = objective + proximal_mu / 2 * prox
        objective.backward()  # DDP all-reduces (averages) the gradients here
        optimizer.step()
        epoch_sum += local.detach()
    dist.all_reduce(epoch_sum)
    dist.barrier()
    seconds = time.perf_counter() - began
    result: dict[str, object] = {"seconds": seconds}
    if rank == 0:
        result["state"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        result["loss"] = float(epoch_sum) / len(xt) if epochs > 0 else float("nan")
        if keep_grads:
            result["grads"] = {k: p.grad.detach().cpu() for k, p in model.named_parameters()
                               if p.grad is not None}
    save_result(out_dir, rank, result)


def train_replicas(model: SiteModel, x: np.ndarray, y: np.ndarray, *, devices: list[torch.device],
                   epochs: int, lr: float, batch_size: int, seed: int, proximal_mu: float,
                   start_method: str, timeout_s: float, keep_grads: bool = False) -> WorkerRun:
    """Train ``model`` in place with one DDP replica per device; ``keep_grads`` also returns
    the gradients of the last step (after the all-reduce)."""
    results = launch(model, data_worker, devices, x, y, epochs, lr, batch_size, seed, proximal_mu,
                     [str(d) for d in devices], keep_grads, start_method=start_method,
                     timeout_s=timeout_s, what=f"data-parallel training ({len(devices)} replicas)")
    return collect(model, results)

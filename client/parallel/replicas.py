"""``data`` mode: R replicas under `DistributedDataParallel`, gradients all-reduced every step.

Every replica holds a copy of the model, draws fit's batch order (same seed) and takes shard
``rank`` of each global batch (`torch.tensor_split`, so shards differ by at most one row). It
runs the model's recipe step (`Recipe.train_step`: its loss, its optimizers, its clipping) on
that shard, through a `ModelView` of the DDP wrapper, so the step's backward all-reduces the
gradients before the step's own code (clipping, the optimizers) sees them. The all-reduce is a
weighted sum (a DDP communication hook): shard ``r`` counts ``n_r / B`` (``B`` = rows in the
global batch), which turns the shards' mean losses into exactly the gradient of the mean loss
over the global batch, for uneven shards too. Every replica then takes the same step, so the
copies never drift. A batch with fewer rows than replicas (or, with BatchNorm, than twice as
many) is trained whole by every replica, without the all-reduce (the same step on every copy).

What this assumes of a recipe: its loss is a mean over the batch's rows (torch's losses are,
by default); a loss that couples rows (``per_sample_loss = False``) is refused. BatchNorm
normalises each replica's shard (as DDP does: torch's SyncBatchNorm has no CPU path), so a
BatchNorm model trains like one device only in ``model`` mode; its running statistics are the
replicas' mean at the end.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fedsplit.client.models import has_batch_norm, recipe_of
from fedsplit.client.parallel.launch import WorkerRun, collect, launch, save_result
from fedsplit.client.parallel.loop import batch_order, proximal_penalty
from fedsplit.client.recipes.base import ModelView
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _weighted_sum(weight, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """DDP communication hook: this replica's gradients times its share of the batch, summed
    (``weight``: a one-element list, set before each step; ``bucket``: a `dist.GradBucket`)."""
    grads = bucket.buffer().mul_(weight[0])
    return dist.all_reduce(grads, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _mean_batch_norm_statistics(model: nn.Module, world: int) -> None:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
            for stat in (module.running_mean, module.running_var):
                dist.all_reduce(stat)
                stat.div_(world)


def data_worker(rank: int, world: int, out_dir: Path, template: nn.Module, x: np.ndarray,
                y: np.ndarray, epochs: int, lr: float, batch_size: int, seed: int,
                proximal_mu: float, devices: list[str], keep_grads: bool) -> None:
    """One replica: the recipe's step on shard ``rank`` of every batch; rank 0 saves the weights."""
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = copy.deepcopy(template).to(device).train()
    recipe = recipe_of(model)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # each replica keeps its own buffers (module docstring)
    )
    share = [1.0]
    ddp.register_comm_hook(share, _weighted_sum)
    view = ModelView(ddp, model)
    optimizers = list(recipe.optimizers(model, lr))
    penalty = proximal_penalty(model, proximal_mu, device)
    xt = torch.as_tensor(x, dtype=torch.float32)
    yt = recipe.targets(model, y)
    batch_norm = has_batch_norm(model)
    fewest = 2 if batch_norm else 1
    epoch_sum = torch.zeros((), dtype=torch.float64)
    current = -1
    dist.barrier()
    began = time.perf_counter()
    for epoch, idx in batch_order(len(xt), epochs=epochs, batch_size=batch_size, seed=seed,
                                  merge_single=batch_norm):
        if epoch != current:
            epoch_sum.zero_()
            current = epoch
        shards = idx.tensor_split(world)
        if min(len(s) for s in shards) >= fewest:
            shard = shards[rank]
            share[0] = len(shard) / len(idx)
            loss = recipe.train_step(view, xt[shard].to(device), yt[shard].to(device), optimizers,
                                     penalty)  # its backward all-reduces the gradients
            epoch_sum += float(loss) * len(shard)
        else:  # too few rows to shard: every replica takes the same whole-batch step
            with ddp.no_sync():
                loss = recipe.train_step(view, xt[idx].to(device), yt[idx].to(device), optimizers,
                                         penalty)
            epoch_sum += float(loss) * len(idx) / world
    dist.all_reduce(epoch_sum)
    if batch_norm:
        _mean_batch_norm_statistics(model, world)
    dist.barrier()
    seconds = time.perf_counter() - began
    result: dict[str, Any] = {"seconds": seconds}
    if rank == 0:
        result["state"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        result["loss"] = float(epoch_sum) / len(xt) if epochs > 0 else float("nan")
        if keep_grads:
            result["grads"] = {k: p.grad.detach().cpu() for k, p in model.named_parameters()
                               if p.grad is not None}
    save_result(out_dir, rank, result)


def train_replicas(model: nn.Module, x: np.ndarray, y: np.ndarray, *, devices: list[torch.device],
                   epochs: int, lr: float, batch_size: int, seed: int, proximal_mu: float,
                   start_method: str, timeout_s: float, keep_grads: bool = False) -> WorkerRun:
    """Train ``model`` in place with one DDP replica per device; ``keep_grads`` also returns
    the gradients of the last step (after the all-reduce)."""
    results = launch(model, data_worker, devices, x, y, epochs, lr, batch_size, seed, proximal_mu,
                     [str(d) for d in devices], keep_grads, start_method=start_method,
                     timeout_s=timeout_s, what=f"data-parallel training ({len(devices)} replicas)")
    return collect(model, results)

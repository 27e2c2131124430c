"""`fit_parallel`: `client.train.fit` with the site's training split across devices."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from fedsplit.client.models import has_batch_norm, recipe_of
from fedsplit.client.parallel.config import ParallelConfig, as_config
from fedsplit.client.parallel.device_map import model_layers, resolve_device_map, resolve_devices
from fedsplit.client.parallel.layer_split import fit_layer_split
from fedsplit.client.parallel.loop import check_batch_norm_batches, check_inputs
from fedsplit.client.parallel.replicas import train_replicas
from fedsplit.client.recipes.base import Recipe
from fedsplit.client.train import fit, pick_device
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.errors import ConfigError
from torch import nn


@dataclass(frozen=True)
class ParallelFit:
    """What a parallel fit returns besides the trained weights (the model is updated in place).

    Attributes
    ----------
    loss : float
        Mean loss of the last epoch, as `client.train.fit` returns it.
    mode : str
        ``none``, ``data``, ``model`` or ``pipeline``.
    workers : int
        Replicas or stages used (1 for ``none``).
    config : str
        The configuration actually run (`ParallelConfig.to_string`, with the device map used).
    samples : int
        Rows trained on (epochs x rows; pipeline padding not counted).
    train_seconds : float
        Wall time of the training loop itself (slowest worker), without process start-up.
    total_seconds : float
        Wall time of the whole call, process start-up included.
    """

    loss: float
    mode: str
    workers: int
    config: str
    samples: int
    train_seconds: float
    total_seconds: float

    @property
    def samples_per_second(self) -> float:
        """Training throughput (``samples / train_seconds``)."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else float("nan")

    def metrics(self) -> dict[str, str | int | float]:
        """Flat metrics for a round report (Flower ``MetricRecord``/``ConfigRecord`` scalars)."""
        return {
            "parallel-mode": self.mode,
            wire.PARALLEL_WORKERS: self.workers,
            "parallel-config": self.config,
            wire.PARALLEL_SAMPLES_PER_S: round(self.samples_per_second, 2),
        }


def check_recipe_mode(model: nn.Module, mode: str, x: np.ndarray | None = None) -> None:
    """Refuse, before any process starts, a mode the model's recipe cannot train with, naming
    the recipe, the mode, why, and what to do (docs/recipes.md, "In-site parallel training").

    ``data``: any model whose loss is a mean over rows (``per_sample_loss``). ``model``: any model
    its recipe cuts into layers (`Recipe.layers`: an ``nn.Sequential``, or the recipe's own
    list). ``pipeline``: the same, without BatchNorm (micro-batches would change its
    statistics), with a per-row loss and without a recipe ``train_step`` of its own (the GPipe
    schedule runs forward and backward itself). With ``x``, the layers are checked against the
    model's own forward on a few rows."""
    if mode == "none":
        return
    recipe = recipe_of(model)
    label = f"recipe {recipe.identity.label()}"
    if mode in ("data", "pipeline") and not recipe.per_sample_loss:
        cut = "replicas' shards" if mode == "data" else "micro-batches"
        raise ConfigError(
            f"In-site {mode} parallelism cuts each batch into {cut}, but {label}'s loss couples "
            f"the rows of a batch (per_sample_loss = False: e.g. a Cox partial likelihood over "
            f"risk sets), so the pieces would train another objective. Use parallel=model:stages=S "
            f"(whole batches on several devices) or none. Received: {label}, parallel mode {mode!r}"
        )
    if mode == "data":
        return
    layers = model_layers(model, mode)
    if mode == "pipeline":
        if has_batch_norm(model):
            raise ConfigError(
                f"In-site pipeline parallelism feeds each stage micro-batches, but {label}'s "
                f"model has BatchNorm, whose statistics would then be those of each micro-batch "
                f"(and of padding rows) instead of the batch's. Use parallel=model:stages=S (the "
                f"same steps as one device) or data:replicas=R. Received: {label}, parallel "
                f"mode 'pipeline'"
            )
        if type(recipe).train_step is not Recipe.train_step:
            raise ConfigError(
                f"In-site pipeline parallelism runs forward and backward by its GPipe schedule, "
                f"so it cannot call {label}'s own train_step ({type(recipe).__name__}.train_step: "
                f"e.g. its clipping or mixed precision would be skipped). Use "
                f"parallel=model:stages=S or data:replicas=R, which call it, or drop the "
                f"train_step override. Received: {label}, parallel mode 'pipeline'"
            )
    _check_layers_cover(model, layers, label, mode, x)


def _check_layers_cover(model: nn.Module, layers: list[tuple[str, nn.Module]], label: str,
                        mode: str, x: np.ndarray | None) -> None:
    """Every trained parameter belongs to one layer, and the layers in order compute the
    model's forward (on up to 4 rows, in eval mode). Buffers outside the layers (the built-ins'
    target scaling) are not used by the forward and stay as they are."""
    held = {id(t) for _, m in layers for t in m.parameters()}
    left = [n for n, t in model.named_parameters() if t.requires_grad and id(t) not in held]
    if left:
        raise ConfigError(
            f"In-site {mode} parallelism places each layer of {label}'s layers(model) on a "
            f"stage, but tensors {left[:4]} belong to none of them, so they would not train or "
            f"travel. Return every sub-module the forward uses from layers(model). Received: "
            f"layers {[n for n, _ in layers]}"
        )
    if x is None or len(x) == 0:
        return
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            where = next((t.device for t in model.parameters()), torch.device("cpu"))
            xb = torch.as_tensor(np.asarray(x[:4]), dtype=torch.float32).to(where)
            want = model(xb)
            got = xb
            for _, module in layers:
                got = module(got)
    finally:
        model.train(was)
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
            and want.shape == got.shape and torch.allclose(want, got, rtol=1e-5, atol=1e-6)):
        raise ConfigError(
            f"In-site {mode} parallelism runs {label}'s layers(model) one after another, but "
            f"they do not compute the model's forward (it does more than chain them, e.g. a "
            f"skip connection). Return layers whose chain is the forward, or use "
            f"parallel=data:replicas=R. Received: layers {[n for n, _ in layers]}"
        )


def fit_parallel(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device | None = None,
    proximal_mu: float = 0.0,
    parallel: str | ParallelConfig = "none",
) -> ParallelFit:
    """Train ``model`` in place like `client.train.fit`, split as ``parallel`` says.

    ``batch_size`` is always the global batch, so every mode takes the same optimizer steps
    on the same batches as ``fit`` (same ``seed`` -> same order) and ends with the same
    weights up to float rounding; keep ``lr`` unchanged. ``parallel`` is a `ParallelConfig`
    or its string (``none``, ``data:replicas=2``, ``model:map=norm+body.0-2/body.3-6``,
    ``pipeline:stages=2,microbatches=4``). ``device`` is used by ``none`` only (the other
    modes place work with the ``devices`` option). The model ends on the CPU, in train mode.
    """
    cfg = as_config(parallel)
    check_inputs(x, y, epochs=epochs, batch_size=batch_size)
    began = time.perf_counter()
    samples = epochs * len(x)
    common = {"epochs": epochs, "lr": lr, "batch_size": batch_size, "seed": seed,
              "proximal_mu": proximal_mu}
    check_recipe_mode(model, cfg.mode, x)
    if cfg.mode == "none":
        loss = fit(model, x, y, device=device or pick_device("auto"), **common)
        took = time.perf_counter() - began
        return ParallelFit(loss, "none", 1, cfg.to_string(), samples, took, took)
    check_batch_norm_batches(model, x, batch_size)
    if cfg.mode == "data":
        devices = resolve_devices(cfg.devices, cfg.replicas, distinct_cuda=True)
        run = train_replicas(model, x, y, devices=devices, start_method=cfg.start_method,
                             timeout_s=cfg.timeout_s, **common)
        return ParallelFit(run.loss, "data", cfg.replicas, cfg.to_string(), samples, run.seconds,
                           time.perf_counter() - began)
    device_map = resolve_device_map(model, cfg.device_map, cfg.stages)
    cfg = replace(cfg, stages=len(device_map), device_map=device_map.to_string())
    if cfg.mode == "model":
        devices = resolve_devices(cfg.devices, len(device_map), distinct_cuda=False)
        loss, seconds = fit_layer_split(model, x, y, device_map=device_map, devices=devices, **common)
    else:
        devices = resolve_devices(cfg.devices, len(device_map), distinct_cuda=True)
        # imported here, not with the agent: torch.distributed.pipelining pulls in FSDP and
        # torch.distributed._shard, whose circular imports deadlock (`_DeadlockError`) when
        # Flower's simulation loads the ClientApp while the coordinator's thread imports Opacus
        from fedsplit.client.parallel.pipeline import train_pipeline

        run = train_pipeline(model, x, y, device_map=device_map, devices=devices,
                             microbatches=cfg.microbatches, start_method=cfg.start_method,
                             timeout_s=cfg.timeout_s, **common)
        loss, seconds = run.loss, run.seconds
    return ParallelFit(loss, cfg.mode, len(device_map), cfg.to_string(), samples, seconds,
                       time.perf_counter() - began)

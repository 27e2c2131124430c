"""`fit_parallel`: `client.train.fit` with the site's training split across devices."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from fedsplit.client.models import KINDS, SiteModel
from fedsplit.client.parallel.config import ParallelConfig, as_config
from fedsplit.client.parallel.device_map import resolve_device_map, resolve_devices
from fedsplit.client.parallel.layer_split import fit_layer_split
from fedsplit.client.parallel.loop import check_inputs
from fedsplit.client.parallel.replicas import train_replicas
from fedsplit.client.train import fit, pick_device
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.errors import ConfigError


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


def fit_parallel(
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
    if cfg.mode != "none" and getattr(getattr(model, "spec", None), "kind", "") not in KINDS:
        raise ConfigError(
            f"In-site parallelism ({cfg.mode}) splits the built-in MLP and CNN; a recipe's model "
            f"trains with its own step on one device. Use parallel=none. Received: recipe "
            f"{model.spec.identity.label()}, parallel={cfg.to_string()!r}"
        )
    if cfg.mode == "none":
        loss = fit(model, x, y, device=device or pick_device("auto"), **common)
        took = time.perf_counter() - began
        return ParallelFit(loss, "none", 1, cfg.to_string(), samples, took, took)
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

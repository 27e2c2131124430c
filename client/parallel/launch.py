"""Start R worker processes that form one torch.distributed group, and wait for them (bounded).

Workers rendezvous over TCP on a free 127.0.0.1 port. On CPU they use the gloo backend and,
where the platform allows, ``fork`` (the children inherit the imported torch: about 0.2 s
to start two workers here instead of about 9 s with ``spawn``); with CUDA they use NCCL and
``spawn`` (CUDA cannot be used in a forked child).
"""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fedsplit.protocol.errors import ParallelRunError
from torch import nn
from torch.multiprocessing.spawn import ProcessException


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pick_start_method(requested: str, uses_cuda: bool) -> str:
    """``fork`` for CPU runs where available, else ``spawn``; an explicit choice wins."""
    if requested != "auto":
        return requested
    if uses_cuda or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "fork"


def init_worker(rank: int, world: int, port: int, backend: str, timeout_s: float) -> None:
    """Join the process group (called first in every worker)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, backend: str,
           timeout_s: float, out_dir: str, args: tuple[Any, ...]) -> None:
    init_worker(rank, world, port, backend, timeout_s)
    try:
        fn(rank, world, Path(out_dir), *args)
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., None], world: int, args: tuple[Any, ...], *, backend: str,
                start_method: str, timeout_s: float, what: str) -> dict[int, dict[str, Any]]:
    """Run ``fn(rank, world, out_dir, *args)`` in ``world`` processes; return rank -> saved result.

    Waits at most ``timeout_s`` (then kills the workers); a worker's exception is re-raised as
    `ParallelRunError` with its traceback.
    """
    with tempfile.TemporaryDirectory(prefix="fedsplit-parallel-") as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, free_port(), backend, max(timeout_s, 30.0), tmp, args),
            nprocs=world,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise ParallelRunError(
                        f"{what} did not finish within {timeout_s:g} s; raise the timeout option "
                        f"(e.g. timeout=7200) or train on fewer rows per round. "
                        f"Received: timeout={timeout_s:g}"
                    )
        except ProcessException as e:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            last = lines[-1].strip() if lines else type(e).__name__
            raise ParallelRunError(
                f"A worker of {what} failed; its traceback:\n{str(e).strip()}\n"
                f"Fix the cause named in the last line (the other workers were stopped). "
                f"Received: {last}"
            ) from None
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        return {int(f.stem.removeprefix("rank")): torch.load(f, weights_only=True)
                for f in Path(tmp).glob("rank*.pt")}


def save_result(out_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """What a worker hands back (tensors, numbers, strings), read by `run_workers`."""
    torch.save(result, out_dir / f"rank{rank}.pt")


@dataclass(frozen=True)
class WorkerRun:
    """What a multi-process run hands back (the weights are already in the model)."""

    loss: float
    seconds: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def launch(model: nn.Module, worker: Callable[..., None], devices: list[torch.device],
           *args: Any, start_method: str, timeout_s: float, what: str) -> dict[int, dict[str, Any]]:
    """Run ``worker(rank, world, out_dir, template, *args)`` on one process per device;
    ``template`` is a CPU copy of ``model`` (its recipe and attributes included), which each
    worker copies again before training it (forked workers share it; spawned ones unpickle it)."""
    uses_cuda = devices[0].type == "cuda"
    template = copy.deepcopy(model).cpu()
    return run_workers(
        worker,
        len(devices),
        (template, *args),
        backend="nccl" if uses_cuda else "gloo",
        start_method=pick_start_method(start_method, uses_cuda),
        timeout_s=timeout_s,
        what=what,
    )


def collect(model: nn.Module, results: dict[int, dict[str, Any]]) -> WorkerRun:
    """Load the workers' weights into ``model`` (on the CPU) and gather loss, time and grads."""
    merged = {k: v.clone() for k, v in model.state_dict().items()}
    grads: dict[str, torch.Tensor] = {}
    for rank in sorted(results):
        merged.update(results[rank].get("state", {}))
        grads.update(results[rank].get("grads", {}))
    model.load_state_dict(merged)
    model.cpu().train()
    loss = next(float(r["loss"]) for r in results.values() if "loss" in r)
    seconds = max(float(r["seconds"]) for r in results.values())
    return WorkerRun(loss, seconds, grads)

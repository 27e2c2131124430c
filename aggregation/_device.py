"""The GPU backend: the six aggregation operations in torch on a CUDA device.

`GpuBackend` is what `aggregation.backend.BackendSettings.select` returns for a pass on the
GPU; where the passes run is the settings' ``device`` (``fedsplit aggregate --device``,
``BackendSettings(device=...)``), read with their ``mode`` (``FEDSPLIT_AGG_BACKEND``):

- ``cpu``: never the GPU (numpy or the compiled kernels);
- ``cuda`` / ``cuda:N``: every pass on that device (an error when torch has no CUDA device);
- ``auto`` (default): the first CUDA device when there is one, for passes over at least
  `aggregation.backend.COMPILED_FROM` values (under ``FEDSPLIT_AGG_BACKEND=auto``; every pass
  under ``gpu``; none under ``numpy`` or ``compiled``); else the CPU. Whether a machine may
  have a GPU is checked without importing torch (an NVIDIA driver node, and torch installed),
  so an aggregation on a machine without one never imports torch.

On the device, blocks are read on the host exactly as on the CPU (`aggregation._blocks`: the
``(N, b)`` stack, sized to the memory budget, or each update's block), copied to the device
and reduced there; the budget covers the device's copies too (`DEVICE_BYTES_PER_VALUE`).
Results equal the numpy reference within the tolerances of docs/aggregation.md ("Backends"):
sorted ranks and the Krum choice are the same, sums run in float64.

`TorchDevice` also runs on ``torch.device("cpu")``: the tests use that to check the torch code
against the numpy reference on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fedsplit.aggregation._blocks import flat_view, iter_stacks, plan_stack
from fedsplit.aggregation._interface import Backend, DistancePass, MeanPass, OrderResults
from fedsplit.aggregation.errors import AggregationError
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import UpdateSource

#: Device bytes per stacked value beyond the stack's own copy: sorted values and their int64
#: order, a float64 and a working-precision temporary (itemsize 8 counted).
DEVICE_BYTES_PER_VALUE = 4 * 8 + 16


class TorchDevice:
    """A torch device the aggregation passes run on (CUDA in use; CPU in the tests)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"TorchDevice({str(self.device)!r})"

    # ---------------------------------------------------------------------------- helpers

    def _to(self, array: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    @staticmethod
    def _host(tensor: Any) -> np.ndarray:
        return tensor.detach().cpu().numpy()

    def _finish(self, x: Any, res: Any, out: np.ndarray) -> Any:
        """Write ``res`` to ``out`` (its dtype); return each row's float64 squared distance."""
        final = res.to(getattr(self.torch, out.dtype.name))
        out[...] = self._host(final)
        diff = x - final.to(x.dtype)
        return self.torch.sum(diff * diff, dim=1, dtype=self.torch.float64)

    # ---------------------------------------------------------------- order statistics

    def trim(self, stack: np.ndarray, out: np.ndarray, cut: int) -> tuple[np.ndarray, np.ndarray]:
        """Unweighted trimmed mean / median of a stacked block (as `_reference.trim_tile`)."""
        torch = self.torch
        x = self._to(stack)
        n = x.shape[0]
        srt = torch.sort(x, dim=0).values
        width = n - 2 * cut
        if width == 1:
            res = srt[cut]
        elif width == 2:
            res = (srt[cut] + srt[cut + 1]) / 2
        else:
            res = torch.sum(srt[cut : n - cut], dim=0, dtype=torch.float64) / width
        if cut == 0:
            dropped = torch.zeros(n, dtype=torch.float64)
        elif width == 1:
            dropped = (x != srt[cut]).sum(dim=1)
        else:
            dropped = (x < srt[cut]).sum(dim=1) + (x > srt[n - cut - 1]).sum(dim=1)
        del srt
        dist2 = self._finish(x, res, out)
        return self._host(dropped).astype(np.float64), self._host(dist2)

    def weighted_median(
        self, stack: np.ndarray, out: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Count-weighted median of a stacked block (as `_reference.weighted_median_tile`)."""
        torch = self.torch
        x = self._to(stack)
        n, t = x.shape
        total = int(counts.sum())
        v, order = torch.sort(x, dim=0)
        cum = torch.cumsum(self._to(counts.astype(np.int64))[order], dim=0)
        k = (2 * cum >= total).to(torch.uint8).argmax(dim=0, keepdim=True)
        tie = (2 * cum.gather(0, k) == total)[0]
        k1 = torch.clamp(k + 1, max=n - 1)
        lo, hi = v.gather(0, k)[0], v.gather(0, k1)[0]
        res = torch.where(tie, (lo + hi) / 2, lo)
        used = torch.bincount(order.gather(0, k)[0], minlength=n)
        used += torch.bincount(order.gather(0, k1)[0][tie], minlength=n)
        del v, order, cum
        dist2 = self._finish(x, res, out)
        return (t - self._host(used)).astype(np.float64), self._host(dist2)

    def weighted_trim(
        self, stack: np.ndarray, out: np.ndarray, counts: np.ndarray, lo: float, hi: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Count-weighted trimmed mean of a stacked block (as `_reference.weighted_trim_tile`)."""
        torch = self.torch
        x = self._to(stack)
        n = x.shape[0]
        v, order = torch.sort(x, dim=0)
        w = self._to(counts.astype(np.float64))[order]
        cum = torch.cumsum(w, dim=0)
        kept = (torch.clamp(cum, max=hi) - torch.clamp(cum - w, min=lo)).clamp_(min=0.0)
        res = torch.sum(v.to(torch.float64) * kept, dim=0) / kept.sum(dim=0)
        dropped = torch.zeros(n, dtype=torch.float64, device=self.device)
        dropped.index_add_(0, order.reshape(-1), (1.0 - kept / w).reshape(-1))
        del v, order, w, cum, kept
        dist2 = self._finish(x, res, out)
        return self._host(dropped), self._host(dist2)

    # ---------------------------------------------------------------------------- Krum

    def gram(self, stack: np.ndarray) -> np.ndarray:
        """The block's Gram matrix (float64), each coordinate centred on its mean first."""
        torch = self.torch
        x = self._to(stack)
        x -= torch.mean(x, dim=0, dtype=torch.float64).to(x.dtype)
        x64 = x.to(torch.float64)
        return self._host(x64 @ x64.T)

    # ------------------------------------------------------------------ streamed passes

    def weighted_mean(
        self,
        updates: Sequence[UpdateSource],
        specs: Sequence[ArraySpec],
        share: np.ndarray,
        arrays: dict[str, np.ndarray],
        memory_budget: int,
        workers: int,
    ) -> int:
        """``arrays = sum_k share_k w_k`` (float64 sums on the device); return working bytes.
        ``workers`` threads fill each block's stack on the host."""
        torch = self.torch
        plan = plan_stack(
            len(updates), specs, memory_budget=memory_budget, bytes_per_value=8,
            bytes_per_coordinate=3 * 8,
        )
        weights = self._to(share.astype(np.float64))
        for block, stack in iter_stacks(updates, specs, plan, workers=workers):
            x = self._to(stack)
            acc = torch.zeros(block.size, dtype=torch.float64, device=self.device)
            for k in range(len(updates)):
                acc += x[k].to(torch.float64) * weights[k]
            out = flat_view(arrays, block)
            out[...] = self._host(acc.to(getattr(torch, out.dtype.name)))
        return plan.working_bytes

    def distances(
        self,
        updates: Sequence[UpdateSource],
        specs: Sequence[ArraySpec],
        arrays: dict[str, np.ndarray],
        memory_budget: int,
        workers: int,
    ) -> tuple[np.ndarray, int]:
        """Each update's L2 distance to ``arrays`` (differences in the working precision)."""
        torch = self.torch
        plan = plan_stack(
            len(updates), specs, memory_budget=memory_budget, bytes_per_value=8,
            bytes_per_coordinate=8,
        )
        total = torch.zeros(len(updates), dtype=torch.float64, device=self.device)
        for block, stack in iter_stacks(updates, specs, plan, workers=workers):
            x = self._to(stack)
            ref = np.asarray(arrays[block.name]).reshape(-1)[block.start : block.stop]
            diff = x - self._to(ref).to(x.dtype)
            total += torch.sum(diff * diff, dim=1, dtype=torch.float64)
        return np.sqrt(self._host(total)), plan.working_bytes


# -------------------------------------------------------------------------------- choice


@dataclass(frozen=True)
class Choice:
    """A resolved device setting (`resolve`)."""

    device: TorchDevice | None
    forced: bool  # a device named explicitly: every pass uses it, whatever its size
    spec: str = "auto"  # as the settings name it: auto, cpu, cuda, cuda:N (or a TorchDevice)


_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_spec(spec: str) -> str:
    """``spec`` normalised, if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; else the error."""
    text = str(spec).strip().lower()
    if not _SPEC.fullmatch(text):
        raise AggregationError(
            f"The aggregation device is 'auto' (the GPU when there is one), 'cpu', 'cuda' or "
            f"'cuda:N'. Received: {spec!r}"
        )
    return text


def _may_have_cuda() -> bool:
    """An NVIDIA driver is loaded and torch is installed (checked without importing torch)."""
    driver = os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")
    return driver and importlib.util.find_spec("torch") is not None


def resolve(spec: str | TorchDevice) -> Choice:
    """Turn ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (or a `TorchDevice`) into a choice."""
    if isinstance(spec, TorchDevice):
        return Choice(spec, True, str(spec.device))
    text = check_spec(spec)
    if text == "cpu" or (text == "auto" and not _may_have_cuda()):
        return Choice(None, False, text)
    import torch

    if not torch.cuda.is_available():
        if text == "auto":
            return Choice(None, False, text)
        raise AggregationError(
            f"--device {text} asks for a CUDA GPU, but torch sees none (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}). Use --device "
            f"cpu or auto, or install torch's CUDA build. Received: {spec!r}"
        )
    index = int(text.split(":")[1]) if ":" in text else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise AggregationError(
            f"There are {torch.cuda.device_count()} CUDA device(s), numbered from 0. "
            f"Received: {spec!r}"
        )
    return Choice(TorchDevice(f"cuda:{index}"), text != "auto", text)


def gpu_for(mode: str, choice: Choice, values: int, threshold: int) -> TorchDevice | None:
    """The GPU a pass over ``values`` values runs on, None for the CPU (the policy:
    `aggregation.backend.BackendSettings.select`; ``choice`` is its resolved device)."""
    if mode == "gpu":
        if choice.device is not None:
            return choice.device
        if choice.spec == "cpu":
            raise AggregationError(
                "FEDSPLIT_AGG_BACKEND=gpu runs every pass on a CUDA GPU, but the call asks for "
                "the CPU. Drop --device cpu (or device='cpu'), or unset FEDSPLIT_AGG_BACKEND. "
                "Received: device 'cpu'"
            )
        try:
            return resolve("cuda").device
        except AggregationError as e:
            raise AggregationError(
                f"FEDSPLIT_AGG_BACKEND=gpu runs every pass on a CUDA GPU, but there is none: {e}"
            ) from e
    if choice.device is None:
        return None
    if choice.forced or (mode == "auto" and values >= threshold):
        return choice.device
    return None


class GpuBackend(Backend):
    """The six operations in torch on one device (`TorchDevice`); every block goes there."""

    name = "gpu"
    device_bytes_per_value = DEVICE_BYTES_PER_VALUE

    def __init__(self, device: TorchDevice, workers: int) -> None:
        super().__init__(workers)
        self.device = device

    def weighted_sum(self, updates, specs, share, arrays, *, memory_budget, distances):
        working = self.device.weighted_mean(updates, specs, share, arrays, memory_budget,
                                            self.workers)
        dist = None
        if distances:  # a second pass over the updates
            dist, used = self.device.distances(updates, specs, arrays, memory_budget,
                                               self.workers)
            working = max(working, used)
        return MeanPass(arrays=arrays, working_bytes=working, distances=dist)

    def squared_distances(self, updates, specs, arrays, *, memory_budget) -> DistancePass:
        return DistancePass(*self.device.distances(updates, specs, arrays, memory_budget,
                                                   self.workers))

    def trimmed_mean(self, values, out, cut) -> OrderResults:
        return [self.device.trim(values, out, cut)]

    def weighted_median(self, values, out, counts) -> OrderResults:
        return [self.device.weighted_median(values, out, counts)]

    def weighted_trimmed_mean(self, values, out, counts, lo, hi) -> OrderResults:
        return [self.device.weighted_trim(values, out, counts, lo, hi)]

    def gram(self, values, grams) -> None:
        grams[0] += self.device.gram(values)

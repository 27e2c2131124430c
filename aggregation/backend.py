"""The aggregation backends: six operations behind one interface, and the choice (`BackendSettings`).

Every aggregation rule is built from six operations over the N updates:

- ``weighted_sum``: ``sum_k s_k w_k`` (FedAvg, multi-Krum's selection, each Weiszfeld step),
  optionally with each update's distance to the result in the same pass;
- ``squared_distances``: each update's squared L2 distance to an aggregate;
- ``trimmed_mean``: the coordinate-wise trimmed mean (the median is its middle cut);
- ``weighted_median`` and ``weighted_trimmed_mean``: their sample-count-weighted forms;
- ``gram``: the Gram matrix of the centred updates (Krum's pairwise distances).

A rule calls the functions of this module, named after them (``backend.weighted_sum(...)``,
``backend.median(...)``, ``backend.gram(...)``, ...), with the `BackendSettings` it was given,
and never asks which technology runs. Each function plans its pass (blocks within the memory
budget, worker threads), asks the settings' `BackendSettings.select` once for the backend of the
whole pass, and hands it the blocks. The settings are built once, where a command or a service
starts (`BackendSettings.from_environ`), and passed in: nothing reads the environment during a
pass. A backend implements the
`Backend` interface (`aggregation._interface`):

- `aggregation._reference.NumpyBackend` (``numpy``): the reference every other backend is
  tested against, and the one they fall back to where they have no implementation;
- `aggregation._compiled.CompiledBackend` (``compiled``): C kernels built with cffi for the
  two streamed operations, numba kernels for the four stacked ones (why two technologies:
  `BackendSettings.select`);
- `aggregation._device.GpuBackend` (``gpu``): torch on a CUDA device.

numba, cffi and torch are imported inside aggregation/ by those backend modules only
(`_compiled`, `_numba_kernels`, `_ckernels`, `_device`; a test checks it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from fedsplit.aggregation._blocks import (
    DEFAULT_MEMORY_BUDGET,
    Block,
    BlockPlan,
    Rows,
    StackReducer,
    empty_like_specs,
    flag_non_finite,
    run_stacked,
    work_dtype,
)
from fedsplit.aggregation._interface import (
    OPERATIONS,
    STACKED,
    STREAMED,
    Backend,
    DistancePass,
    GramPass,
    MeanPass,
    OrderPass,
    OrderResults,
)
from fedsplit.aggregation._reference import stacked_bytes
from fedsplit.aggregation.building_blocks import shares_of
from fedsplit.aggregation.errors import NotEnoughUpdatesError
from fedsplit.aggregation.settings import COMPILED_FROM, BackendSettings
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import UpdateSource

__all__ = [
    "COMPILED_FROM", "OPERATIONS", "STACKED", "STREAMED", "Backend", "BackendSettings",
    "DistancePass", "GramPass", "MeanPass", "OrderPass", "OrderResults", "gram", "median",
    "squared_distances", "trimmed_mean", "weighted_median", "weighted_sum",
    "weighted_trimmed_mean",
]

# --------------------------------------------------------------------------------------------
# The operations, as rules call them


def _specs(updates: Sequence[UpdateSource]) -> tuple[ArraySpec, ...]:
    if not updates:
        raise NotEnoughUpdatesError("A pass needs at least one update. Received: 0 updates")
    return tuple(updates[0].header.specs)


def _values(updates: Sequence[UpdateSource], specs: Sequence[ArraySpec]) -> int:
    return len(updates) * sum(s.size for s in specs)


def weighted_sum(
    updates: Sequence[UpdateSource],
    weights: Sequence[float] | np.ndarray,
    *,
    settings: BackendSettings,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    out: dict[str, np.ndarray] | None = None,
    distances: bool = False,
) -> MeanPass:
    """Return ``sum_k s_k w_k`` with shares ``s_k = weights_k / sum(weights)`` (the weighted
    mean), streamed.

    ``weights`` are any non-negative numbers (sample counts give FedAvg). The result is written
    to ``out`` when given (arrays shaped like the updates, e.g. the previous iterate of an
    iterative rule: the pass does not read it), else to new arrays. Working memory: a few
    block-sized buffers per thread, within ``memory_budget``. With ``distances``, each
    update's L2 distance to the result comes from the same pass (``.distances``), each block's
    right after it while its inputs are still in the cache, instead of a second pass
    (`squared_distances`) reading every input again.
    """
    specs = _specs(updates)
    settings.prepare_reads(updates)
    share = shares_of(weights, len(updates))
    arrays = out if out is not None else empty_like_specs(specs)
    chosen = settings.select("weighted_sum", _values(updates, specs))
    mean = chosen.weighted_sum(
        updates, specs, share, arrays, memory_budget=memory_budget, distances=distances
    )
    flag_non_finite(updates, list(arrays.values()))
    if mean.distances is not None:
        flag_non_finite(updates, [mean.distances])
    return mean


def squared_distances(
    updates: Sequence[UpdateSource],
    arrays: dict[str, np.ndarray],
    *,
    settings: BackendSettings,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> DistancePass:
    """Each update's squared L2 distance to ``arrays`` (all parameters), as its root: the L2
    distance (``.values``).

    Block by block (each block of ``arrays`` stays in cache while every update's block is
    compared with it, so each input byte is read once), blocks shared out among the worker
    threads. Differences are taken in the working precision (float32 for float16/32 models);
    squares are summed in float64 per block (so the last bits depend on the block length).
    """
    specs = _specs(updates)
    settings.prepare_reads(updates)
    chosen = settings.select("squared_distances", _values(updates, specs))
    dist = chosen.squared_distances(updates, specs, arrays, memory_budget=memory_budget)
    flag_non_finite(updates, [dist.values])
    return dist


class _Stacked(StackReducer):
    """Feeds each stacked block to one operation of the pass's backend and adds up what the
    operation reports per update (order statistics: values dropped, squared distances)."""

    def __init__(self, chosen: Backend, operation: str, n: int, itemsize: int, **params) -> None:
        per_value, self.bytes_per_coordinate = stacked_bytes(operation, itemsize)
        # every worker's tile scratch is at most one block's share of values, so counting it
        # per stacked value keeps the total within the plan; the GPU's copies count too
        self.bytes_per_value = max(chosen.workers * per_value, chosen.device_bytes_per_value)
        self.chosen, self.operation, self.params = chosen, operation, params
        self.run = getattr(chosen, operation)
        self.dropped = np.zeros(n, dtype=np.float64)
        self.dist2 = np.zeros(n, dtype=np.float64)
        self.coords = 0

    def takes_rows(self, plan: BlockPlan) -> bool:
        return self.chosen.takes_rows(self.operation, plan)

    def proof(self) -> list[np.ndarray]:
        """The squared distances: every value read enters one, so they are finite only if all
        values were (or the sum overflowed)."""
        return [self.dist2]

    def __call__(self, block: Block, stack: np.ndarray | Rows, out: np.ndarray | None) -> None:
        assert out is not None
        for dropped, dist2 in self.run(stack, out, **self.params):
            self.dropped += dropped
            self.dist2 += dist2
        self.coords += block.size


def _order_statistic(
    updates: Sequence[UpdateSource], operation: str, settings: BackendSettings,
    memory_budget: int, **params
) -> OrderPass:
    specs = _specs(updates)
    settings.prepare_reads(updates)
    itemsize = max(work_dtype(s.dtype).itemsize for s in specs)
    chosen = settings.select(operation, _values(updates, specs))
    reducer = _Stacked(chosen, operation, len(updates), itemsize, **params)
    outputs = empty_like_specs(specs)
    plan = run_stacked(updates, specs, reducer, memory_budget=memory_budget,
                       workers=chosen.workers, outputs=outputs)
    return OrderPass(
        arrays=outputs,
        dropped=reducer.dropped / max(reducer.coords, 1),
        distances=np.sqrt(reducer.dist2),
        working_bytes=plan.working_bytes,
    )


def trimmed_mean(
    updates: Sequence[UpdateSource], cut: int, *, settings: BackendSettings,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> OrderPass:
    """Coordinate-wise mean of the sorted values ``cut .. N-cut-1`` (``cut`` dropped at each
    end), over parameter blocks of all N updates within the budget (`run_stacked`).

    Two kept values are averaged in the input precision, as ``np.median`` does; more are
    summed in float64."""
    if not 0 <= 2 * cut < len(updates):
        raise ValueError(f"cut must satisfy 0 <= 2*cut < N={len(updates)}. Received: {cut}")
    return _order_statistic(updates, "trimmed_mean", settings, memory_budget, cut=cut)


def median(
    updates: Sequence[UpdateSource], *, settings: BackendSettings,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> OrderPass:
    """Coordinate-wise median: the trimmed mean at the middle cut ``(N-1)//2`` (even N: the
    mean of the two middle values, as numpy)."""
    return trimmed_mean(updates, (len(updates) - 1) // 2, settings=settings,
                        memory_budget=memory_budget)


def weighted_median(
    updates: Sequence[UpdateSource], counts: np.ndarray, *, settings: BackendSettings,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> OrderPass:
    """Coordinate-wise sample-count-weighted median (`_reference.weighted_median` defines it)."""
    return _order_statistic(updates, "weighted_median", settings, memory_budget, counts=counts)


def weighted_trimmed_mean(
    updates: Sequence[UpdateSource], counts: np.ndarray, beta: float, *,
    settings: BackendSettings, memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> OrderPass:
    """Coordinate-wise sample-count-weighted trimmed mean: the count mass below ``beta`` and
    above ``1 - beta`` of the total is cut (`_reference.weighted_trimmed_mean` defines it)."""
    total = float(counts.sum())
    return _order_statistic(
        updates, "weighted_trimmed_mean", settings, memory_budget,
        counts=counts, lo=beta * total, hi=(1.0 - beta) * total,
    )


class _GramReducer(StackReducer):
    """Accumulates the centred Gram matrix of the N updates, block by block."""

    def __init__(self, chosen: Backend, n: int) -> None:
        self.chosen = chosen
        self.bytes_per_value = chosen.device_bytes_per_value  # centred in place on the CPU
        self.grams = [np.zeros((n, n), dtype=np.float64) for _ in range(chosen.workers)]

    def takes_rows(self, plan: BlockPlan) -> bool:
        return self.chosen.takes_rows("gram", plan)

    def proof(self) -> list[np.ndarray]:
        """The Gram matrix: a non-finite value makes its tile's column mean, hence every
        centred value of that column and the diagonal, non-finite."""
        return self.grams

    def __call__(self, block: Block, stack: np.ndarray | Rows, out: np.ndarray | None) -> None:
        self.chosen.gram(stack, self.grams)


def gram(
    updates: Sequence[UpdateSource], *, settings: BackendSettings,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> GramPass:
    """The N x N Gram matrix ``G = X X^T`` of the flattened updates, each block's coordinates
    centred on their mean first (distances do not change, cancellation does), summed in
    float64, over parameter blocks within the budget: no flattened copy of the updates."""
    specs = _specs(updates)
    settings.prepare_reads(updates)
    chosen = settings.select("gram", _values(updates, specs))
    reducer = _GramReducer(chosen, len(updates))
    plan = run_stacked(updates, specs, reducer, memory_budget=memory_budget,
                       workers=chosen.workers)
    return GramPass(np.sum(reducer.grams, axis=0), plan.working_bytes)

"""The backend interface: `Backend`'s six operations and what they return.

Implemented by `aggregation._reference.NumpyBackend` (the reference),
`aggregation._compiled.CompiledBackend` and `aggregation._device.GpuBackend`; chosen per pass
and called by the rules through `aggregation.backend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from fedsplit.aggregation._blocks import BlockPlan, Rows
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import UpdateSource

#: The operations whose compiled kernels are numba's (a start-up to pay: `backend.COMPILED_FROM`).
STACKED = ("trimmed_mean", "weighted_median", "weighted_trimmed_mean", "gram")
#: The operations whose compiled kernels are C (cffi; loaded in about a millisecond).
STREAMED = ("weighted_sum", "squared_distances")
OPERATIONS = STREAMED + STACKED


# --------------------------------------------------------------------------------------------
# What a pass returns


class MeanPass(NamedTuple):
    """A weighted sum, the working memory it held, and (when asked) each update's distance."""

    arrays: dict[str, np.ndarray]
    working_bytes: int
    #: each update's L2 distance to the result (float64), when ``weighted_sum(distances=True)``
    distances: np.ndarray | None = None


class DistancePass(NamedTuple):
    """Each update's L2 distance to an aggregate and the working memory the pass held."""

    values: np.ndarray  # float64, one per update: the root of its summed squared distances
    working_bytes: int


class OrderPass(NamedTuple):
    """An order statistic's aggregate and, per update, how much of it the rule dropped."""

    arrays: dict[str, np.ndarray]
    #: each update's share of values dropped (or, weighted, of count mass cut), in [0, 1]
    dropped: np.ndarray
    #: each update's L2 distance to the aggregate (float64)
    distances: np.ndarray
    working_bytes: int


class GramPass(NamedTuple):
    """The N x N Gram matrix of the centred updates (float64) and the working memory held."""

    gram: np.ndarray
    working_bytes: int


#: What a stacked operation returns for one block: (values dropped, squared distances) per
#: update, one pair per part the block was split into (added in this order).
OrderResults = list[tuple[np.ndarray, np.ndarray]]


# --------------------------------------------------------------------------------------------
# The interface


class Backend:
    """What every backend implements: the six operations (numpy reference: `NumpyBackend`).

    The streamed operations take the whole pass (each backend plans its own blocks within
    the budget); the stacked ones take one block of the N updates at a time from
    `aggregation._blocks.run_stacked`, as an ``(N, b)`` stack or, where `takes_rows` allows,
    as `Rows` read in place.
    """

    #: the backend's name, as ``FEDSPLIT_AGG_BACKEND`` spells it
    name = ""
    #: memory on the device per stacked value beyond the stack (the GPU's copies), budgeted
    device_bytes_per_value = 0

    def __init__(self, workers: int) -> None:
        #: worker threads of the pass (`aggregation.backend.BackendSettings.threads`)
        self.workers = workers

    def weighted_sum(
        self,
        updates: Sequence[UpdateSource],
        specs: Sequence[ArraySpec],
        share: np.ndarray,
        arrays: dict[str, np.ndarray],
        *,
        memory_budget: int,
        distances: bool,
    ) -> MeanPass:
        """Write ``sum_k share[k] * w_k`` into ``arrays``; with ``distances``, also each
        update's L2 distance to it. Non-finite values pass through (the caller checks)."""
        raise NotImplementedError

    def squared_distances(
        self,
        updates: Sequence[UpdateSource],
        specs: Sequence[ArraySpec],
        arrays: dict[str, np.ndarray],
        *,
        memory_budget: int,
    ) -> DistancePass:
        """Each update's squared L2 distance to ``arrays``, summed over every parameter
        (returned as its root)."""
        raise NotImplementedError

    def trimmed_mean(self, values: np.ndarray | Rows, out: np.ndarray, cut: int) -> OrderResults:
        """Mean of the sorted values ``cut .. N-cut-1`` of each coordinate of the block."""
        raise NotImplementedError

    def weighted_median(
        self, values: np.ndarray | Rows, out: np.ndarray, counts: np.ndarray
    ) -> OrderResults:
        """Count-weighted median of each coordinate of the block (dropped: values not used)."""
        raise NotImplementedError

    def weighted_trimmed_mean(
        self, values: np.ndarray | Rows, out: np.ndarray, counts: np.ndarray, lo: float, hi: float
    ) -> OrderResults:
        """Mean of each coordinate's values weighted by the count mass they keep between
        ``lo`` and ``hi`` (dropped: each update's share of mass cut, summed)."""
        raise NotImplementedError

    def gram(self, values: np.ndarray | Rows, grams: list[np.ndarray]) -> None:
        """Add the block's Gram matrix, each coordinate centred on its mean, to ``grams`` (one
        float64 N x N accumulator per worker thread; summed at the end)."""
        raise NotImplementedError

    def takes_rows(self, operation: str, plan: BlockPlan) -> bool:
        """Whether blocks of ``plan`` may come to ``operation`` as `Rows` (read in place, not
        checked finite: the operation's output proves them finite) instead of a stack."""
        return False

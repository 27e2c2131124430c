"""FedAvg: the sample-count-weighted mean (McMahan et al., 2017).

    w = sum_k n_k * w_k / sum_k n_k

One streamed pass of the backend's ``weighted_sum`` (`aggregation.backend`) with the sample
counts as weights: the model is cut into cache-sized blocks and every update is read once,
from where it lies (a view of an in-memory update; for a weight file, one positional read of
the block's bytes from the page cache, or an HDF5 hyperslab read when the values need
converting). Nothing is stacked or cast-copied first (`bench/aggregation.py` measures the
share of the machine's read bandwidth reached). Which implementation runs (C kernels where a
C compiler built them, else numpy; torch on a GPU) is `BackendSettings.select`'s choice.

Called through `aggregation.aggregate_updates`, the same pass also gives the report's
distances: each block's distances are taken right after its sum, while the updates' values
are still in the cache, instead of a second pass over every input.

Precision: float32 products and sums (float64 for float64 models) within groups of 16 updates,
the group sums added in float64 (`aggregation._reference`); the C kernels give the same bits.
Blocks are shared out among ``FEDSPLIT_AGG_THREADS`` threads (default: every core, at most 8).
Extra memory is a few cache-sized buffers per thread (with the C kernels and weight files, one
block row per update), within the budget.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedsplit.aggregation import backend
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from fedsplit.aggregation.building_blocks import inputs_of, make_result, site_reports
from fedsplit.aggregation.registry import register
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.update import UpdateSource


class FedAvgParams(StrategyParams):
    """FedAvg takes no parameters."""


@register
class FedAvg(AggregationStrategy):
    """Sample-count-weighted mean of the updates."""

    name = "fedavg"
    checks_values_in_pass = True  # every value goes through the block passes
    summary = "Count-weighted mean of all updates (McMahan et al. 2017). No parameters."
    Params = FedAvgParams

    fuses_distances = True  # the report's distances in the mean's own pass
    linear = True  # the count-weighted mean: one secure sum gives it

    def aggregate(
        self,
        updates: Sequence[UpdateSource],
        *,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        settings: BackendSettings = DEFAULT_SETTINGS,
        distances: bool = False,
    ) -> AggregateResult:
        """Return sum(n_k * w_k) / sum(n_k), block by block (float64 across groups).

        With ``distances`` the report's ``l2_to_aggregate`` is filled in by the same pass (each
        block's distances while its inputs are in the cache); else `aggregation.run` adds them.
        """
        inputs = inputs_of(self, updates)
        mean = backend.weighted_sum(
            updates, inputs.counts, settings=settings, memory_budget=memory_budget,
            distances=distances,
        )
        weights = inputs.counts / inputs.total
        sites = (site_reports(inputs.headers, weights) if mean.distances is None
                 else site_reports(inputs.headers, weights, l2_to_aggregate=mean.distances))
        return make_result(
            self, inputs, mean.arrays, sites,
            memory_budget=memory_budget, working_bytes=mean.working_bytes,
        )

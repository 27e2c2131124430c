"""Coordinate-wise median (Yin et al., 2018), optionally weighted by sample counts.

    w[j] = median_k w_k[j]          (even N: mean of the two middle values, as numpy)

``weighted=true``: the sample-count-weighted median: sort the N values of a coordinate, take
the first whose cumulative count reaches half the total; if it reaches exactly half, average
it with the next value (so equal counts give the ordinary median). A site that claims more
rows pulls the median towards its value but can still not move it past the other sites'
values on its own while it holds under half the total count.

One stacked pass of the backend's ``trimmed_mean`` at the middle cut (``backend.median``) or
``weighted_median`` (`aggregation.backend`). Memory: parameter blocks of all N updates at a
time (`aggregation._blocks`), within the memory budget whatever N; values are read straight
from weight files when aggregating files.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedsplit.aggregation import backend
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from fedsplit.aggregation.building_blocks import inputs_of, order_result
from fedsplit.aggregation.registry import register
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.update import UpdateSource
from pydantic import Field


class MedianParams(StrategyParams):
    """Parameters of the coordinate-wise median."""

    weighted: bool = Field(
        default=False,
        description=(
            "Weight each update by its sample count: the value where the cumulative count "
            "crosses half the total (ties at exactly half: mean of the two values). False "
            "gives the plain median, identical to Flower's FedMedian."
        ),
    )


@register
class Median(AggregationStrategy):
    """Coordinate-wise median of the updates."""

    name = "median"
    checks_values_in_pass = True  # every value goes through the block passes
    summary = (
        "Coordinate-wise median (Yin et al. 2018): tolerates fewer than half the sites sending "
        "arbitrary values. Same numbers as Flower's FedMedian; weighted=true for the "
        "count-weighted median."
    )
    Params = MedianParams

    def aggregate(
        self, updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
        settings: BackendSettings = DEFAULT_SETTINGS,
    ) -> AggregateResult:
        """Return the coordinate-wise (weighted) median, working in blocks within the budget."""
        inputs = inputs_of(self, updates)
        weighted = bool(self.params.weighted)
        if weighted:
            stat = backend.weighted_median(updates, inputs.counts, settings=settings,
                                           memory_budget=memory_budget)
        else:
            stat = backend.median(updates, settings=settings, memory_budget=memory_budget)
        return order_result(self, inputs, stat, weighted=weighted, memory_budget=memory_budget)

"""Coordinate-wise trimmed mean (Yin et al., 2018), optionally weighted by sample counts.

Unweighted (same rule as Flower's FedTrimmedAvg / scipy's ``trim_mean``): at each coordinate
drop the ``floor(beta * N)`` lowest and as many highest values and average the rest.

``weighted=true`` trims by cumulative sample count instead of by number of sites: sorted value
k owns the interval [C_{k-1}, C_k] of the total count W; the mass below ``beta*W`` and above
``(1-beta)*W`` is dropped (a site's interval may be cut part-way) and the kept values are
averaged weighted by the mass they keep. With equal counts and ``beta*N`` an integer this is the
unweighted trimmed mean; ``beta=0`` gives FedAvg's count-weighted mean.

One stacked pass of the backend's ``trimmed_mean`` or ``weighted_trimmed_mean``
(`aggregation.backend`). Memory: parameter blocks of all N updates at a time
(`aggregation._blocks`), within the memory budget whatever N; values are read straight from
weight files when aggregating files.
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


class TrimmedMeanParams(StrategyParams):
    """Parameters of the coordinate-wise trimmed mean."""

    beta: float = Field(
        default=0.2,
        ge=0.0,
        lt=0.5,
        description=(
            "Fraction trimmed at EACH end, in [0, 0.5). Unweighted: floor(beta*N) values "
            "dropped per end per coordinate (Flower's proportiontocut). Weighted: beta of the "
            "total sample count dropped per end."
        ),
    )
    weighted: bool = Field(
        default=False,
        description=(
            "Trim by cumulative sample count and average the kept values weighted by the count "
            "they keep. False gives the plain trimmed mean, identical to Flower's FedTrimmedAvg."
        ),
    )


@register
class TrimmedMean(AggregationStrategy):
    """Coordinate-wise trimmed mean of the updates."""

    name = "trimmed-mean"
    checks_values_in_pass = True  # every value goes through the block passes
    summary = (
        "Coordinate-wise trimmed mean (Yin et al. 2018): drops the beta fraction of highest and "
        "lowest values per coordinate, averages the rest. Same numbers as Flower's "
        "FedTrimmedAvg; weighted=true trims by cumulative sample count."
    )
    Params = TrimmedMeanParams

    def aggregate(
        self, updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
        settings: BackendSettings = DEFAULT_SETTINGS,
    ) -> AggregateResult:
        """Return the coordinate-wise (weighted) trimmed mean, in blocks within the budget."""
        inputs = inputs_of(self, updates)
        beta = float(self.params.beta)
        weighted = bool(self.params.weighted)
        if weighted:
            stat = backend.weighted_trimmed_mean(
                updates, inputs.counts, beta, settings=settings, memory_budget=memory_budget
            )
        else:
            cut = int(beta * len(updates))
            stat = backend.trimmed_mean(updates, cut, settings=settings,
                                        memory_budget=memory_budget)
        return order_result(self, inputs, stat, weighted=weighted, memory_budget=memory_budget)

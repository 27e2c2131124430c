"""FedAvg: the sample-count-weighted mean (McMahan et al., 2017).

    w = sum_k n_k * w_k / sum_k n_k

Streaming: updates are read one at a time and one parameter at a time into float64
accumulators, so extra memory is one float64 copy of the model however many sites take
part, and the sum is exact to float64 rounding instead of float32's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aggregation.base import (
    AggregateResult,
    AggregationReport,
    AggregationStrategy,
    SiteReport,
    StrategyParams,
)
from aggregation.compat import check_compatible
from aggregation.registry import register
from protocol.update import UpdateSource


class FedAvgParams(StrategyParams):
    """FedAvg takes no parameters."""


@register
class FedAvg(AggregationStrategy):
    """Sample-count-weighted mean of the updates."""

    name = "fedavg"
    summary = "Count-weighted mean of all updates (McMahan et al. 2017). No parameters."
    Params = FedAvgParams

    def aggregate(self, updates: Sequence[UpdateSource]) -> AggregateResult:
        """Return sum(n_k * w_k) / sum(n_k), streaming one update at a time."""
        headers = [u.header for u in updates]
        check_compatible(headers)
        total = sum(h.num_examples for h in headers)
        specs = headers[0].specs
        acc = {s.name: np.zeros(s.shape, dtype=np.float64) for s in specs}
        for update, header in zip(updates, headers, strict=True):
            n = float(header.num_examples)
            for s in specs:
                # multiply in float64 so n * w never rounds in the input precision
                acc[s.name] += np.multiply(update.array(s.name), n, dtype=np.float64)
        arrays = {}
        for s in specs:
            acc[s.name] /= total
            arrays[s.name] = acc[s.name].astype(s.dtype, copy=False)
        report = AggregationReport(
            strategy=self.name,
            params=self.params.model_dump(),
            num_examples=total,
            sites=[
                SiteReport(site=h.label, num_examples=h.num_examples, weight=h.num_examples / total)
                for h in headers
            ],
        )
        return AggregateResult(arrays=arrays, num_examples=total, report=report)

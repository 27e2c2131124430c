"""FedAvg: the sample-count-weighted mean (McMahan et al., 2017).

    w = sum_k n_k * w_k / sum_k n_k

Blocked streaming: the model is cut into blocks of coordinates (see `aggregation._blocks`)
sized so that one block of every update, widened to float64, stays in the CPU cache (8 MiB,
the best of 1-16 MiB measured on the 2-core machine). Each block is filled from the updates
(a cast copy for in-memory updates, one HDF5 read for weight files) and reduced with one
float64 matrix-vector product by the weights ``n_k / sum n``. Extra memory is that one
cache-sized buffer however large the model; sums are float64 (exact to float64 rounding
instead of float32's); and each input byte is read once (`bench/aggregation.py` measures the
share of the machine's memory read bandwidth reached).
BLAS should run one thread per process on shared machines (`OPENBLAS_NUM_THREADS=1`, which
the fedsplit CLI and its Flower processes set).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aggregation._blocks import BlockReader, empty_like_specs, flat_view, plan_blocks
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

#: Bytes of the float64 block buffer (N updates x block length): stays in the L3 cache.
BLOCK_BYTES = 8 * 1024**2
#: Block length bounds (coordinates): short blocks cost per-call overhead, long ones cache misses.
MIN_BLOCK, MAX_BLOCK = 2_048, 262_144


class FedAvgParams(StrategyParams):
    """FedAvg takes no parameters."""


@register
class FedAvg(AggregationStrategy):
    """Sample-count-weighted mean of the updates."""

    name = "fedavg"
    summary = "Count-weighted mean of all updates (McMahan et al. 2017). No parameters."
    Params = FedAvgParams

    def aggregate(self, updates: Sequence[UpdateSource]) -> AggregateResult:
        """Return sum(n_k * w_k) / sum(n_k), block by block in float64."""
        headers = [u.header for u in updates]
        check_compatible(headers)
        total = sum(h.num_examples for h in headers)
        specs = headers[0].specs
        weights = np.array([h.num_examples for h in headers], dtype=np.float64) / total
        readers = [BlockReader(u) for u in updates]
        out = empty_like_specs(specs)
        length = int(np.clip(BLOCK_BYTES // (8 * len(updates)), MIN_BLOCK, MAX_BLOCK))
        stack = np.empty((len(updates), length), dtype=np.float64)
        for block in plan_blocks(specs, length):
            rows = stack[:, : block.size]
            for row, reader in zip(rows, readers, strict=True):
                values = reader.view(block)
                if values is None:  # a weight file: read the block straight into float64
                    reader.read(block, row)
                else:  # in memory: cast-copy the view
                    row[...] = values
            flat_view(out, block)[...] = weights @ rows  # float64 sum, cast to the dtype
        for reader in readers:
            reader.release()
        report = AggregationReport(
            strategy=self.name,
            params=self.params.model_dump(),
            num_examples=total,
            sites=[
                SiteReport(site=h.label, num_examples=h.num_examples, weight=h.num_examples / total)
                for h in headers
            ],
        )
        return AggregateResult(arrays=out, num_examples=total, report=report)

"""FedAvg: the sample-count-weighted mean (McMahan et al., 2017).

    w = sum_k n_k * w_k / sum_k n_k

Streaming, block by block: the model is cut into blocks of coordinates (see
`aggregation._blocks`) short enough that a block's accumulators stay in the CPU's L2 cache.
For each block every update is read once, straight from where it lies (a view of an in-memory
update, one HDF5 hyperslab read for a weight file), multiplied by its weight ``n_k / sum n``
and added to the block's accumulator. Nothing is stacked or cast-copied first, so the input
is read at close to memory speed (`bench/aggregation.py` measures the share of the machine's
read bandwidth reached).

Precision: products and sums run in the working precision (float32 for float16 and float32
models, float64 for float64 ones) over groups of `GROUP` updates, and the group sums are
added in float64. The rounding error is that of a float32 sum of `GROUP` terms however many
hospitals there are (float16 models do not accumulate in float16).

Blocks are shared out among ``FEDSPLIT_AGG_THREADS`` threads (default: every core, at most 8);
numpy's loops release the GIL. Extra memory is a few cache-sized buffers per thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aggregation._blocks import (
    Block,
    BlockReader,
    Scratch,
    empty_like_specs,
    flat_view,
    plan_blocks,
    work_dtype,
)
from aggregation._threads import map_threads, round_robin, threads_for
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

#: Coordinates per block: the term, group and float64 accumulators (4 + 4 + 8 bytes a
#: coordinate for float32 models) take 2 MiB, about one core's L2 cache (16-256 Ki measured).
BLOCK = 131_072
#: Updates summed in the working precision before their sum is added in float64 (16-64 measured
#: within noise of each other).
GROUP = 16


class FedAvgParams(StrategyParams):
    """FedAvg takes no parameters."""


class _BlockSum:
    """One thread's readers and accumulators: writes the weighted sums of whole blocks."""

    def __init__(self, updates: Sequence[UpdateSource], weights: dict[np.dtype, np.ndarray]) -> None:
        self.readers = [BlockReader(u) for u in updates]
        self.weights = weights
        self.scratch = Scratch()

    def _buf(self, key: str, dtype: np.dtype, size: int) -> np.ndarray:
        # one buffer per dtype, so models mixing dtypes do not reallocate block after block
        return self.scratch.get(f"{key}-{dtype}", (size,), dtype)

    def run(self, blocks: Sequence[tuple[Block, np.ndarray]]) -> None:
        """Sum every block in ``blocks`` into its output range."""
        for block, out in blocks:
            self.block(block, out)
        for reader in self.readers:
            reader.release()

    def block(self, block: Block, out: np.ndarray) -> None:
        """Write the weighted sum of every update's ``block`` to ``out`` (flat, model dtype)."""
        work = work_dtype(out.dtype)
        weights = self.weights[out.dtype]
        n, size = len(self.readers), block.size
        single = n <= GROUP or work == np.float64
        # one group sums straight into the output when no cast follows; else a float64 total
        group = out if single and work == out.dtype else self._buf("group", work, size)
        term = self._buf("term", work, size)
        total = group if single else self._buf("total", np.dtype(np.float64), size)
        for first in range(0, n, n if single else GROUP):
            for k in range(first, min(first + (n if single else GROUP), n)):
                dest = group if k == first else term
                values = self.readers[k].view(block)
                if values is None:  # a weight file: one hyperslab read, scaled in place
                    self.readers[k].read(block, dest)
                    np.multiply(dest, weights[k], out=dest)
                else:
                    np.multiply(values, weights[k], out=dest, casting="same_kind")
                if k != first:
                    np.add(group, term, out=group)
            if total is not group:
                if first == 0:
                    total[...] = group
                else:
                    np.add(total, group, out=total)
        if total is not out:
            out[...] = total


@register
class FedAvg(AggregationStrategy):
    """Sample-count-weighted mean of the updates."""

    name = "fedavg"
    summary = "Count-weighted mean of all updates (McMahan et al. 2017). No parameters."
    Params = FedAvgParams

    def aggregate(self, updates: Sequence[UpdateSource]) -> AggregateResult:
        """Return sum(n_k * w_k) / sum(n_k), block by block (float64 across groups)."""
        headers = [u.header for u in updates]
        check_compatible(headers)
        total = sum(h.num_examples for h in headers)
        specs = headers[0].specs
        counts = np.array([h.num_examples for h in headers], dtype=np.float64)
        out = empty_like_specs(specs)
        blocks = [(b, flat_view(out, b)) for b in plan_blocks(specs, BLOCK)]
        weights = {s.dtype: (counts / total).astype(work_dtype(s.dtype)) for s in specs}
        threads = threads_for(len(updates) * sum(s.size for s in specs), len(blocks))
        sums = [_BlockSum(updates, weights) for _ in range(threads)]
        map_threads(_BlockSum.run, threads, sums, round_robin(blocks, threads))
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

"""Coordinate-wise order statistics (median, trimmed mean) as `run_stacked` reducers.

Each stacked block ``(N, b)`` is processed in cache-sized tiles: the tile is copied transposed
(one row per coordinate, N values contiguous) and sorted along the row with numpy's
vectorised sort, which is much faster than ``np.median``/``np.partition`` along the stacked
axis that Flower uses. The unsorted stack is kept, so the same pass also counts, per update,
how often its value was dropped and its squared distance to the aggregate.

With the compiled kernels (`aggregation._kernels`: numba installed, a large pass or
``FEDSPLIT_AGG_KERNELS=numba``) each thread's share of a block goes to one kernel call instead:
a sorting network run across coordinates in L1-sized chunks, with the trim-and-sum, drop
counts and distances fused in (`aggregation._numba_kernels`), reading the updates in place
(`aggregation._blocks.Rows`) when they are in memory or mapped, so no stack is filled; the
distances then prove the values finite. The numpy code below is the reference it is tested
against. On a GPU (`aggregation._device`) the block goes to torch.

Unweighted rule with cut ``k`` (values dropped at each end): mean of the sorted values
``k .. N-k-1``. The median is the cut ``(N-1)//2`` (one or two middle values, averaged in the
input precision exactly as ``np.median`` does). Weighted rules are in `weighted_median` and
`weighted_trimmed_mean` (definitions in docs/aggregation.md).
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
from fedsplit.aggregation._blocks import (
    Block,
    BlockPlan,
    Rows,
    Scratch,
    StackReducer,
    empty_like_specs,
    run_stacked,
    stack_addresses,
    tiles,
    work_dtype,
)
from fedsplit.aggregation._device import DEVICE_BYTES_PER_VALUE, TorchDevice, active_device
from fedsplit.aggregation._kernels import compiled, kernel_dtype, selection_network
from fedsplit.aggregation._threads import map_threads, worker_count
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.building_blocks import inputs_of, make_result, site_reports
from fedsplit.protocol.update import UpdateSource

#: Coordinates per sorted tile: N values each, sized to stay in the CPU's L2 cache.
TILE = 4096


def _copy_columns(out: np.ndarray, orig: np.ndarray) -> None:
    for k in range(orig.shape[0]):
        out[:, k] = orig[k]


def _copy_transposed(out: np.ndarray, orig: np.ndarray) -> None:
    np.copyto(out, orig.T)


@functools.cache
def _transpose_copier() -> Callable[[np.ndarray, np.ndarray], None]:
    """The faster of two ways to copy an (N, t) tile into (t, N), timed once per process.

    Which wins depends on the CPU: column-by-column assignment (the destination tile stays in
    cache while each source row streams in) was 3x faster than numpy's transposing ``copyto``
    on the AMD EPYC machine, and ``copyto`` 1.7x faster than the columns on an Intel Xeon.
    """
    orig = np.random.default_rng(0).standard_normal((50, TILE), dtype=np.float32)
    out = np.empty((TILE, 50), dtype=np.float32)
    best: dict[Callable[[np.ndarray, np.ndarray], None], float] = {}
    for copier in (_copy_columns, _copy_transposed):
        for _ in range(3):
            start = time.perf_counter()
            copier(out, orig)
            best[copier] = min(best.get(copier, np.inf), time.perf_counter() - start)
    return min(best, key=best.__getitem__)


def transposed(orig: np.ndarray, scratch: Scratch, key: str = "sorted") -> np.ndarray:
    """Copy ``orig`` (N, t) into a (t, N) scratch buffer (the faster copier on this CPU)."""
    n, t = orig.shape
    out = scratch.get(key, (t, n), orig.dtype)
    _transpose_copier()(out, orig)
    return out


class _OrderReducer(StackReducer):
    """Shared driver: tiles (in parallel threads), per-update dropped share and distance."""

    #: scratch bytes per stacked value of one tile (set by subclasses)
    scratch_per_value: int = 0
    #: the compiled-kernel module (`aggregation._kernels.compiled`), None for numpy
    kernels: ModuleType | None = None
    #: the GPU the blocks go to (`aggregation._device.TorchDevice`), None for the CPU
    device: TorchDevice | None = None

    def __init__(self, counts: np.ndarray) -> None:
        # the kernels' chunk scratch (24 bytes a stacked value at most) fits the numpy path's
        self.scratch_per_value = max(self.scratch_per_value, 24)
        self.n = len(counts)
        self.counts = counts
        self.dropped = np.zeros(self.n, dtype=np.float64)
        self.dist2 = np.zeros(self.n, dtype=np.float64)
        self.coords = 0
        self.workers = worker_count()
        self._pool = queue.SimpleQueue()
        for _ in range(self.workers):
            self._pool.put(Scratch())
        # every worker's tile scratch is at most one block's share of values, so counting it
        # per stacked value keeps the total within the plan
        self.bytes_per_value = self.workers * self.scratch_per_value

    def _tile(self, orig: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        """Write the aggregate of ``orig`` (N, t) to ``out``; return each update's dropped share."""
        raise NotImplementedError

    def _run_tile(self, orig: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scratch = self._pool.get()
        try:
            dropped = self._tile(orig, out, scratch)
            diff = scratch.get("diff", orig.shape, orig.dtype)
            np.subtract(orig, out, out=diff, casting="unsafe")
            return dropped, np.einsum("ij,ij->i", diff, diff).astype(np.float64)
        finally:
            self._pool.put(scratch)

    def _kernel(
        self, rows: np.ndarray, l0: int, l1: int, out: np.ndarray, dropped: np.ndarray,
        dist2: np.ndarray,
    ) -> None:
        """Run the compiled kernel on coordinates ``l0:l1`` of the rows at addresses ``rows``
        (results into ``out``, length l1-l0)."""
        raise NotImplementedError

    def _run_kernel(self, rows: np.ndarray, out: np.ndarray, l0: int, l1: int) -> tuple:
        dropped = np.zeros(self.n, dtype=np.float64)
        dist2 = np.zeros(self.n, dtype=np.float64)
        self._kernel(rows, l0, l1, out[l0:l1], dropped, dist2)
        return dropped, dist2

    def takes_rows(self, plan: BlockPlan) -> bool:
        """The kernels read the updates in place (the numpy path and the GPU need a stack)."""
        return self.device is None and self.kernels is not None and kernel_dtype(plan.dtype)

    def proof(self) -> list[np.ndarray]:
        """The squared distances: every value read enters one, so they are finite only if all
        values were (or the sum overflowed)."""
        return [self.dist2]

    def _torch(self, stack: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Aggregate the block on the GPU; return (dropped, dist2)."""
        raise NotImplementedError

    def __call__(self, block: Block, stack: np.ndarray | Rows, out: np.ndarray | None) -> None:
        assert out is not None
        if isinstance(stack, Rows):  # read in place: only offered when the kernels run
            self._kernels(block, stack.addresses, out)
            return
        if self.device is not None:
            dropped, dist2 = self._torch(stack, out)
            self.dropped += dropped
            self.dist2 += dist2
            self.coords += block.size
            return
        if self.kernels is not None and kernel_dtype(stack.dtype) and out.dtype == stack.dtype:
            self._kernels(block, stack_addresses(stack), out)
            return
        self._add(self._numpy_tiles(block, stack, out), block)

    def _kernels(self, block: Block, rows: np.ndarray, out: np.ndarray) -> None:
        """The compiled kernel over the block's rows (addresses), a range of coordinates a thread."""
        share = -(-block.size // self.workers)
        share = -(-share // 64) * 64  # whole kernel chunks per thread
        ranges = [(l0, min(l0 + share, block.size)) for l0 in range(0, block.size, share)]
        results = map_threads(
            functools.partial(self._run_kernel, rows, out), len(ranges), *zip(*ranges, strict=True)
        )
        self._add(results, block)

    def _add(self, results: list, block: Block) -> None:
        for dropped, dist2 in results:
            self.dropped += dropped
            self.dist2 += dist2
        self.coords += block.size

    def _numpy_tiles(self, block: Block, stack: np.ndarray, out: np.ndarray) -> list:
        size = max(1, min(TILE, -(-block.size // self.workers)))
        parts = [(stack[:, sl], out[sl]) for sl in tiles(block.size, size)]
        threads = self.workers if len(parts) > 1 else 1
        return map_threads(self._run_tile, threads, *zip(*parts, strict=True))


class TrimReducer(_OrderReducer):
    """Mean of the sorted values ``cut .. N-cut-1`` at each coordinate."""

    def __init__(self, counts: np.ndarray, cut: int, itemsize: int) -> None:
        # sorted tile copy + difference to the aggregate + dropped mask
        self.scratch_per_value = 2 * itemsize + 1
        # + the kept range's two ends (contiguous copies)
        self.bytes_per_coordinate = 3 * 8 + 2 * itemsize
        super().__init__(counts)
        if not 0 <= 2 * cut < self.n:
            raise ValueError(f"cut must satisfy 0 <= 2*cut < N={self.n}. Received: {cut}")
        self.cut = cut

    def _kernel(self, rows, l0, l1, out, dropped, dist2) -> None:
        lo, hi = selection_network(self.n, self.cut, self.n - self.cut - 1)
        counts = np.zeros(self.n, dtype=np.int64)
        self.kernels.trim_tile(rows, l0, l1, lo, hi, self.cut, out, counts, dist2)
        dropped += counts

    def _torch(self, stack: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.device.trim(stack, out, self.cut)

    def _tile(self, orig: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        n, k = self.n, self.cut
        srt = transposed(orig, scratch)
        srt.sort(axis=1)
        width = n - 2 * k
        if width == 1:
            out[...] = srt[:, k]
        elif width == 2:
            # exactly np.median's arithmetic: sum in the working precision, then halve
            out[...] = (srt[:, k] + srt[:, k + 1]) / 2
        else:
            # einsum's float64 row sums run about 2x faster than .sum(dtype=float64) here
            out[...] = np.einsum("ij->i", srt[:, k : n - k], dtype=np.float64) / width
        if not k:
            return np.zeros(n)
        # contiguous copies of the kept range's ends: comparing with a strided column of the
        # sorted tile is 3-5x slower
        lo = scratch.get("lo", (orig.shape[1],), srt.dtype)
        hi = scratch.get("hi", (orig.shape[1],), srt.dtype)
        lo[...], hi[...] = srt[:, k], srt[:, n - k - 1]
        mask = scratch.get("mask", orig.shape, np.dtype(bool))
        if width == 1:  # one kept value: dropped means different from it
            np.not_equal(orig, lo, out=mask)
            return np.add.reduce(mask.view(np.uint8), axis=1, dtype=np.uint32).astype(np.float64)
        # below lo and above hi are disjoint: count each (summing bytes beats count_nonzero 3x)
        np.less(orig, lo, out=mask)
        below = np.add.reduce(mask.view(np.uint8), axis=1, dtype=np.uint32)
        np.greater(orig, hi, out=mask)
        above = np.add.reduce(mask.view(np.uint8), axis=1, dtype=np.uint32)
        return (below + above).astype(np.float64)


class WeightedMedianReducer(_OrderReducer):
    """Sample-count-weighted median at each coordinate (see `weighted_median`)."""

    def __init__(self, counts: np.ndarray, itemsize: int) -> None:
        # transposed copy, sorted values, order (int64), weights and cumulative weights, diff
        self.scratch_per_value = 3 * itemsize + 3 * 8
        self.bytes_per_coordinate = 6 * 8
        super().__init__(counts)
        self.total = int(counts.sum())

    def _kernel(self, rows, l0, l1, out, dropped, dist2) -> None:
        lo, hi = selection_network(self.n, 0, self.n - 1)
        used = np.zeros(self.n, dtype=np.int64)
        self.kernels.weighted_median_tile(
            rows, l0, l1, lo, hi, self.counts.astype(np.int64), self.total, out, used, dist2
        )
        dropped += (l1 - l0) - used

    def _torch(self, stack: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.device.weighted_median(stack, out, self.counts)

    def _tile(self, orig: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        t = orig.shape[1]
        tr = transposed(orig, scratch)
        order = np.argsort(tr, axis=1)
        v = np.take_along_axis(tr, order, axis=1)
        cum = np.cumsum(self.counts[order], axis=1)
        rows = np.arange(t)
        k = np.argmax(2 * cum >= self.total, axis=1)
        tie = 2 * cum[rows, k] == self.total
        k1 = np.minimum(k + 1, self.n - 1)
        lo, hi = v[rows, k], v[rows, k1]
        out[...] = np.where(tie, (lo + hi) / 2, lo)
        used = np.bincount(order[rows, k], minlength=self.n)
        used += np.bincount(order[rows, k1][tie], minlength=self.n)
        return (t - used).astype(np.float64)


class WeightedTrimReducer(_OrderReducer):
    """Sample-count-weighted trimmed mean at each coordinate (see `weighted_trimmed_mean`)."""

    def __init__(self, counts: np.ndarray, beta: float, itemsize: int) -> None:
        # transposed copy, sorted values, order, weights, cumulative, kept mass (8 B each), diff
        self.scratch_per_value = 3 * itemsize + 5 * 8
        self.bytes_per_coordinate = 3 * 8
        super().__init__(counts)
        total = float(counts.sum())
        self.lo, self.hi = beta * total, (1.0 - beta) * total

    def _kernel(self, rows, l0, l1, out, dropped, dist2) -> None:
        lo, hi = selection_network(self.n, 0, self.n - 1)
        self.kernels.weighted_trim_tile(
            rows, l0, l1, lo, hi, self.counts.astype(np.float64), self.lo, self.hi, out,
            dropped, dist2,
        )

    def _torch(self, stack: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.device.weighted_trim(stack, out, self.counts, self.lo, self.hi)

    def _tile(self, orig: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        tr = transposed(orig, scratch)
        order = np.argsort(tr, axis=1)
        v = np.take_along_axis(tr, order, axis=1)
        w = self.counts[order].astype(np.float64)
        cum = np.cumsum(w, axis=1)
        kept = np.minimum(cum, self.hi) - np.maximum(cum - w, self.lo)
        np.maximum(kept, 0.0, out=kept)
        out[...] = np.einsum("ij,ij->i", v, kept, dtype=np.float64) / kept.sum(axis=1)
        share = 1.0 - kept / w
        return np.bincount(order.ravel(), weights=share.ravel(), minlength=self.n)


def weighted_median(values: np.ndarray, counts: np.ndarray) -> float:
    """Reference (scalar) weighted median, the definition the vectorised reducer follows.

    Sort the values; with cumulative counts C_1..C_N and total W, take the first sorted value
    whose C_k >= W/2. If C_k == W/2 exactly, average it with the next value. With equal counts
    this is the ordinary median.
    """
    order = np.argsort(values, kind="stable")
    v, c = np.asarray(values)[order], np.asarray(counts)[order]
    cum, total = np.cumsum(c), int(np.sum(c))
    k = int(np.argmax(2 * cum >= total))
    return float((v[k] + v[k + 1]) / 2) if 2 * cum[k] == total else float(v[k])


def weighted_trimmed_mean(values: np.ndarray, counts: np.ndarray, beta: float) -> float:
    """Reference (scalar) weighted trimmed mean, the definition the reducer follows.

    Sorted value k owns the weight interval [C_{k-1}, C_k] of [0, W]. Drop the mass below
    ``beta*W`` and above ``(1-beta)*W`` (cutting an update's interval part-way if needed) and
    take the mean of the values weighted by the mass they keep.
    """
    order = np.argsort(values, kind="stable")
    v, c = np.asarray(values, dtype=np.float64)[order], np.asarray(counts, dtype=np.float64)[order]
    cum = np.cumsum(c)
    total = cum[-1]
    kept = np.clip(np.minimum(cum, (1 - beta) * total) - np.maximum(cum - c, beta * total), 0, None)
    return float((v * kept).sum() / kept.sum())


def aggregate_order_statistic(
    strategy: AggregationStrategy,
    updates: Sequence[UpdateSource],
    make_reducer: Callable[[np.ndarray, int], _OrderReducer],
    *,
    memory_budget: int,
    weighted: bool,
) -> AggregateResult:
    """Run the reducer ``make_reducer(counts, itemsize)`` over all updates; build the report."""
    inputs = inputs_of(strategy, updates)
    itemsize = max(work_dtype(s.dtype).itemsize for s in inputs.specs)
    reducer = make_reducer(inputs.counts, itemsize)
    values = len(inputs.counts) * sum(s.size for s in inputs.specs)
    reducer.device = active_device(values)
    reducer.kernels = compiled(values) if reducer.device is None else None
    if reducer.device is not None:  # the device's sort and temporaries count against the budget
        reducer.bytes_per_value = max(reducer.bytes_per_value, DEVICE_BYTES_PER_VALUE)
    outputs = empty_like_specs(inputs.specs)
    plan = run_stacked(updates, inputs.specs, reducer, memory_budget=memory_budget, outputs=outputs)
    share = reducer.dropped / max(reducer.coords, 1)
    most = float(share.max())
    n = len(inputs.headers)
    sites = site_reports(
        inputs.headers,
        inputs.counts / inputs.total if weighted else np.full(n, 1.0 / n),
        trimmed_fraction=share,
        trimmed_most=(share == most) & (most > 0),
        l2_to_aggregate=np.sqrt(reducer.dist2),
    )
    return make_result(
        strategy, inputs, outputs, sites,
        memory_budget=memory_budget, working_bytes=plan.working_bytes,
    )

"""The numpy backend: the reference implementation of every aggregation operation.

Every other backend (`aggregation._compiled`, `aggregation._device`) is tested against this
code and falls back to it where it has no implementation of its own (the compiled backend for
float16 parameters, for example). It needs nothing but numpy, and numpy releases the GIL in
its loops, so blocks and tiles run on the aggregation's worker threads (`aggregation._threads`).

Streamed passes (`weighted_sum`, `squared_distances`): the model is cut into blocks of
coordinates (`plan_stream`), short enough that a block's buffers stay in the CPU's L2 cache,
shared out among the threads. Every update is read once per pass, from where it lies (a view
of an in-memory update; a weight file's block copied from the page cache by one positional
read, `protocol.WeightFile.read_values`, or one HDF5 hyperslab read when it needs converting);
nothing is stacked. The block length shrinks when the memory budget asks for it; a block's
arithmetic is the same per coordinate whatever its length, so the weighted sum does not depend
on the budget.

Weighted sum precision: products and sums run in the working precision (float32 for float16
and float32 models, float64 for float64 ones) over groups of `GROUP` updates, and the group
sums are added in float64. The rounding error is that of a float32 sum of `GROUP` terms however
many hospitals there are. With ``distances``, each update's squared distance to the finished
block is taken right after it (its values are a view again, or read again from the page cache).

Stacked blocks (`trimmed_mean`, `weighted_median`, `weighted_trimmed_mean`, `gram`): each
``(N, b)`` block (`aggregation._blocks.run_stacked`) is processed in cache-sized tiles dealt to
the threads. Order statistics copy a tile transposed (one row per coordinate, N values
contiguous) and sort along the row with numpy's vectorised sort (much faster than
``np.median``/``np.partition`` along the stacked axis, which Flower uses); the unsorted stack is
kept, so the same pass counts how often each update's value was dropped and its squared
distance to the aggregate. The Gram matrix centres each tile on its coordinate-wise mean and
multiplies it by its transpose with BLAS, summed in float64 per thread.
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fedsplit.aggregation._blocks import (
    Block,
    BlockPlan,
    BlockReader,
    Rows,
    Scratch,
    check_budget,
    flat_view,
    plan_blocks,
    tiles,
    work_dtype,
)
from fedsplit.aggregation._interface import Backend, DistancePass, MeanPass, OrderResults
from fedsplit.aggregation._threads import map_threads, round_robin, threads_for
from fedsplit.aggregation.errors import AggregationError
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import Update, UpdateSource

#: Largest block of a streamed pass (coordinates): the weighted sum's term, group and float64
#: accumulators (4 + 4 + 8 bytes a coordinate for float32 models) take 2 MiB, about one core's
#: L2 cache (16-256 Ki measured); the distance pass's difference buffer is a quarter of that.
BLOCK = 131_072
#: Updates summed in the working precision before their sum is added in float64 (16-64 measured
#: within noise of each other).
GROUP = 16
#: Coordinates per sorted tile of an order statistic: N values each, within the L2 cache.
TILE = 4096
#: Coordinates per Gram tile: short float32 dot products, accumulated in float64 per tile.
GRAM_TILE = 16384
#: Scratch bytes per stacked value every order statistic reserves at least: the compiled
#: kernels' chunk scratch (`aggregation._numba_kernels.SCRATCH_PER_VALUE`), so a plan's block
#: length does not depend on the backend that runs it.
MIN_SCRATCH_PER_VALUE = 24


# --------------------------------------------------------------------------------------------
# Streamed passes: plan


@dataclass(frozen=True)
class StreamPlan:
    """Blocks and threads of a streamed pass, and the working memory it holds."""

    blocks: list[Block]
    threads: int
    working_bytes: int


def plan_stream(
    specs: Sequence[ArraySpec],
    num_updates: int,
    *,
    bytes_per_coordinate: int,
    memory_budget: int,
    workers: int,
    bytes_per_thread: int = 0,
) -> StreamPlan:
    """Cut the model into blocks so each thread's buffers fit the budget: ``bytes_per_thread``
    (fixed) plus ``bytes_per_coordinate`` per coordinate of its block.

    Blocks are at most `BLOCK` coordinates (cache-sized); a smaller budget shortens them (and
    lowers the thread count when even one coordinate per thread does not fit).
    """
    check_budget(memory_budget)
    one = bytes_per_thread + bytes_per_coordinate
    if memory_budget < one:
        raise AggregationError(
            f"A memory budget of {memory_budget} bytes cannot hold one coordinate of a streamed "
            f"pass (needs at least {one} bytes). Raise --memory-budget (e.g. "
            f"512MB). Received: {memory_budget}"
        )
    size = sum(s.size for s in specs)
    largest = max((s.size for s in specs), default=0)
    threads = threads_for(num_updates * size, len(plan_blocks(specs, BLOCK)), workers)
    threads = max(1, min(threads, memory_budget // one))
    room = memory_budget // threads - bytes_per_thread
    length = max(1, min(BLOCK, largest, room // bytes_per_coordinate))
    return StreamPlan(
        blocks=plan_blocks(specs, length),
        threads=threads,
        working_bytes=threads * (bytes_per_thread + length * bytes_per_coordinate),
    )


def reads_files(updates: Sequence[UpdateSource]) -> bool:
    """Whether a pass over ``updates`` reads some of them into buffers (not all in memory)."""
    from fedsplit.aggregation._blocks import base

    return any(not isinstance(base(u), Update) for u in updates)


# --------------------------------------------------------------------------------------------
# Streamed passes: per-block arithmetic


class BlockSum:
    """One thread's readers and accumulators: writes the weighted sums of whole blocks."""

    def __init__(
        self,
        updates: Sequence[UpdateSource],
        weights: dict[np.dtype, np.ndarray],
        distances: bool = False,
        files: bool = False,
    ) -> None:
        # values are not checked as read: the pass checks its output (`flag_non_finite`)
        self.readers = [BlockReader(u, check_values=False) for u in updates]
        self.weights = weights
        self.scratch = Scratch()
        # each update's squared distance to the sum, added block by block (``distances``)
        self.dist2 = np.zeros(len(updates), dtype=np.float64) if distances else None
        self.reads_files = files  # some update is read from a weight file (`reads_files`)

    def _buf(self, key: str, dtype: np.dtype, size: int) -> np.ndarray:
        # one buffer per dtype, so models mixing dtypes do not reallocate block after block
        return self.scratch.get(f"{key}-{dtype}", (size,), dtype)

    def run(self, blocks: Sequence[Block], arrays: dict[str, np.ndarray]) -> None:
        """Sum every block in ``blocks`` into its range of ``arrays``."""
        try:
            for block in blocks:
                self.sum_block(block, flat_view(arrays, block))  # one view at a time
        finally:
            self.finish()

    def finish(self) -> None:
        """At the end of the pass: release the readers."""
        for reader in self.readers:
            reader.release()

    def sum_block(self, block: Block, out: np.ndarray) -> None:
        """Write the weighted sum of every update's ``block`` to ``out`` (flat, model dtype)."""
        work = work_dtype(out.dtype)
        weights = self.weights[out.dtype]
        n, size = len(self.readers), block.size
        step = n if n <= GROUP or work == np.float64 else GROUP
        single = step == n
        # one group sums straight into the output when no cast follows; else a float64 total
        group = out if single and work == out.dtype else self._buf("group", work, size)
        term = self._buf("term", work, size)
        total = group if single else self._buf("total", np.dtype(np.float64), size)
        for first in range(0, n, step):
            for k in range(first, min(first + step, n)):
                dest = group if k == first else term
                values = self.readers[k].fetch(block, dest)
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
        if self.dist2 is not None:
            # each update's block again (a view, or read again from the page cache), while
            # the finished block is in the cache: the same arithmetic as `squared_distances`
            diff = self._buf("term", work, size)  # the sum's term buffer is free again
            add_squared_distances(self.readers, block, out, diff, self.dist2)


def add_squared_distances(
    readers: Sequence[BlockReader],
    block: Block,
    ref: np.ndarray,
    diff: np.ndarray,
    total: np.ndarray,
) -> None:
    """Add each reader's squared L2 distance to ``ref`` over ``block`` into ``total[k]``.

    Each reader's block is fetched (`BlockReader.fetch`: a view, or read) into ``diff``
    (``block.size`` values of the working dtype, also the difference's scratch); the
    difference is taken in the working dtype and squared and summed by BLAS's dot.
    Non-finite values pass through (the caller checks its output)."""
    work = diff.dtype
    for k, reader in enumerate(readers):
        got = reader.fetch(block, diff)
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite: flagged after
            np.subtract(got, ref, out=diff, dtype=work, casting="unsafe")
        total[k] += float(np.dot(diff, diff))


# --------------------------------------------------------------------------------------------
# Order statistics: per-tile arithmetic


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


def trim_tile(orig: np.ndarray, out: np.ndarray, scratch: Scratch, cut: int) -> np.ndarray:
    """Mean of the sorted values ``cut .. N-cut-1`` of each column of ``orig`` (N, t) into
    ``out``; return how many of each update's values were dropped."""
    n, k = orig.shape[0], cut
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


def weighted_median_tile(
    orig: np.ndarray, out: np.ndarray, scratch: Scratch, counts: np.ndarray
) -> np.ndarray:
    """Count-weighted median of each column (see `weighted_median`); return each update's
    count of values not used."""
    n, t = orig.shape
    total = int(counts.sum())
    tr = transposed(orig, scratch)
    order = np.argsort(tr, axis=1)
    v = np.take_along_axis(tr, order, axis=1)
    cum = np.cumsum(counts[order], axis=1)
    rows = np.arange(t)
    k = np.argmax(2 * cum >= total, axis=1)
    tie = 2 * cum[rows, k] == total
    k1 = np.minimum(k + 1, n - 1)
    lo, hi = v[rows, k], v[rows, k1]
    out[...] = np.where(tie, (lo + hi) / 2, lo)
    used = np.bincount(order[rows, k], minlength=n)
    used += np.bincount(order[rows, k1][tie], minlength=n)
    return (t - used).astype(np.float64)


def weighted_trim_tile(
    orig: np.ndarray, out: np.ndarray, scratch: Scratch, counts: np.ndarray, lo: float, hi: float
) -> np.ndarray:
    """Count-weighted trimmed mean of each column (see `weighted_trimmed_mean`), keeping the
    count mass between ``lo`` and ``hi``; return each update's dropped share, summed."""
    tr = transposed(orig, scratch)
    order = np.argsort(tr, axis=1)
    v = np.take_along_axis(tr, order, axis=1)
    w = counts[order].astype(np.float64)
    cum = np.cumsum(w, axis=1)
    kept = np.minimum(cum, hi) - np.maximum(cum - w, lo)
    np.maximum(kept, 0.0, out=kept)
    out[...] = np.einsum("ij,ij->i", v, kept, dtype=np.float64) / kept.sum(axis=1)
    share = 1.0 - kept / w
    return np.bincount(order.ravel(), weights=share.ravel(), minlength=orig.shape[0])


def weighted_median(values: np.ndarray, counts: np.ndarray) -> float:
    """Reference (scalar) weighted median, the definition every backend follows.

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
    """Reference (scalar) weighted trimmed mean, the definition every backend follows.

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


def stacked_bytes(operation: str, itemsize: int) -> tuple[int, int]:
    """Working bytes of an order statistic beyond the stack: per stacked value of a tile (the
    numpy tile's scratch, at least `MIN_SCRATCH_PER_VALUE`) and per coordinate of a block."""
    per_value, per_coordinate = {
        # sorted tile copy + difference to the aggregate + dropped mask; the kept range's ends
        "trimmed_mean": (2 * itemsize + 1, 3 * 8 + 2 * itemsize),
        # transposed copy, sorted values, order (int64), weights and cumulative weights, diff
        "weighted_median": (3 * itemsize + 3 * 8, 6 * 8),
        # transposed copy, sorted values, order, weights, cumulative, kept mass (8 B), diff
        "weighted_trimmed_mean": (3 * itemsize + 5 * 8, 3 * 8),
    }[operation]
    return max(per_value, MIN_SCRATCH_PER_VALUE), per_coordinate


# --------------------------------------------------------------------------------------------
# The backend


class NumpyBackend(Backend):
    """The numpy reference of the six operations (see the module docstring)."""

    name = "numpy"

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._pool: queue.SimpleQueue[Scratch] | None = None

    # ------------------------------------------------------------------ streamed passes

    def block_sum(
        self, updates: Sequence[UpdateSource], weights: dict[np.dtype, np.ndarray],
        distances: bool, files: bool,
    ) -> BlockSum:
        """One thread's accumulator of a weighted-sum pass."""
        return BlockSum(updates, weights, distances, files)

    def mean_bytes(
        self, specs: Sequence[ArraySpec], num_updates: int, files: bool
    ) -> tuple[int, int]:
        """Working bytes of a weighted-sum pass: per coordinate of a block (the term and group
        in the working precision and the float64 total), and fixed per thread (none)."""
        dtypes = {s.dtype for s in specs}
        return sum(2 * work_dtype(d).itemsize + 8 for d in dtypes), 0

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
        files = reads_files(updates)
        per_coordinate, per_thread = self.mean_bytes(specs, len(updates), files)
        plan = plan_stream(
            specs, len(updates), bytes_per_coordinate=per_coordinate,
            bytes_per_thread=per_thread, memory_budget=memory_budget, workers=self.workers,
        )
        per_dtype = {s.dtype: share.astype(work_dtype(s.dtype)) for s in specs}
        sums = [self.block_sum(updates, per_dtype, distances, files) for _ in range(plan.threads)]
        map_threads(
            BlockSum.run, plan.threads, sums, round_robin(plan.blocks, plan.threads),
            [arrays] * plan.threads,
        )
        dist = np.sqrt(np.sum([s.dist2 for s in sums], axis=0)) if distances else None
        return MeanPass(arrays=arrays, working_bytes=plan.working_bytes, distances=dist)

    def add_squares(
        self, readers: Sequence[BlockReader], block: Block, ref: np.ndarray, diff: np.ndarray,
        total: np.ndarray,
    ) -> None:
        """Add each reader's squared distance to ``ref`` over ``block`` (`add_squared_distances`)."""
        add_squared_distances(readers, block, ref, diff, total)

    def squared_distances(
        self,
        updates: Sequence[UpdateSource],
        specs: Sequence[ArraySpec],
        arrays: dict[str, np.ndarray],
        *,
        memory_budget: int,
    ) -> DistancePass:
        work = max((work_dtype(s.dtype) for s in specs), key=lambda d: d.itemsize)
        plan = plan_stream(
            specs, len(updates), bytes_per_coordinate=work.itemsize, memory_budget=memory_budget,
            workers=self.workers,
        )
        length = max((b.size for b in plan.blocks), default=1)

        def squares(part: Sequence[Block]) -> np.ndarray:
            readers = [BlockReader(u, check_values=False) for u in updates]  # output checked
            buf = np.empty(length, dtype=work)
            total = np.zeros(len(updates), dtype=np.float64)
            for block in part:
                ref = np.asarray(arrays[block.name]).reshape(-1)[block.start : block.stop]
                self.add_squares(readers, block, ref, buf[: block.size], total)
            for reader in readers:
                reader.release()
            return total

        parts = map_threads(squares, plan.threads, round_robin(plan.blocks, plan.threads))
        return DistancePass(np.sqrt(np.sum(parts, axis=0)), plan.working_bytes)

    # ------------------------------------------------------------------- stacked blocks

    def _tiles(self, stack: np.ndarray, out: np.ndarray, tile: Callable[..., np.ndarray],
               **params: Any) -> OrderResults:
        """Run ``tile(orig, out, scratch, **params)`` over cache-sized tiles of the block, in
        the worker threads; return each tile's (dropped, squared distances)."""
        if self._pool is None:
            self._pool = queue.SimpleQueue()
            for _ in range(self.workers):
                self._pool.put(Scratch())
        size = max(1, min(TILE, -(-stack.shape[1] // self.workers)))
        parts = [(stack[:, sl], out[sl]) for sl in tiles(stack.shape[1], size)]
        threads = self.workers if len(parts) > 1 else 1
        run = functools.partial(self._run_tile, tile, params)
        return map_threads(run, threads, *zip(*parts, strict=True))

    def _run_tile(self, tile: Callable[..., np.ndarray], params: dict[str, Any], orig: np.ndarray,
                  out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self._pool is not None
        scratch = self._pool.get()
        try:
            dropped = tile(orig, out, scratch, **params)
            diff = scratch.get("diff", orig.shape, orig.dtype)
            np.subtract(orig, out, out=diff, casting="unsafe")
            return dropped, np.einsum("ij,ij->i", diff, diff).astype(np.float64)
        finally:
            self._pool.put(scratch)

    def trimmed_mean(self, values: np.ndarray | Rows, out: np.ndarray, cut: int) -> OrderResults:
        assert isinstance(values, np.ndarray)
        return self._tiles(values, out, trim_tile, cut=cut)

    def weighted_median(
        self, values: np.ndarray | Rows, out: np.ndarray, counts: np.ndarray
    ) -> OrderResults:
        assert isinstance(values, np.ndarray)
        return self._tiles(values, out, weighted_median_tile, counts=counts)

    def weighted_trimmed_mean(
        self, values: np.ndarray | Rows, out: np.ndarray, counts: np.ndarray, lo: float, hi: float
    ) -> OrderResults:
        assert isinstance(values, np.ndarray)
        return self._tiles(values, out, weighted_trim_tile, counts=counts, lo=lo, hi=hi)

    def center(self, stack: np.ndarray, sl: slice) -> None:
        """Centre the tile ``stack[:, sl]`` on its coordinate-wise mean (float64 mean, rounded
        to the tile's dtype), in place."""
        tile = stack[:, sl]
        tile -= tile.mean(axis=0, dtype=np.float64).astype(tile.dtype)

    def _gram_tiles(self, stack: np.ndarray, grams: list[np.ndarray], slot: int,
                    part: Sequence[slice]) -> None:
        gram = grams[slot]
        for sl in part:
            self.center(stack, sl)
            tile = stack[:, sl]
            gram += tile @ tile.T

    def gram(self, values: np.ndarray | Rows, grams: list[np.ndarray]) -> None:
        assert isinstance(values, np.ndarray)
        parts = list(tiles(values.shape[1], GRAM_TILE))
        threads = max(1, min(self.workers, len(parts)))
        map_threads(
            functools.partial(self._gram_tiles, values, grams), threads, range(threads),
            round_robin(parts, threads),
        )

    def takes_rows(self, operation: str, plan: BlockPlan) -> bool:
        return False

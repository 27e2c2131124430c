"""What aggregation rules share: checked inputs, the streamed weighted mean, distances, report rows.

A rule's `aggregate` is usually::

    inputs = inputs_of(self, updates)                     # count, layout, min_updates checked
    mean = weighted_mean(updates, weights, memory_budget=memory_budget)
    dist = distances_to(updates, mean.arrays, memory_budget=memory_budget)
    sites = site_reports(inputs.headers, shares, l2_to_aggregate=dist.values)
    return make_result(self, inputs, mean.arrays, sites, memory_budget=memory_budget,
                       working_bytes=max(mean.working_bytes, dist.working_bytes))

Both passes stream the model in blocks of coordinates (`aggregation._blocks.plan_blocks`),
short enough that a block's buffers stay in the CPU's L2 cache, shared out among worker
threads (`aggregation._threads`). Every update is read once per pass, from where it lies (a
view of an in-memory update; a weight file's block copied from the page cache by one
positional read, `protocol.WeightFile.read_values`, or one HDF5 hyperslab read when it needs
converting); nothing is stacked.
The block length shrinks when the memory budget asks for it; a block's arithmetic is the same
per coordinate whatever its length, so the weighted mean's result does not depend on the budget.

Weighted mean precision: products and sums run in the working precision (float32 for float16
and float32 models, float64 for float64 ones) over groups of `GROUP` updates, and the group
sums are added in float64. The rounding error is that of a float32 sum of `GROUP` terms however
many hospitals there are (float16 models do not accumulate in float16).

``weighted_mean(..., distances=True)`` also returns each update's distance to the mean, taken
right after each tile's (C kernels) or block's (numpy: a view again, or a second read from the
page cache) mean while its inputs are in the cache (FedAvg's report), instead of a second
`distances_to` pass.

Compiled kernels (`aggregation._ckernels`: C built with cffi, no start-up to pay for): the
weighted mean is one call per block, which sums the N updates tile by tile (2048 coordinates:
products rounded before the add, groups of `GROUP` in the working precision, float64 across,
so the result is the numpy one bit for bit) and, with distances, adds each update's squared
distance to the finished tile while its values are in the cache; weight files' blocks are
read into one row per update first (`BlockReader.fetch`: a positional read).
The distance pass's difference, square and sum are one call per update (squares summed in
float64 instead of BLAS's float32 dot). On a GPU (`aggregation._device`) both passes run in
torch with float64 sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from aggregation._blocks import (
    DEFAULT_MEMORY_BUDGET,
    Block,
    BlockReader,
    Scratch,
    base,
    check_budget,
    empty_like_specs,
    flag_non_finite,
    flat_view,
    plan_blocks,
    work_dtype,
)
from aggregation._device import active_device
from aggregation._kernels import kernel_dtype, streamed
from aggregation._threads import map_threads, round_robin, threads_for
from aggregation.base import AggregateResult, AggregationReport, AggregationStrategy, SiteReport
from aggregation.compat import check_compatible
from aggregation.errors import AggregationError, NotEnoughUpdatesError
from protocol.arrays import ArraySpec
from protocol.update import Update, UpdateHeader, UpdateSource

if TYPE_CHECKING:
    from aggregation._ckernels import StreamedKernels

#: Largest block of a streamed pass (coordinates): the weighted mean's term, group and float64
#: accumulators (4 + 4 + 8 bytes a coordinate for float32 models) take 2 MiB, about one core's
#: L2 cache (16-256 Ki measured); the distance pass's difference buffer is a quarter of that.
BLOCK = 131_072
#: Updates summed in the working precision before their sum is added in float64 (16-64 measured
#: within noise of each other).
GROUP = 16


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Inputs:
    """The updates' headers, their shared layout and their sample counts."""

    headers: list[UpdateHeader]
    specs: tuple[ArraySpec, ...]
    counts: np.ndarray  # int64, one per update

    @property
    def total(self) -> int:
        """Sum of the sample counts."""
        return int(self.counts.sum())


def require_updates(strategy: AggregationStrategy, available: int, context: str = "") -> None:
    """Raise `NotEnoughUpdatesError` when ``available`` is below ``strategy.min_updates()``.

    ``context`` (e.g. which updates the input checks excluded) is added to the message.
    """
    need = strategy.min_updates()
    if available >= need:
        return
    why = strategy.min_updates_reason()
    raise NotEnoughUpdatesError(
        f"Strategy {strategy.name!r} needs at least {need} usable update"
        f"{'s' if need != 1 else ''}{f' ({why})' if why else ''}. Send more sites' updates"
        f"{' or change its parameters' if why else ''}.{f' {context}' if context else ''} "
        f"Received: {available} updates"
    )


def inputs_of(strategy: AggregationStrategy, updates: Sequence[UpdateSource]) -> Inputs:
    """Check there are enough updates and that they share one layout; return their headers."""
    require_updates(strategy, len(updates))
    headers = [u.header for u in updates]
    check_compatible(headers)
    counts = np.array([h.num_examples for h in headers], dtype=np.int64)
    return Inputs(headers=headers, specs=tuple(headers[0].specs), counts=counts)


# --------------------------------------------------------------------------------------------
# Streamed passes


def _specs(updates: Sequence[UpdateSource]) -> tuple[ArraySpec, ...]:
    if not updates:
        raise NotEnoughUpdatesError("A streamed pass needs at least one update. Received: 0 updates")
    return tuple(updates[0].header.specs)


@dataclass(frozen=True)
class StreamPlan:
    """Blocks and threads of a streamed pass, and the working memory it holds."""

    blocks: list[Block]
    threads: int
    working_bytes: int


def plan_stream(
    specs: Sequence[ArraySpec], num_updates: int, *, bytes_per_coordinate: int, memory_budget: int
) -> StreamPlan:
    """Cut the model into blocks so each thread's ``bytes_per_coordinate`` buffers fit the budget.

    Blocks are at most `BLOCK` coordinates (cache-sized); a smaller budget shortens them (and
    lowers the thread count when even one coordinate per thread does not fit).
    """
    check_budget(memory_budget)
    if memory_budget < bytes_per_coordinate:
        raise AggregationError(
            f"A memory budget of {memory_budget} bytes cannot hold one coordinate of a streamed "
            f"pass (needs at least {bytes_per_coordinate} bytes). Raise --memory-budget (e.g. "
            f"512MB). Received: {memory_budget}"
        )
    size = sum(s.size for s in specs)
    largest = max((s.size for s in specs), default=0)
    threads = threads_for(num_updates * size, len(plan_blocks(specs, BLOCK)))
    threads = max(1, min(threads, memory_budget // bytes_per_coordinate))
    length = max(1, min(BLOCK, largest, memory_budget // (threads * bytes_per_coordinate)))
    return StreamPlan(
        blocks=plan_blocks(specs, length),
        threads=threads,
        working_bytes=threads * length * bytes_per_coordinate,
    )


class MeanPass(NamedTuple):
    """A weighted mean, the working memory it held, and (when asked) each update's distance."""

    arrays: dict[str, np.ndarray]
    working_bytes: int
    #: each update's L2 distance to the mean (float64), when ``weighted_mean(distances=True)``
    distances: np.ndarray | None = None


class _BlockSum:
    """One thread's readers and accumulators: writes the weighted sums of whole blocks."""

    def __init__(
        self,
        updates: Sequence[UpdateSource],
        weights: dict[np.dtype, np.ndarray],
        kernels: StreamedKernels | None = None,
        distances: bool = False,
    ) -> None:
        # values are not checked as read: weighted_mean checks its output (`flag_non_finite`)
        self.readers = [BlockReader(u, check_values=False) for u in updates]
        self.weights = weights
        self.scratch = Scratch()
        self.kernels = kernels
        # each update's squared distance to the mean, summed block by block (``distances``)
        self.dist2 = np.zeros(len(updates), dtype=np.float64) if distances else None
        self.reads_files = reads_files(updates)

    def _buf(self, key: str, dtype: np.dtype, size: int) -> np.ndarray:
        # one buffer per dtype, so models mixing dtypes do not reallocate block after block
        return self.scratch.get(f"{key}-{dtype}", (size,), dtype)

    def run(self, blocks: Sequence[Block], arrays: dict[str, np.ndarray]) -> None:
        """Sum every block in ``blocks`` into its range of ``arrays``."""
        for block in blocks:
            out = flat_view(arrays, block)  # one view at a time: no list of them all
            if self.kernels is not None and kernel_dtype(out.dtype):
                self.compiled_block(self.kernels, block, out)
            else:
                self.block(block, out)
        for reader in self.readers:
            reader.release()

    def compiled_block(self, kernels: StreamedKernels, block: Block, out: np.ndarray) -> None:
        """`block` in one C call (float32/float64 models): every update's block is a view of
        its own memory or read into its row of a ``(N, block)`` buffer first, and the call
        sums them tile by tile (each tile's distances too, while its inputs are cached)."""
        dtype = out.dtype
        n = len(self.readers)
        rows = self.scratch.get(f"rows-{dtype}", (n, block.size), dtype) if self.reads_files else None
        values = []
        for k, reader in enumerate(self.readers):
            got = reader.fetch(block, None if rows is None else rows[k])
            if got.dtype != dtype or not got.flags.c_contiguous:
                got = np.ascontiguousarray(got, dtype=dtype)
            values.append(got)
        kernels.weighted_sum(values, self.weights[dtype], GROUP, out, self.dist2)

    def block(self, block: Block, out: np.ndarray) -> None:
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
            # the finished mean block is in the cache: the same arithmetic as `distances_to`
            diff = self._buf("term", work, size)  # the mean's term buffer is free again
            add_squared_distances(self.readers, block, out, diff, self.dist2, None)


def add_squared_distances(
    readers: Sequence[BlockReader],
    block: Block,
    ref: np.ndarray,
    diff: np.ndarray,
    total: np.ndarray,
    kernels: StreamedKernels | None,
) -> None:
    """Add each reader's squared L2 distance to ``ref`` over ``block`` into ``total[k]``.

    Each reader's block is fetched (`BlockReader.fetch`: a view, or read) into ``diff``
    (``block.size`` values of the working dtype, also the difference's scratch). Compiled
    (``kernels``, when ``ref`` and the values are in the working dtype): difference, square
    and float64 sum in one pass; else the difference in the working dtype and BLAS's dot.
    Non-finite values pass through (the caller checks its output)."""
    work = diff.dtype
    fused = kernels is not None and kernel_dtype(work) and ref.dtype == work
    for k, reader in enumerate(readers):
        got = reader.fetch(block, diff)
        if fused and got.dtype == work and got.flags.c_contiguous:
            total[k] += kernels.squared_distance(got, ref)
            continue
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite: flagged after
            np.subtract(got, ref, out=diff, dtype=work, casting="unsafe")
        total[k] += float(np.dot(diff, diff))


def reads_files(updates: Sequence[UpdateSource]) -> bool:
    """Whether a pass over ``updates`` reads some of them into buffers (not all in memory)."""
    return any(not isinstance(base(u), Update) for u in updates)


def shares_of(weights: Sequence[float] | np.ndarray, num_updates: int) -> np.ndarray:
    """Normalise non-negative ``weights`` (one per update) to shares summing to 1 (float64)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_updates,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise AggregationError(
            f"A weighted mean needs one finite, non-negative weight per update ({num_updates}), "
            f"not all zero. Received: {np.asarray(weights).tolist()}"
        )
    return w / w.sum()


def weighted_mean(
    updates: Sequence[UpdateSource],
    weights: Sequence[float] | np.ndarray,
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    out: dict[str, np.ndarray] | None = None,
    distances: bool = False,
) -> MeanPass:
    """Return ``sum_k s_k w_k`` with shares ``s_k = weights_k / sum(weights)``, streamed.

    ``weights`` are any non-negative numbers (sample counts give FedAvg). The mean is written to
    ``out`` when given (arrays shaped like the updates, e.g. the previous iterate of an
    iterative rule: the pass does not read it), else to new arrays. Working memory: a few
    block-sized buffers per thread, within ``memory_budget``. With ``distances``, each
    update's L2 distance to the mean is computed in the same pass (``.distances``): every
    block's distances right after its mean, while the block's inputs are still in the cache,
    instead of a second pass (`distances_to`) reading every input again.
    """
    specs = _specs(updates)
    share = shares_of(weights, len(updates))
    arrays = out if out is not None else empty_like_specs(specs)
    values = len(updates) * sum(s.size for s in specs)
    device = active_device(values)
    if device is not None:
        working = device.weighted_mean(updates, specs, share, arrays, memory_budget)
        flag_non_finite(updates, list(arrays.values()))
        dist = None
        if distances:
            dist, used = device.distances(updates, specs, arrays, memory_budget)
            flag_non_finite(updates, [dist])
            working = max(working, used)
        return MeanPass(arrays=arrays, working_bytes=working, distances=dist)
    kernels = streamed()
    rows = len(updates) if reads_files(updates) else 0
    need = _mean_bytes(specs, rows, kernels)
    if kernels is not None and need > memory_budget:
        kernels = None  # a budget too small for one row per update: numpy's buffers instead
        need = _mean_bytes(specs, rows, kernels)
    plan = plan_stream(
        specs, len(updates), bytes_per_coordinate=need, memory_budget=memory_budget
    )
    per_dtype = {s.dtype: share.astype(work_dtype(s.dtype)) for s in specs}
    sums = [_BlockSum(updates, per_dtype, kernels, distances) for _ in range(plan.threads)]
    map_threads(
        _BlockSum.run, plan.threads, sums, round_robin(plan.blocks, plan.threads),
        [arrays] * plan.threads,
    )
    flag_non_finite(updates, list(arrays.values()))
    dist = None
    if distances:
        dist = np.sqrt(np.sum([s.dist2 for s in sums], axis=0))
        flag_non_finite(updates, [dist])
    return MeanPass(arrays=arrays, working_bytes=plan.working_bytes, distances=dist)


def _mean_bytes(specs: Sequence[ArraySpec], rows: int, kernels: StreamedKernels | None) -> int:
    """Working bytes per coordinate of a weighted-mean block, summed over the model's dtypes.

    The C kernels (float32/64 parameters) hold one row per update for blocks read from weight
    files (`_BlockSum.compiled_block`; ``rows`` is N then, else 0) and a tile's group and
    float64 sums; numpy holds term and group in the working precision and a float64 total."""
    return sum(
        (rows + 1) * d.itemsize + 8 if kernels is not None and kernel_dtype(d)
        else 2 * work_dtype(d).itemsize + 8
        for d in {s.dtype for s in specs}
    )


class DistancePass(NamedTuple):
    """Each update's L2 distance to an aggregate and the working memory the pass held."""

    values: np.ndarray  # float64, one per update
    working_bytes: int


def distances_to(
    updates: Sequence[UpdateSource],
    arrays: dict[str, np.ndarray],
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> DistancePass:
    """Return each update's L2 distance to ``arrays`` (all parameters).

    Block by block (each block of ``arrays`` stays in cache while every update's block is
    compared with it, so each input byte is read once), blocks shared out among worker
    threads. Differences are taken in the working precision (float32 for float16/32 models);
    squares are summed in float64 per block (so the last bits depend on the block length).
    """
    specs = _specs(updates)
    values = len(updates) * sum(s.size for s in specs)
    device = active_device(values)
    if device is not None:
        dist, working = device.distances(updates, specs, arrays, memory_budget)
        flag_non_finite(updates, [dist])
        return DistancePass(dist, working)
    kernels = streamed()
    work = max((work_dtype(s.dtype) for s in specs), key=lambda d: d.itemsize)
    plan = plan_stream(
        specs, len(updates), bytes_per_coordinate=work.itemsize, memory_budget=memory_budget
    )
    length = max((b.size for b in plan.blocks), default=1)

    def squares(part: Sequence[Block]) -> np.ndarray:
        readers = [BlockReader(u, check_values=False) for u in updates]  # output checked
        buf = np.empty(length, dtype=work)
        total = np.zeros(len(updates), dtype=np.float64)
        for block in part:
            ref = np.asarray(arrays[block.name]).reshape(-1)[block.start : block.stop]
            add_squared_distances(readers, block, ref, buf[: block.size], total, kernels)
        for reader in readers:
            reader.release()
        return total

    parts = map_threads(squares, plan.threads, round_robin(plan.blocks, plan.threads))
    dist = np.sqrt(np.sum(parts, axis=0))
    flag_non_finite(updates, [dist])
    return DistancePass(dist, plan.working_bytes)


# --------------------------------------------------------------------------------------------
# Report rows


def _plain(value: Any) -> Any:
    """numpy scalars as Python ones, so the report is JSON as it stands."""
    return value.item() if isinstance(value, np.generic) else value


def site_reports(
    headers: Sequence[UpdateHeader], weights: Sequence[float] | np.ndarray, **columns: Any
) -> list[SiteReport]:
    """One `SiteReport` per update: label, count, weight, and the rule's own ``columns``.

    ``weights`` is each update's share of the aggregate; each column (a `SiteReport` field such
    as ``l2_to_aggregate``, ``trimmed_fraction``, ``selected``, ``score`` or ``flags``) holds one
    value per update.
    """
    for name, values in columns.items():
        if len(values) != len(headers):
            raise ValueError(f"column {name!r} has {len(values)} values. Received: {len(headers)}")
    return [
        SiteReport(
            site=h.label,
            num_examples=h.num_examples,
            weight=float(weights[i]),
            **{name: _plain(values[i]) for name, values in columns.items()},
        )
        for i, h in enumerate(headers)
    ]


def make_result(
    strategy: AggregationStrategy,
    inputs: Inputs,
    arrays: dict[str, np.ndarray],
    sites: list[SiteReport],
    *,
    memory_budget: int,
    working_bytes: int | None,
    details: dict[str, Any] | None = None,
) -> AggregateResult:
    """Wrap a rule's aggregate and report rows; ``num_examples`` is the sum of all counts."""
    report = AggregationReport(
        strategy=strategy.name,
        params=strategy.params.model_dump(),
        num_examples=inputs.total,
        sites=sites,
        memory_budget=memory_budget,
        working_bytes=working_bytes,
        details=dict(details or {}),
    )
    return AggregateResult(arrays=arrays, num_examples=inputs.total, report=report)

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
distance to the finished tile while its values are in the cache; in-memory updates are read
at their address, weight files by the call itself (positional reads, `file_block` values at a
time, into rows that stay in the core's cache). The distance pass's difference, square and
sum are one call per update (squares summed in float64 instead of BLAS's float32 dot). On a
GPU (`aggregation._device`) both passes run in torch with float64 sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from fedsplit.aggregation._blocks import (
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
from fedsplit.aggregation._device import active_device
from fedsplit.aggregation._kernels import kernel_dtype, streamed
from fedsplit.aggregation._threads import map_threads, round_robin, threads_for
from fedsplit.aggregation.base import AggregateResult, AggregationReport, AggregationStrategy, SiteReport
from fedsplit.aggregation.compat import check_compatible
from fedsplit.aggregation.errors import AggregationError, NotEnoughUpdatesError
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import Update, UpdateHeader, UpdateSource
from fedsplit.protocol.weights import WeightFile

if TYPE_CHECKING:
    from fedsplit.aggregation._ckernels import StreamedKernels, WeightedSum

#: Bytes of the C kernels' per-thread rows of file reads (`file_block`): within one core's L2
#: cache. 30 files x 10M, 2 threads: blocks of 8192 coordinates took the pass from 0.23-0.25 s
#: (rows of 131,072) to 0.17-0.18 s.
FILE_ROWS_BYTES = 1 << 20

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
    specs: Sequence[ArraySpec],
    num_updates: int,
    *,
    bytes_per_coordinate: int,
    memory_budget: int,
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
    threads = threads_for(num_updates * size, len(plan_blocks(specs, BLOCK)))
    threads = max(1, min(threads, memory_budget // one))
    room = memory_budget // threads - bytes_per_thread
    length = max(1, min(BLOCK, largest, room // bytes_per_coordinate))
    return StreamPlan(
        blocks=plan_blocks(specs, length),
        threads=threads,
        working_bytes=threads * (bytes_per_thread + length * bytes_per_coordinate),
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
        files: bool = False,
    ) -> None:
        # values are not checked as read: weighted_mean checks its output (`flag_non_finite`)
        self.readers = [BlockReader(u, check_values=False) for u in updates]
        self.weights = weights
        self.scratch = Scratch()
        self.kernels = kernels
        # each update's squared distance to the mean, summed block by block (``distances``)
        self.dist2 = np.zeros(len(updates), dtype=np.float64) if distances else None
        self.reads_files = files  # some update is read from a weight file (`reads_files`)
        # the C kernels' calls (one per dtype) and their view of the current parameter
        # (`_locate`): per update, the address (in memory, fd -1) or file offset (fd >= 0) of
        # its first value; whether some update holds it in another form (numpy's path then);
        # the arrays whose addresses are held
        self._calls: dict[np.dtype, WeightedSum] = {}
        self._param: tuple[str, np.dtype] | None = None
        self._base = np.zeros(len(updates), dtype=np.int64)
        self._numpy_param = False
        self._held: list[np.ndarray] = []

    def _buf(self, key: str, dtype: np.dtype, size: int) -> np.ndarray:
        # one buffer per dtype, so models mixing dtypes do not reallocate block after block
        return self.scratch.get(f"{key}-{dtype}", (size,), dtype)

    def run(self, blocks: Sequence[Block], arrays: dict[str, np.ndarray]) -> None:
        """Sum every block in ``blocks`` into its range of ``arrays``."""
        try:
            for block in blocks:
                out = flat_view(arrays, block)  # one view at a time: no list of them all
                if self.kernels is not None and kernel_dtype(out.dtype):
                    self.compiled_block(self.kernels, block, out)
                else:
                    self.block(block, out)
        finally:
            self._held, self._param = [], None
            for reader in self.readers:
                reader.release()

    def _call(self, kernels: StreamedKernels, dtype: np.dtype) -> WeightedSum:
        call = self._calls.get(dtype)
        if call is None:
            call = self._calls[dtype] = kernels.weighted_sum(
                len(self.readers), dtype, file_block(len(self.readers)), self.weights[dtype],
                self.dist2, GROUP, reads=self.reads_files,
            )
        return call

    def _locate(self, kernels: StreamedKernels, call: WeightedSum, name: str) -> None:
        """Find where every update's parameter ``name`` lies, once per parameter."""
        self._numpy_param, self._held = False, []
        for k, reader in enumerate(self.readers):
            whole = reader.whole(name)
            if whole is not None and whole.dtype == call.dtype and whole.flags.c_contiguous:
                self._held.append(whole)
                self._base[k], call.fd[k] = kernels.address(whole), -1
                continue
            where = reader.raw_location(name) if whole is None else None
            if where is not None:
                call.fd[k], self._base[k] = where
                continue
            call.fd[k], self._base[k] = -1, 0
            self._numpy_param = True  # read by `BlockReader.fetch`: numpy's path
        self._param = (name, call.dtype)

    def compiled_block(self, kernels: StreamedKernels, block: Block, out: np.ndarray) -> None:
        """`block` in one C call (float32/float64 models). In-memory updates are read at their
        address; weight files whose values lie as they are are read by the call itself
        (`file_block` values at a time: one positional read per update into its row of an
        ``(N, sub)`` buffer that stays in the core's cache). The call sums them tile by tile
        (each tile's distances too, while its inputs are cached). A parameter that some update
        holds in another form (a compressed or big-endian file, another source) takes numpy's
        path (`block`)."""
        call = self._call(kernels, out.dtype)
        if self._param != (block.name, out.dtype):
            self._locate(kernels, call, block.name)
        if self._numpy_param:  # some update holds this parameter in another form
            self.block(block, out)
            return
        np.add(self._base, block.start * out.dtype.itemsize, out=call.src)
        failed = call(out)
        if failed is not None:
            k, errno, got_bytes = failed
            source = base(self.readers[k].source)
            assert isinstance(source, WeightFile)  # only files are read by the call
            raise source.read_failure(
                block.name, block.start, block.size * out.dtype.itemsize, got_bytes, errno
            )

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
    files = reads_files(updates)
    per_coordinate, per_thread = _mean_bytes(specs, len(updates), kernels, files)
    if kernels is not None and per_thread + per_coordinate > memory_budget:
        kernels = None  # a budget too small for the C calls' rows: numpy's buffers instead
        per_coordinate, per_thread = _mean_bytes(specs, len(updates), kernels, files)
    plan = plan_stream(
        specs, len(updates), bytes_per_coordinate=per_coordinate,
        bytes_per_thread=per_thread, memory_budget=memory_budget,
    )
    per_dtype = {s.dtype: share.astype(work_dtype(s.dtype)) for s in specs}
    sums = [
        _BlockSum(updates, per_dtype, kernels, distances, files) for _ in range(plan.threads)
    ]
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


def file_block(num_updates: int) -> int:
    """Block length of a C weighted-mean pass that reads weight files: its ``(N, block)`` rows
    of reads take `FILE_ROWS_BYTES` (float32), so the call re-reads them from the core's cache
    (30 files: 8192 coordinates), never under 1024."""
    return max(1024, min(BLOCK, FILE_ROWS_BYTES // (4 * num_updates) // 1024 * 1024))


def _mean_bytes(specs: Sequence[ArraySpec], num_updates: int, kernels: StreamedKernels | None,
                files: bool) -> tuple[int, int]:
    """Working bytes of a weighted-mean pass: per coordinate of a block, and fixed per thread.

    Per coordinate, numpy's term and group in the working precision and float64 total (also
    what the C kernels fall back to for a parameter some file holds in another form; their
    own tile sums live on the stack); per thread, with the C kernels and weight files, the
    ``(N, file_block(N))`` rows the calls read files into (float32/64 parameters)."""
    dtypes = {s.dtype for s in specs}
    per_coordinate = sum(2 * work_dtype(d).itemsize + 8 for d in dtypes)
    per_thread = 0
    if kernels is not None and files:
        sub = file_block(num_updates)
        per_thread = sum(num_updates * sub * d.itemsize for d in dtypes if kernel_dtype(d))
    return per_coordinate, per_thread


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

"""The compiled backend: C kernels for the streamed operations, numba kernels for the stacked.

`CompiledBackend` runs each operation in one compiled pass over cache-resident data instead
of several numpy calls, with the same arithmetic as the numpy reference
(`aggregation._reference`; differences and bounds: docs/aggregation.md, "Backends"):

- ``weighted_sum`` and ``squared_distances``: C, built with cffi (`aggregation._ckernels`;
  loaded in about a millisecond). The weighted sum is one call per block that sums the N
  updates tile by tile (2048 coordinates: products rounded before the add, groups of
  `_reference.GROUP` in the working precision, float64 across, so the result is the numpy one
  bit for bit) and, with distances, adds each update's squared distance to the finished tile
  while its values are in the cache; in-memory updates are read at their address, weight files
  by the call itself (positional reads, `file_block` values at a time, into rows that stay in
  the core's cache). The distance pass's difference, square and sum are one call per update
  (squares summed in float64 instead of BLAS's float32 dot).
- ``trimmed_mean``, ``weighted_median``, ``weighted_trimmed_mean``: numba
  (`aggregation._numba_kernels`): a sorting network run across coordinates (each
  compare-exchange a vectorised min/max of two updates' rows of an L1-sized chunk), pruned to
  the ranks the rule needs (`selection_network`), with the trim-and-sum, the per-update drop
  counts and the distances fused in; the weighted forms carry each value's update index
  through the network. Each thread's share of a block is one call.
- ``gram``: numba's `center_columns` centres each tile of a stack, or `gather_centered`
  gathers and centres it straight from the updates into a per-thread buffer (no stacked
  copy); the product itself stays in BLAS, on the same tiles as numpy, so the same bits.

The stacked kernels read the updates in place (`aggregation._blocks.Rows`: in-memory updates,
memory-mapped weight files) where `takes_rows` says so, instead of a stacked copy.

What it falls back to (the numpy reference, block by block): float16 parameters; a stacked
block whose output dtype is not its values'; a weight file's parameter stored in another form
(compressed, big-endian); a weighted sum whose memory budget cannot hold the C calls' rows.

numba compiles each kernel once per signature and caches the machine code on disk
(``cache=True``: beside its source, or in numba's per-user cache directory when the install
is read-only, or in ``NUMBA_CACHE_DIR``); when no cache directory is writable the kernels
are compiled in memory at every start instead. Every kernel releases the GIL and runs on the
aggregation's own worker threads (`aggregation._threads`, ``FEDSPLIT_AGG_THREADS``), never on
numba's threading layer.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
from fedsplit.aggregation import _ckernels, _reference
from fedsplit.aggregation._blocks import (
    Block,
    BlockPlan,
    BlockReader,
    Rows,
    base,
    stack_addresses,
    tiles,
)
from fedsplit.aggregation._filereads import reads_of
from fedsplit.aggregation._interface import STACKED, OrderResults
from fedsplit.aggregation._reference import GRAM_TILE, BlockSum, NumpyBackend, add_squared_distances
from fedsplit.aggregation._threads import map_threads, round_robin
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import UpdateSource
from fedsplit.protocol.weights import WeightFile

#: Bytes of the C kernels' per-thread rows of file reads (`file_block`): within one core's L2
#: cache. 30 files x 10M, 2 threads: blocks of 8192 coordinates took the pass from 0.23-0.25 s
#: (rows of 131,072) to 0.17-0.18 s.
FILE_ROWS_BYTES = 1 << 20

#: Coordinates of a stacked block a numba call takes at a time per thread (whole chunks).
CHUNK = 64


def kernel_dtype(dtype: np.dtype) -> bool:
    """Whether the kernels take arrays of ``dtype`` (float32 and float64; float16 stays numpy)."""
    return np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------------------------
# Loading


def missing(operation: str) -> str | None:
    """Why ``operation`` has no compiled kernels here (a sentence), or None when it has."""
    if operation in STACKED:
        return None if numba_kernels() is not None else (
            "numba is not installed. Install it (pip install 'numba>=0.60')."
        )
    if c_kernels() is not None:
        return None
    return f"the C kernels could not be built here: {_ckernels.failure()}"


def c_kernels() -> _ckernels.StreamedKernels | None:
    """The C kernels (built first if no cached build exists), None where they cannot be built."""
    return _ckernels.load()


@functools.cache
def numba_kernels() -> ModuleType | None:
    """`aggregation._numba_kernels`, ready to install its cached machine code without numba's
    refresh, or None when numba is not installed."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return None
    _skip_scipy_probe()
    from fedsplit.aggregation import _numba_kernels

    _load_from_cache_directly(_numba_kernels)
    return _numba_kernels


def _load_from_cache_directly(module: ModuleType) -> None:
    """Let the kernels' first calls install their cached machine code without numba's refresh.

    numba installs a kernel found in its on-disk cache only after refreshing its whole target
    context (``Cache.load_overload``: importing and registering every implementation module of
    numba, the typing registries with them; about 0.1 s of CPU, more than a third of numba's
    start), although the cached code needs none of them: it is linked against numba's runtime
    (NRT, initialised here as the refresh would) and its environment, which the cache rebuilds
    itself. A cache miss still compiles through numba's own path, which refreshes everything
    first. Nothing is changed when numba's cache API is not the one this was written for
    (``Cache._load_overload``), or for kernels compiled without a cache.
    """
    from numba.core.caching import Cache
    from numba.core.registry import CPUDispatcher
    from numba.core.runtime import nrt

    if not all(hasattr(Cache, a) for a in ("_load_overload", "_guard_against_spurious_io_errors")):
        return

    def load_overload(cache: Cache, sig: object, target_context: object) -> object:
        nrt.rtsys.initialize(target_context)
        with cache._guard_against_spurious_io_errors():
            return cache._load_overload(sig, target_context)
        return None  # an I/O error the guard swallowed: compile instead

    for kernel in vars(module).values():
        cache = getattr(kernel, "_cache", None)
        if isinstance(kernel, CPUDispatcher) and isinstance(cache, Cache):
            cache.load_overload = functools.partial(load_overload, cache)


def _skip_scipy_probe() -> None:
    """Keep numba from importing scipy.linalg when the kernels load (0.2-0.4 s of CPU).

    ``numba.np.arraymath``, which every kernel's typing loads, probes once at import whether
    scipy's BLAS is there (``numba.np.linalg.ensure_blas``: ``import scipy.linalg``), only to
    pick a BLAS inner product for ``np.correlate``-like functions the kernels do not use. The
    probe is answered "no" while that module is imported (those functions then use numba's
    own loop in this process); ``ensure_blas`` itself is restored at once, so ``np.dot`` and
    ``np.linalg`` in other jitted code still find scipy. Nothing is done when arraymath or
    scipy.linalg is already loaded.
    """
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    import numba.np.linalg as linalg

    probe = linalg.ensure_blas

    def absent() -> None:
        raise ImportError("not probed: fedsplit's kernels use no BLAS")

    linalg.ensure_blas = absent
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        linalg.ensure_blas = probe


# --------------------------------------------------------------------------------------------
# Sorting networks (built in Python once per N, run by the numba kernels)


def batcher_network(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort comparators ``(i, j)``, i < j, for ``n`` inputs.

    Built for the next power of two; comparators touching an index >= n are dropped (the padding
    would hold +inf, which no comparator moves), so it sorts any ``n``.
    """
    size = 1
    while size < n:
        size *= 2
    comps: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        comps.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return comps


@functools.cache
def selection_network(n: int, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """Comparators that put the right values at sorted ranks ``first..last`` of ``n`` inputs.

    Batcher's network, pruned backwards: a comparator is kept only when one of its outputs
    feeds a needed rank. Returned as two int64 arrays (low and high index of each comparator).
    """
    needed = set(range(first, last + 1))
    kept: list[tuple[int, int]] = []
    for a, b in reversed(batcher_network(n)):
        if a in needed or b in needed:
            kept.append((a, b))
            needed.update((a, b))
    kept.reverse()
    lo = np.array([a for a, _ in kept], dtype=np.int64)
    hi = np.array([b for _, b in kept], dtype=np.int64)
    return lo, hi


# --------------------------------------------------------------------------------------------
# The weighted sum's C calls


def file_block(num_updates: int) -> int:
    """Block length of a C weighted-sum pass that reads weight files: its ``(N, block)`` rows
    of reads take `FILE_ROWS_BYTES` (float32), so the call re-reads them from the core's cache
    (30 files: 8192 coordinates), never under 1024."""
    return max(1024, min(_reference.BLOCK, FILE_ROWS_BYTES // (4 * num_updates) // 1024 * 1024))


class CompiledBlockSum(BlockSum):
    """A thread's weighted-sum blocks, each one C call (float32/float64 parameters)."""

    def __init__(
        self,
        kernels: _ckernels.StreamedKernels,
        updates: Sequence[UpdateSource],
        weights: dict[np.dtype, np.ndarray],
        distances: bool = False,
        files: bool = False,
    ) -> None:
        super().__init__(updates, weights, distances, files)
        self.kernels = kernels
        # the C calls (one per dtype) and their view of the current parameter (`_locate`): per
        # update, the address (in memory, fd -1) or file offset (fd >= 0) of its first value;
        # whether some update holds it in another form (numpy's path then); the arrays whose
        # addresses are held
        self._calls: dict[np.dtype, _ckernels.WeightedSum] = {}
        self._param: tuple[str, np.dtype] | None = None
        self._base = np.zeros(len(updates), dtype=np.int64)
        self._numpy_param = False
        self._held: list[np.ndarray] = []

    def finish(self) -> None:
        self._held, self._param = [], None
        super().finish()

    def _call(self, dtype: np.dtype) -> _ckernels.WeightedSum:
        call = self._calls.get(dtype)
        if call is None:
            call = self._calls[dtype] = self.kernels.weighted_sum(
                len(self.readers), dtype, file_block(len(self.readers)), self.weights[dtype],
                self.dist2, _reference.GROUP, reads=self.reads_files,
            )
        return call

    def _locate(self, call: _ckernels.WeightedSum, name: str) -> None:
        """Find where every update's parameter ``name`` lies, once per parameter."""
        self._numpy_param, self._held = False, []
        for k, reader in enumerate(self.readers):
            whole = reader.whole(name)
            if whole is not None and whole.dtype == call.dtype and whole.flags.c_contiguous:
                self._held.append(whole)
                self._base[k], call.fd[k] = self.kernels.address(whole), -1
                continue
            where = reader.raw_location(name) if whole is None else None
            if where is not None:
                call.fd[k], self._base[k] = where
                continue
            call.fd[k], self._base[k] = -1, 0
            self._numpy_param = True  # read by `BlockReader.fetch`: numpy's path
        self._param = (name, call.dtype)

    def sum_block(self, block: Block, out: np.ndarray) -> None:
        """`block` in one C call (float32/float64 models). In-memory updates are read at their
        address; weight files whose values lie as they are are read by the call itself
        (`file_block` values at a time: one positional read per update into its row of an
        ``(N, sub)`` buffer that stays in the core's cache). The call sums them tile by tile
        (each tile's distances too, while its inputs are cached). A parameter that some update
        holds in another form (a compressed or big-endian file, another source), or of another
        dtype, takes numpy's path."""
        if not kernel_dtype(out.dtype):
            super().sum_block(block, out)
            return
        call = self._call(out.dtype)
        if self._param != (block.name, out.dtype):
            self._locate(call, block.name)
        if self._numpy_param:  # some update holds this parameter in another form
            super().sum_block(block, out)
            return
        np.add(self._base, block.start * out.dtype.itemsize, out=call.src)
        failed = call(out)
        if failed is not None:
            k, errno, got_bytes = failed
            source = base(self.readers[k].source)
            assert isinstance(source, WeightFile)  # only files are read by the call
            raise reads_of(source).read_failure(
                block.name, block.start, block.size * out.dtype.itemsize, got_bytes, errno
            )


# --------------------------------------------------------------------------------------------
# The backend


class CompiledBackend(NumpyBackend):
    """C kernels for the streamed operations, numba's for the stacked ones (module docstring);
    the numpy reference for what they do not take."""

    name = "compiled"

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._gram_scratch: list[Any] | None = None

    # ------------------------------------------------------------------ streamed passes

    @property
    def c(self) -> _ckernels.StreamedKernels:
        kernels = c_kernels()
        assert kernels is not None  # `BackendSettings.select` chose this backend because they load
        return kernels

    def block_sum(
        self, updates: Sequence[UpdateSource], weights: dict[np.dtype, np.ndarray],
        distances: bool, files: bool,
    ) -> BlockSum:
        return CompiledBlockSum(self.c, updates, weights, distances, files)

    def mean_bytes(
        self, specs: Sequence[ArraySpec], num_updates: int, files: bool
    ) -> tuple[int, int]:
        """numpy's per-coordinate buffers (what a parameter in another form falls back to;
        the C calls' own tile sums live on the stack), and per thread, with weight files, the
        ``(N, file_block(N))`` rows the calls read files into (float32/64 parameters)."""
        per_coordinate, _ = super().mean_bytes(specs, num_updates, files)
        per_thread = 0
        if files:
            sub = file_block(num_updates)
            dtypes = {s.dtype for s in specs}
            per_thread = sum(num_updates * sub * d.itemsize for d in dtypes if kernel_dtype(d))
        return per_coordinate, per_thread

    def weighted_sum(self, updates, specs, share, arrays, *, memory_budget, distances):
        from fedsplit.aggregation._reference import reads_files

        per_coordinate, per_thread = self.mean_bytes(specs, len(updates), reads_files(updates))
        if per_thread + per_coordinate > memory_budget:
            # a budget too small for the C calls' rows: numpy's buffers instead
            return NumpyBackend(self.workers).weighted_sum(
                updates, specs, share, arrays, memory_budget=memory_budget, distances=distances
            )
        return super().weighted_sum(
            updates, specs, share, arrays, memory_budget=memory_budget, distances=distances
        )

    def add_squares(
        self, readers: Sequence[BlockReader], block: Block, ref: np.ndarray, diff: np.ndarray,
        total: np.ndarray,
    ) -> None:
        """Difference, square and float64 sum in one C call per update (when ``ref`` and the
        values are float32/64 of the working dtype), else numpy's arithmetic."""
        work = diff.dtype
        if not (kernel_dtype(work) and ref.dtype == work):
            add_squared_distances(readers, block, ref, diff, total)
            return
        kernels = self.c
        for k, reader in enumerate(readers):
            got = reader.fetch(block, diff)
            if got.dtype == work and got.flags.c_contiguous:
                total[k] += kernels.squared_distance(got, ref)
                continue
            with np.errstate(invalid="ignore", over="ignore"):  # non-finite: flagged after
                np.subtract(got, ref, out=diff, dtype=work, casting="unsafe")
            total[k] += float(np.dot(diff, diff))

    # ------------------------------------------------------------------- stacked blocks

    @property
    def nb(self) -> ModuleType:
        kernels = numba_kernels()
        assert kernels is not None  # `BackendSettings.select` chose this backend because numba loads
        return kernels

    def _in_kernel(self, values: np.ndarray | Rows, out: np.ndarray) -> np.ndarray | None:
        """The rows' addresses when the block goes to a kernel, else None (numpy)."""
        if isinstance(values, Rows):  # read in place: only offered when the kernels run
            return values.addresses
        if kernel_dtype(values.dtype) and out.dtype == values.dtype:
            return stack_addresses(values)
        return None

    def _ranges(self, rows: np.ndarray, out: np.ndarray, kernel) -> OrderResults:
        """``kernel(rows, l0, l1, out[l0:l1], dropped, dist2)`` over a range of whole chunks
        of coordinates per thread; each range's (dropped, squared distances)."""
        size = out.size
        share = -(-size // self.workers)
        share = -(-share // CHUNK) * CHUNK
        ranges = [(l0, min(l0 + share, size)) for l0 in range(0, size, share)]
        n = len(rows)

        def run(l0: int, l1: int) -> tuple[np.ndarray, np.ndarray]:
            dropped = np.zeros(n, dtype=np.float64)
            dist2 = np.zeros(n, dtype=np.float64)
            kernel(rows, l0, l1, out[l0:l1], dropped, dist2)
            return dropped, dist2

        return map_threads(run, len(ranges), *zip(*ranges, strict=True))

    def trimmed_mean(self, values, out, cut):
        rows = self._in_kernel(values, out)
        if rows is None:
            return super().trimmed_mean(values, out, cut)
        n, nb = len(rows), self.nb
        lo, hi = selection_network(n, cut, n - cut - 1)

        def kernel(rows, l0, l1, o, dropped, dist2):
            counts = np.zeros(n, dtype=np.int64)
            nb.trim_tile(rows, l0, l1, lo, hi, cut, o, counts, dist2)
            dropped += counts

        return self._ranges(rows, out, kernel)

    def weighted_median(self, values, out, counts):
        rows = self._in_kernel(values, out)
        if rows is None:
            return super().weighted_median(values, out, counts)
        n, nb = len(rows), self.nb
        lo, hi = selection_network(n, 0, n - 1)
        total = int(counts.sum())

        def kernel(rows, l0, l1, o, dropped, dist2):
            used = np.zeros(n, dtype=np.int64)
            nb.weighted_median_tile(
                rows, l0, l1, lo, hi, counts.astype(np.int64), total, o, used, dist2
            )
            dropped += (l1 - l0) - used

        return self._ranges(rows, out, kernel)

    def weighted_trimmed_mean(self, values, out, counts, lo, hi):
        rows = self._in_kernel(values, out)
        if rows is None:
            return super().weighted_trimmed_mean(values, out, counts, lo, hi)
        n, nb = len(rows), self.nb
        net_lo, net_hi = selection_network(n, 0, n - 1)

        def kernel(rows, l0, l1, o, dropped, dist2):
            nb.weighted_trim_tile(
                rows, l0, l1, net_lo, net_hi, counts.astype(np.float64), lo, hi, o,
                dropped, dist2,
            )

        return self._ranges(rows, out, kernel)

    def center(self, stack: np.ndarray, sl: slice) -> None:
        if kernel_dtype(stack.dtype):
            self.nb.center_columns(stack, sl.start, sl.stop)
        else:
            super().center(stack, sl)

    def _gathered(self, rows: np.ndarray, dtype: np.dtype, grams: list[np.ndarray], slot: int,
                  part: Sequence[slice]) -> None:
        assert self._gram_scratch is not None
        gram = grams[slot]
        for sl in part:
            # the same tiles as the stacked path, so the same BLAS products, bit for bit
            tile = self._gram_scratch[slot].get("tile", (len(rows), sl.stop - sl.start), dtype)
            self.nb.gather_centered(rows, sl.start, sl.stop, tile)
            gram += tile @ tile.T

    def gram(self, values, grams):
        if not isinstance(values, Rows):
            super().gram(values, grams)
            return
        from fedsplit.aggregation._blocks import Scratch

        if self._gram_scratch is None:
            self._gram_scratch = [Scratch() for _ in range(self.workers)]
        parts = list(tiles(values.views[0].size, GRAM_TILE))
        threads = max(1, min(self.workers, len(parts)))
        map_threads(
            functools.partial(self._gathered, values.addresses, values.views[0].dtype, grams),
            threads, range(threads), round_robin(parts, threads),
        )

    def takes_rows(self, operation: str, plan: BlockPlan) -> bool:
        """The stacked kernels read float32/64 blocks in place; Krum's tiles only when a block
        holds at least one tile per thread (each thread's (N, tile) buffer then stays within
        the stack the plan counted)."""
        if not kernel_dtype(plan.dtype) or operation not in STACKED:
            return False
        return operation != "gram" or plan.values_per_block >= self.workers * GRAM_TILE

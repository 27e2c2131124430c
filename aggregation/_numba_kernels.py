"""numba kernels of the stacked operations (imported only through `aggregation._compiled`).

Each kernel does exactly the arithmetic of the numpy reference it replaces, in the same
precision (differences and where they come from: docs/aggregation.md, "Backends").
Arrays are float32 or float64 and C-contiguous; scalars are int64 or float64, so each kernel
compiles for two signatures at most. Every kernel releases the GIL (``nogil``) and is cached
on disk (``cache=True``) when a cache directory is writable.

The order-statistic kernels and Krum's `gather_centered` take a block as ``rows``: an int64
array holding the address of each update's first value of the block
(`aggregation._blocks.Rows`: the update's own memory or its weight file's mapped pages; or the
rows of a stacked buffer, `aggregation._blocks.stack_addresses`), so they read the N updates
where they lie without a stacked copy. The order-statistic kernels work on coordinates
``l0:l1`` in chunks of `CHUNK` coordinates: the chunk's N x CHUNK values are copied into a
buffer that stays in the L1 cache, sorted by a sorting network run across the chunk's
coordinates (each compare-exchange is a vectorised min/max of two rows), and the rule's
value, each update's drop count and its squared distance to the result are taken from the
buffer and the unsorted rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Coordinates sorted together: N x CHUNK values (12.8 KB for N=50 float32) stay in L1.
CHUNK = 64
#: Scratch bytes per stacked value (N x chunk) an order-statistic kernel call allocates: the
#: sorted copy (at most 8), an int64 count or index and a float64 square per value.
SCRATCH_PER_VALUE = 24


def _jit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(nogil=True, cache=True, ...)``; in-memory compilation when nothing is writable.

    numba looks for a cache directory when the decorator is applied (beside the source, then
    its per-user cache directory, or ``NUMBA_CACHE_DIR``) and raises when none can be written.
    """

    def wrap(fn: Callable[..., Any]) -> Any:
        try:
            return numba.njit(nogil=True, cache=True, **options)(fn)
        except RuntimeError:  # no writable cache location: compile at every start instead
            return numba.njit(nogil=True, cache=False, **options)(fn)

    return wrap


@intrinsic
def _pointer(typingctx, address):
    """An int64 memory address as a ``void*`` (for `numba.carray`)."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@_jit(inline="always")
def _row(rows, r, length, dtype):
    """Row ``r`` of a block as an array of ``length`` values: ``rows[r]`` is its address."""
    return numba.carray(_pointer(rows[r]), (length,), dtype)


@_jit()
def trim_tile(rows, l0, l1, lo_idx, hi_idx, cut, out, dropped, dist2):
    """Mean of sorted ranks ``cut .. N-cut-1`` of coordinates ``l0:l1`` into ``out`` (l1 - l0).

    ``rows[k]`` is the address of update k's block (its values contiguous, of ``out``'s dtype;
    a row of the stacked buffer or the update's own memory: `aggregation._blocks.Rows`).
    One or two kept values are returned / halved in the input precision (as ``np.median``);
    more are summed in float64 in rank order and divided by their number. ``dropped[k]`` gains
    the number of coordinates where update k's value lies outside the kept range (differs
    from the single kept value when one is kept); ``dist2[k]`` gains the float64 sum of
    ``(x_k - result)**2``, each difference taken in the input precision.
    """
    n = rows.shape[0]
    width = n - 2 * cut
    chunk = min(CHUNK, l1 - l0)
    buf = np.empty((n, chunk), dtype=out.dtype)
    res = np.empty(chunk, dtype=out.dtype)
    low = np.empty(chunk, dtype=out.dtype)
    high = np.empty(chunk, dtype=out.dtype)
    total = np.empty(chunk, dtype=np.float64)
    counts = np.zeros((n, chunk), dtype=np.int64)
    squares = np.zeros((n, chunk), dtype=np.float64)
    for c0 in range(l0, l1, chunk):
        w = min(chunk, l1 - c0)
        for r in range(n):
            x = _row(rows, r, l1, out.dtype)
            for j in range(w):
                buf[r, j] = x[c0 + j]
        for c in range(lo_idx.shape[0]):
            a = lo_idx[c]
            b = hi_idx[c]
            for j in range(w):
                u = buf[a, j]
                v = buf[b, j]
                buf[a, j] = min(u, v)
                buf[b, j] = max(u, v)
        if width == 1:
            for j in range(w):
                res[j] = buf[cut, j]
        elif width == 2:
            for j in range(w):
                res[j] = (buf[cut, j] + buf[cut + 1, j]) * 0.5
        else:
            for j in range(w):
                total[j] = 0.0
            for r in range(cut, n - cut):
                for j in range(w):
                    total[j] += buf[r, j]
            for j in range(w):
                res[j] = total[j] / width
        for j in range(w):
            out[c0 - l0 + j] = res[j]
        if cut > 0:
            for j in range(w):
                low[j] = buf[cut, j]
                high[j] = buf[n - cut - 1, j]
            for r in range(n):
                x = _row(rows, r, l1, out.dtype)
                for j in range(w):
                    v = x[c0 + j]
                    if width == 1:
                        counts[r, j] += np.int64(v != low[j])
                    else:
                        counts[r, j] += np.int64(v < low[j]) + np.int64(v > high[j])
        _add_squares(rows, l1, c0, w, res, squares)
    for r in range(n):
        dropped[r] += counts[r].sum()
        dist2[r] += squares[r].sum()


@_jit()
def _add_squares(rows, length, c0, w, res, squares):
    """``squares[r, j] += (x_r[c0 + j] - res[j])**2`` in float64 (each update's distance part)."""
    for r in range(rows.shape[0]):
        x = _row(rows, r, length, res.dtype)
        for j in range(w):
            d = np.float64(x[c0 + j] - res[j])
            squares[r, j] += d * d


@_jit()
def _sorted_with_index(rows, length, c0, w, lo_idx, hi_idx, buf, idx):
    """Sort coordinates ``c0:c0+w`` per coordinate into ``buf``, carrying update indices."""
    n = rows.shape[0]
    for r in range(n):
        x = _row(rows, r, length, buf.dtype)
        for j in range(w):
            buf[r, j] = x[c0 + j]
            idx[r, j] = r
    for c in range(lo_idx.shape[0]):
        a = lo_idx[c]
        b = hi_idx[c]
        for j in range(w):
            u = buf[a, j]
            v = buf[b, j]
            ia = idx[a, j]
            ib = idx[b, j]
            swap = v < u
            buf[a, j] = v if swap else u
            buf[b, j] = u if swap else v
            idx[a, j] = ib if swap else ia
            idx[b, j] = ia if swap else ib


@_jit()
def weighted_median_tile(rows, l0, l1, lo_idx, hi_idx, counts, total, out, used, dist2):
    """Count-weighted median of coordinates ``l0:l1`` (`aggregation._order.weighted_median`).

    ``rows`` as in `trim_tile`; ``used[k]`` gains the number of coordinates where update k's
    value made the result; ``dist2`` as in `trim_tile`.
    """
    n = rows.shape[0]
    chunk = min(CHUNK, l1 - l0)
    buf = np.empty((n, chunk), dtype=out.dtype)
    idx = np.empty((n, chunk), dtype=np.int64)
    res = np.empty(chunk, dtype=out.dtype)
    squares = np.zeros((n, chunk), dtype=np.float64)
    for c0 in range(l0, l1, chunk):
        w = min(chunk, l1 - c0)
        _sorted_with_index(rows, l1, c0, w, lo_idx, hi_idx, buf, idx)
        for j in range(w):
            cum = 0
            k = 0
            for r in range(n):
                cum += counts[idx[r, j]]
                k = r
                if 2 * cum >= total:
                    break
            k1 = min(k + 1, n - 1)
            used[idx[k, j]] += 1
            if 2 * cum == total:
                res[j] = (buf[k, j] + buf[k1, j]) * 0.5
                used[idx[k1, j]] += 1
            else:
                res[j] = buf[k, j]
            out[c0 - l0 + j] = res[j]
        _add_squares(rows, l1, c0, w, res, squares)
    for r in range(n):
        dist2[r] += squares[r].sum()


@_jit()
def weighted_trim_tile(rows, l0, l1, lo_idx, hi_idx, counts, lo, hi, out, dropped, dist2):
    """Count-weighted trimmed mean of ``l0:l1`` (`aggregation._order.weighted_trimmed_mean`).

    ``rows`` as in `trim_tile`; ``dropped[k]`` gains the share of update k's count trimmed at
    each coordinate (float64); ``dist2`` as in `trim_tile`.
    """
    n = rows.shape[0]
    chunk = min(CHUNK, l1 - l0)
    buf = np.empty((n, chunk), dtype=out.dtype)
    idx = np.empty((n, chunk), dtype=np.int64)
    res = np.empty(chunk, dtype=out.dtype)
    squares = np.zeros((n, chunk), dtype=np.float64)
    for c0 in range(l0, l1, chunk):
        w = min(chunk, l1 - c0)
        _sorted_with_index(rows, l1, c0, w, lo_idx, hi_idx, buf, idx)
        for j in range(w):
            cum = 0.0
            num = 0.0
            den = 0.0
            for r in range(n):
                k = idx[r, j]
                weight = counts[k]
                start = cum
                cum += weight
                kept = min(cum, hi) - max(start, lo)
                if kept < 0.0:
                    kept = 0.0
                num += np.float64(buf[r, j]) * kept
                den += kept
                dropped[k] += 1.0 - kept / weight
            res[j] = num / den
            out[c0 - l0 + j] = res[j]
        _add_squares(rows, l1, c0, w, res, squares)
    for r in range(n):
        dist2[r] += squares[r].sum()


@_jit()
def center_columns(x, l0, l1):
    """Subtract from ``x[:, l0:l1]`` each column's mean (float64 mean, cast, then subtracted).

    Exactly ``tile -= tile.mean(axis=0, dtype=np.float64).astype(tile.dtype)``: the rows are
    added in order in float64 and the sum divided by N.
    """
    n = x.shape[0]
    step = 1024
    total = np.empty(step, dtype=np.float64)
    mean = np.empty(step, dtype=x.dtype)
    for c0 in range(l0, l1, step):
        w = min(step, l1 - c0)
        for j in range(w):
            total[j] = 0.0
        for r in range(n):
            for j in range(w):
                total[j] += x[r, c0 + j]
        for j in range(w):
            mean[j] = total[j] / n
        for r in range(n):
            for j in range(w):
                x[r, c0 + j] -= mean[j]


@_jit()
def gather_centered(rows, l0, l1, tile):
    """``tile[:, :l1-l0]`` = coordinates ``l0:l1`` of the rows, minus each coordinate's mean.

    ``rows`` as in `trim_tile`. The same arithmetic as `center_columns` (float64 column mean
    of the rows in order, cast, subtracted in the input precision), reading each update's own
    memory straight into the cache-resident tile instead of centring a stacked copy in place.
    """
    n = rows.shape[0]
    w = l1 - l0
    total = np.zeros(w, dtype=np.float64)
    mean = np.empty(w, dtype=tile.dtype)
    for r in range(n):
        x = _row(rows, r, l1, tile.dtype)
        for j in range(w):
            v = x[l0 + j]
            tile[r, j] = v
            total[j] += v
    for j in range(w):
        mean[j] = total[j] / n
    for r in range(n):
        for j in range(w):
            tile[r, j] -= mean[j]


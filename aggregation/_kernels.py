"""Which implementation a pass runs: the numpy reference, numba-compiled kernels, or torch.

The compiled kernels (`aggregation._numba_kernels`) do the same arithmetic as the numpy code
they replace, in one pass over cache-resident data instead of several numpy calls:

- median and trimmed mean: a sorting network run across coordinates (each compare-exchange is
  a vectorised min/max of two updates' rows of a cache-sized tile), pruned to the ranks the
  rule needs, with the trim-and-sum, the per-update drop counts and the distances fused in;
  the count-weighted variants carry each value's update index through the same network;
- FedAvg's weighted sum: one fused multiply-add per update and coordinate;
- the distance pass, and Krum's tiles gathered from the updates and centred in one pass (the
  Gram product itself stays in BLAS).

The stacked kernels read the updates in place (`aggregation._blocks.Rows`: in-memory updates,
memory-mapped weight files) instead of a stacked copy.

Choice (``FEDSPLIT_AGG_KERNELS``, read at every pass):

- ``auto`` (default): the kernels when numba is installed and the pass reads at least
  `COMPILED_FROM` values (smaller passes stay in numpy: importing numba and loading the
  cached kernels costs more than they save there). The streamed passes (FedAvg's weighted
  sum, the distance pass: memory-bound, where the kernels gain about 10%) use them only once
  they are loaded (`streamed`), since loading them (about 0.5 s of CPU, 0.19 s since numba's
  refresh is skipped: `_load_from_cache_directly`) costs more than they save on any model that
  fits in memory: `fedsplit aggregate` of FedAvg over 30 files of 10M parameters took 1.4 s of
  CPU in numpy against 2.05 s with the kernels loaded for it (1.1-1.3 s against 1.5-1.7 s after
  that change);
- ``numba``: the kernels for every pass, whatever its size (an error when numba is missing);
- ``numpy``: the numpy reference everywhere.

numba compiles each kernel once per signature and caches the machine code on disk
(``cache=True``: beside this file, or in numba's per-user cache directory when the install is
read-only, or in ``NUMBA_CACHE_DIR``); when no cache directory is writable the kernels are
compiled in memory at every start instead. The kernels release the GIL and run on the
aggregation's own worker threads (`aggregation._threads`, ``FEDSPLIT_AGG_THREADS``), never on
numba's threading layer.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
from fedsplit.aggregation.errors import AggregationError

if TYPE_CHECKING:
    from fedsplit.aggregation._ckernels import StreamedKernels

#: ``auto`` uses the compiled kernels from this many values read by a pass (N x coordinates).
COMPILED_FROM = 1 << 20

MODES = ("auto", "compiled", "numba", "numpy")


def mode() -> str:
    """``FEDSPLIT_AGG_KERNELS``: ``auto`` (default), ``compiled`` (``numba`` is the same) or
    ``numpy``."""
    raw = os.environ.get("FEDSPLIT_AGG_KERNELS", "").strip().lower() or "auto"
    if raw not in MODES:
        raise AggregationError(
            f"FEDSPLIT_AGG_KERNELS is 'auto' (compiled kernels where they pay: numba's for large "
            f"stacked passes, the C streamed kernels once built), 'compiled' (always; 'numba' is "
            f"the same) or 'numpy' (the reference code). Received: {raw!r}"
        )
    return "compiled" if raw == "numba" else raw


@functools.cache
def _load() -> ModuleType | None:
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


def compiled(values: int) -> ModuleType | None:
    """The compiled-kernel module for a pass over ``values`` values, or None for numpy."""
    chosen = mode()
    if chosen == "numpy" or (chosen == "auto" and values < COMPILED_FROM):
        return None
    module = _load()
    if module is None and chosen == "compiled":
        raise AggregationError(
            "FEDSPLIT_AGG_KERNELS=compiled asks for the compiled kernels, but numba is not "
            "installed. Install it (pip install 'numba>=0.60') or unset the variable. "
            "Received: FEDSPLIT_AGG_KERNELS=compiled"
        )
    return module


def streamed() -> StreamedKernels | None:
    """The C kernels of the memory-bound streamed passes (`aggregation._ckernels`: FedAvg's
    weighted sum, the distance pass), or None for numpy.

    No size threshold: they load in about a millisecond (built once per machine and source
    version). ``auto`` uses them when they could be built here; ``compiled`` (or ``numba``)
    fails with the reason when they could not; ``numpy`` never uses them."""
    chosen = mode()
    if chosen == "numpy":
        return None
    from fedsplit.aggregation import _ckernels

    kernels = _ckernels.load()
    if kernels is None and chosen != "auto":
        raise AggregationError(
            "FEDSPLIT_AGG_KERNELS=compiled asks for the compiled kernels, but the streamed "
            f"kernels could not be built here: {_ckernels.failure()} Or unset the variable "
            "(auto: numpy where they are missing). Received: FEDSPLIT_AGG_KERNELS=compiled"
        )
    return kernels


def kernel_dtype(dtype: np.dtype) -> bool:
    """Whether the kernels take arrays of ``dtype`` (float32 and float64; float16 stays numpy)."""
    return np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------------------------
# Sorting networks (built in Python once per N, run by the kernels)


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

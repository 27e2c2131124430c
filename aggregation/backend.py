"""The aggregation backends: six operations behind one interface, and `select`.

Every aggregation rule is built from six operations over the N updates:

- ``weighted_sum``: ``sum_k s_k w_k`` (FedAvg, multi-Krum's selection, each Weiszfeld step),
  optionally with each update's distance to the result in the same pass;
- ``squared_distances``: each update's squared L2 distance to an aggregate;
- ``trimmed_mean``: the coordinate-wise trimmed mean (the median is its middle cut);
- ``weighted_median`` and ``weighted_trimmed_mean``: their sample-count-weighted forms;
- ``gram``: the Gram matrix of the centred updates (Krum's pairwise distances).

A rule calls the functions of this module, named after them (``backend.weighted_sum(...)``,
``backend.median(...)``, ``backend.gram(...)``, ...), and never asks which technology runs.
Each function plans its pass (blocks within the memory budget, worker threads), asks `select`
once for the backend of the whole pass, and hands it the blocks. A backend implements the
`Backend` interface (`aggregation._interface`):

- `aggregation._reference.NumpyBackend` (``numpy``): the reference every other backend is
  tested against, and the one they fall back to where they have no implementation;
- `aggregation._compiled.CompiledBackend` (``compiled``): C kernels built with cffi for the
  two streamed operations, numba kernels for the four stacked ones (why two technologies:
  `select`);
- `aggregation._device.GpuBackend` (``gpu``): torch on a CUDA device.

numba, cffi and torch are imported inside aggregation/ by those backend modules only
(`_compiled`, `_numba_kernels`, `_ckernels`, `_device`; a test checks it).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence

import numpy as np
from fedsplit.aggregation import _compiled, _device
from fedsplit.aggregation._blocks import (
    DEFAULT_MEMORY_BUDGET,
    Block,
    BlockPlan,
    Rows,
    StackReducer,
    empty_like_specs,
    flag_non_finite,
    run_stacked,
    work_dtype,
)
from fedsplit.aggregation._interface import (
    OPERATIONS,
    STACKED,
    STREAMED,
    Backend,
    DistancePass,
    GramPass,
    MeanPass,
    OrderPass,
    OrderResults,
)
from fedsplit.aggregation._reference import NumpyBackend, stacked_bytes
from fedsplit.aggregation.building_blocks import shares_of
from fedsplit.aggregation.errors import AggregationError, NotEnoughUpdatesError
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.update import UpdateSource

__all__ = [
    "COMPILED_FROM", "OPERATIONS", "STACKED", "STREAMED", "Backend", "DistancePass", "GramPass",
    "MeanPass", "OrderPass", "OrderResults", "gram", "median", "mode", "select",
    "squared_distances", "trimmed_mean", "weighted_median", "weighted_sum",
    "weighted_trimmed_mean",
]

#: The environment variable that names the backend (see `select`).
ENV = "FEDSPLIT_AGG_BACKEND"
MODES = ("auto", "numpy", "compiled", "gpu")
#: The variable ``FEDSPLIT_AGG_BACKEND`` replaces (still read, with a warning, when it is unset).
OLD_ENV = "FEDSPLIT_AGG_KERNELS"

#: ``auto`` sends a pass to the GPU, and a stacked pass to the numba kernels, from this many
#: values read (N x coordinates); smaller passes stay in numpy.
COMPILED_FROM = 1 << 20
#: Stacked operations ``auto`` leaves to numpy at any size (see `select`).
NUMPY_UNDER_AUTO = ("gram",)

# --------------------------------------------------------------------------------------------
# The choice


def mode() -> str:
    """``FEDSPLIT_AGG_BACKEND``: ``auto`` (default), ``numpy``, ``compiled`` or ``gpu``.

    When it is unset, the variable it replaces, ``FEDSPLIT_AGG_KERNELS`` (``auto``, ``numpy``,
    ``compiled``, ``numba``: the same as ``compiled``), is still read, with a warning."""
    raw = os.environ.get(ENV, "").strip().lower()
    if not raw and os.environ.get(OLD_ENV, "").strip():
        old = os.environ[OLD_ENV].strip().lower()
        _warn_old(old)
        raw = "compiled" if old == "numba" else old
        if raw not in ("auto", "numpy", "compiled"):
            raise AggregationError(
                f"{OLD_ENV} (replaced by {ENV}) is 'auto', 'compiled' ('numba' is the same) or "
                f"'numpy'. Set {ENV} instead. Received: {OLD_ENV}={old!r}"
            )
    raw = raw or "auto"
    if raw not in MODES:
        raise AggregationError(
            f"{ENV} is 'auto' (the GPU, the compiled kernels or numpy, where each pays), "
            f"'numpy' (the reference code), 'compiled' (the C and numba kernels for every pass) "
            f"or 'gpu' (every pass on a CUDA GPU). Received: {raw!r}"
        )
    return raw


@functools.cache
def _warn_old(value: str) -> None:
    warnings.warn(
        f"{OLD_ENV} is deprecated: set {ENV}={'compiled' if value == 'numba' else value} "
        f"instead (auto, numpy, compiled or gpu).",
        FutureWarning,
        stacklevel=4,
    )


def select(operation: str, values: int) -> Backend:
    """The backend that runs ``operation`` for one whole pass over ``values`` values (N x
    coordinates): the one place the technology is chosen. The policy:

    1. **GPU.** ``FEDSPLIT_AGG_BACKEND=gpu``: every pass on the CUDA device of the call
       (``aggregate_updates(device=...)``, ``fedsplit aggregate --device``), else the current
       one; an error when torch sees no GPU or the call names ``--device cpu``. Under any other
       value, a device the call names (``cuda``, ``cuda:N``) takes every pass, and the default
       device (``auto``: the first CUDA GPU, found without importing torch where there is no
       NVIDIA driver) takes the passes of at least `COMPILED_FROM` values when the variable is
       ``auto``. ``--device cpu`` never uses the GPU.
    2. **numpy.** ``FEDSPLIT_AGG_BACKEND=numpy``: the numpy reference for every pass the GPU
       does not take.
    3. **compiled.** ``FEDSPLIT_AGG_BACKEND=compiled``: the compiled kernels for every such
       pass, whatever its size; an error naming the reason when the operation's kernels are
       missing here (no C compiler for ``weighted_sum`` and ``squared_distances``, numba not
       installed for the four stacked operations).
    4. **auto** (the default): ``weighted_sum`` and ``squared_distances`` run the C kernels
       whenever they could be built on this machine (they load in about a millisecond); the
       sorting operations (``trimmed_mean``, ``weighted_median``, ``weighted_trimmed_mean``)
       run numba's kernels from `COMPILED_FROM` values when numba is installed (importing
       numba and loading its cached kernels takes about 0.2-0.4 s, which smaller passes do not
       win back); everything else runs numpy, ``gram`` always: its work is BLAS's tile product
       either way, numba would only centre the tiles, and its start-up is not won back
       (``fedsplit aggregate`` of Krum over 30 files x 10M, best of 5: 1.77 s in numpy, 2.20 s
       with numba's kernels; multi-Krum 1.89 s and 2.36 s).

    Inside the compiled backend, a block it has no kernel for runs the numpy reference: float16
    parameters, a stacked block whose output dtype differs from its values', a weight file's
    parameter stored in another form (compressed, big-endian), and the whole weighted sum when
    the memory budget cannot hold its per-thread read buffers.

    Two compiled technologies, for this reason: the streamed operations read every value once
    and do little arithmetic on it, so they are bound by memory and a kernel saves about half
    the pass, less than numba's start-up on any model that fits in memory (``fedsplit
    aggregate`` of FedAvg over 30 files x 10M: 1.4 s of CPU in numpy, 2.05 s with numba's
    kernels loaded for it), while a few lines of C load in a millisecond and read the weight
    files themselves. The stacked operations are sorting networks and tile gathers, compute
    bound, where numba's kernels pay for their start-up from `COMPILED_FROM` values; they are
    not written in C.
    """
    if operation not in OPERATIONS:
        raise ValueError(f"operation is one of {', '.join(OPERATIONS)}. Received: {operation!r}")
    chosen = mode()
    gpu = _device.gpu_for(chosen, values, COMPILED_FROM)
    if gpu is not None:
        return _device.GpuBackend(gpu)
    if chosen == "numpy" or (chosen == "auto" and operation in STACKED
                             and (values < COMPILED_FROM or operation in NUMPY_UNDER_AUTO)):
        return NumpyBackend()
    missing = _compiled.missing(operation)
    if missing is None:
        return _compiled.CompiledBackend()
    if chosen == "compiled":
        raise AggregationError(
            f"{ENV}=compiled asks for the compiled kernels, but {missing} Or set {ENV}=auto "
            f"(numpy where they are missing). Received: {ENV}=compiled"
        )
    return NumpyBackend()


# --------------------------------------------------------------------------------------------
# The operations, as rules call them


def _specs(updates: Sequence[UpdateSource]) -> tuple[ArraySpec, ...]:
    if not updates:
        raise NotEnoughUpdatesError("A pass needs at least one update. Received: 0 updates")
    return tuple(updates[0].header.specs)


def _values(updates: Sequence[UpdateSource], specs: Sequence[ArraySpec]) -> int:
    return len(updates) * sum(s.size for s in specs)


def weighted_sum(
    updates: Sequence[UpdateSource],
    weights: Sequence[float] | np.ndarray,
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    out: dict[str, np.ndarray] | None = None,
    distances: bool = False,
) -> MeanPass:
    """Return ``sum_k s_k w_k`` with shares ``s_k = weights_k / sum(weights)`` (the weighted
    mean), streamed.

    ``weights`` are any non-negative numbers (sample counts give FedAvg). The result is written
    to ``out`` when given (arrays shaped like the updates, e.g. the previous iterate of an
    iterative rule: the pass does not read it), else to new arrays. Working memory: a few
    block-sized buffers per thread, within ``memory_budget``. With ``distances``, each
    update's L2 distance to the result comes from the same pass (``.distances``), each block's
    right after it while its inputs are still in the cache, instead of a second pass
    (`squared_distances`) reading every input again.
    """
    specs = _specs(updates)
    share = shares_of(weights, len(updates))
    arrays = out if out is not None else empty_like_specs(specs)
    chosen = select("weighted_sum", _values(updates, specs))
    mean = chosen.weighted_sum(
        updates, specs, share, arrays, memory_budget=memory_budget, distances=distances
    )
    flag_non_finite(updates, list(arrays.values()))
    if mean.distances is not None:
        flag_non_finite(updates, [mean.distances])
    return mean


def squared_distances(
    updates: Sequence[UpdateSource],
    arrays: dict[str, np.ndarray],
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> DistancePass:
    """Each update's squared L2 distance to ``arrays`` (all parameters), as its root: the L2
    distance (``.values``).

    Block by block (each block of ``arrays`` stays in cache while every update's block is
    compared with it, so each input byte is read once), blocks shared out among the worker
    threads. Differences are taken in the working precision (float32 for float16/32 models);
    squares are summed in float64 per block (so the last bits depend on the block length).
    """
    specs = _specs(updates)
    chosen = select("squared_distances", _values(updates, specs))
    dist = chosen.squared_distances(updates, specs, arrays, memory_budget=memory_budget)
    flag_non_finite(updates, [dist.values])
    return dist


class _Stacked(StackReducer):
    """Feeds each stacked block to one operation of the pass's backend and adds up what the
    operation reports per update (order statistics: values dropped, squared distances)."""

    def __init__(self, chosen: Backend, operation: str, n: int, itemsize: int, **params) -> None:
        per_value, self.bytes_per_coordinate = stacked_bytes(operation, itemsize)
        # every worker's tile scratch is at most one block's share of values, so counting it
        # per stacked value keeps the total within the plan; the GPU's copies count too
        self.bytes_per_value = max(chosen.workers * per_value, chosen.device_bytes_per_value)
        self.chosen, self.operation, self.params = chosen, operation, params
        self.run = getattr(chosen, operation)
        self.dropped = np.zeros(n, dtype=np.float64)
        self.dist2 = np.zeros(n, dtype=np.float64)
        self.coords = 0

    def takes_rows(self, plan: BlockPlan) -> bool:
        return self.chosen.takes_rows(self.operation, plan)

    def proof(self) -> list[np.ndarray]:
        """The squared distances: every value read enters one, so they are finite only if all
        values were (or the sum overflowed)."""
        return [self.dist2]

    def __call__(self, block: Block, stack: np.ndarray | Rows, out: np.ndarray | None) -> None:
        assert out is not None
        for dropped, dist2 in self.run(stack, out, **self.params):
            self.dropped += dropped
            self.dist2 += dist2
        self.coords += block.size


def _order_statistic(
    updates: Sequence[UpdateSource], operation: str, memory_budget: int, **params
) -> OrderPass:
    specs = _specs(updates)
    itemsize = max(work_dtype(s.dtype).itemsize for s in specs)
    chosen = select(operation, _values(updates, specs))
    reducer = _Stacked(chosen, operation, len(updates), itemsize, **params)
    outputs = empty_like_specs(specs)
    plan = run_stacked(updates, specs, reducer, memory_budget=memory_budget, outputs=outputs)
    return OrderPass(
        arrays=outputs,
        dropped=reducer.dropped / max(reducer.coords, 1),
        distances=np.sqrt(reducer.dist2),
        working_bytes=plan.working_bytes,
    )


def trimmed_mean(
    updates: Sequence[UpdateSource], cut: int, *, memory_budget: int = DEFAULT_MEMORY_BUDGET
) -> OrderPass:
    """Coordinate-wise mean of the sorted values ``cut .. N-cut-1`` (``cut`` dropped at each
    end), over parameter blocks of all N updates within the budget (`run_stacked`).

    Two kept values are averaged in the input precision, as ``np.median`` does; more are
    summed in float64."""
    if not 0 <= 2 * cut < len(updates):
        raise ValueError(f"cut must satisfy 0 <= 2*cut < N={len(updates)}. Received: {cut}")
    return _order_statistic(updates, "trimmed_mean", memory_budget, cut=cut)


def median(
    updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET
) -> OrderPass:
    """Coordinate-wise median: the trimmed mean at the middle cut ``(N-1)//2`` (even N: the
    mean of the two middle values, as numpy)."""
    return trimmed_mean(updates, (len(updates) - 1) // 2, memory_budget=memory_budget)


def weighted_median(
    updates: Sequence[UpdateSource], counts: np.ndarray, *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> OrderPass:
    """Coordinate-wise sample-count-weighted median (`_reference.weighted_median` defines it)."""
    return _order_statistic(updates, "weighted_median", memory_budget, counts=counts)


def weighted_trimmed_mean(
    updates: Sequence[UpdateSource], counts: np.ndarray, beta: float, *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> OrderPass:
    """Coordinate-wise sample-count-weighted trimmed mean: the count mass below ``beta`` and
    above ``1 - beta`` of the total is cut (`_reference.weighted_trimmed_mean` defines it)."""
    total = float(counts.sum())
    return _order_statistic(
        updates, "weighted_trimmed_mean", memory_budget,
        counts=counts, lo=beta * total, hi=(1.0 - beta) * total,
    )


class _GramReducer(StackReducer):
    """Accumulates the centred Gram matrix of the N updates, block by block."""

    def __init__(self, chosen: Backend, n: int) -> None:
        self.chosen = chosen
        self.bytes_per_value = chosen.device_bytes_per_value  # centred in place on the CPU
        self.grams = [np.zeros((n, n), dtype=np.float64) for _ in range(chosen.workers)]

    def takes_rows(self, plan: BlockPlan) -> bool:
        return self.chosen.takes_rows("gram", plan)

    def proof(self) -> list[np.ndarray]:
        """The Gram matrix: a non-finite value makes its tile's column mean, hence every
        centred value of that column and the diagonal, non-finite."""
        return self.grams

    def __call__(self, block: Block, stack: np.ndarray | Rows, out: np.ndarray | None) -> None:
        self.chosen.gram(stack, self.grams)


def gram(
    updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET
) -> GramPass:
    """The N x N Gram matrix ``G = X X^T`` of the flattened updates, each block's coordinates
    centred on their mean first (distances do not change, cancellation does), summed in
    float64, over parameter blocks within the budget: no flattened copy of the updates."""
    specs = _specs(updates)
    reducer = _GramReducer(select("gram", _values(updates, specs)), len(updates))
    plan = run_stacked(updates, specs, reducer, memory_budget=memory_budget)
    return GramPass(np.sum(reducer.grams, axis=0), plan.working_bytes)

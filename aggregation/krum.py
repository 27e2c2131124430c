"""Krum and multi-Krum (Blanchard et al., 2017; El Mhamdi et al., 2018).

With N updates and at most f hostile ones, each update k gets the score

    score(k) = sum of the squared distances from w_k to its N - f - 2 nearest other updates

Krum returns the update with the lowest score; multi-Krum averages the m lowest-scoring
updates weighted by sample count (as Flower's ``aggregate_krum`` with ``to_keep=m``). Krum's
guarantee needs N >= 2f + 3, and multi-Krum's m at most N - f: `min_updates` is
max(2f + 3, m + f), and fewer updates are refused.

Gram-matrix formulation: all pairwise squared distances follow from the N x N Gram matrix
G = X X^T of the (flattened) updates, ||w_i - w_j||^2 = G_ii + G_jj - 2 G_ij. G is
accumulated block by block (`aggregation._blocks`): each block of N updates is centred on its
coordinate-wise mean (distances do not change, cancellation does) and multiplied by its own
transpose with BLAS, summed in float64 (tiles dealt to the worker threads; on a GPU, in
torch). With the compiled kernels each tile is gathered straight from the updates (in memory
or mapped) and centred in one pass into a per-thread buffer, with no stacked copy. No
flattened second copy of the updates and no N^2 loop over full-length vectors, as Flower's
reference needs; the extra memory stays within the budget, and the distance of every update
to the aggregate comes from G for free. The selection's count-weighted mean is one streamed
pass (`building_blocks.weighted_mean`; for Krum's single choice the weight is exactly 1, so
the update is returned bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from fedsplit.aggregation._blocks import (
    DEFAULT_MEMORY_BUDGET,
    Block,
    BlockPlan,
    Rows,
    Scratch,
    StackReducer,
    run_stacked,
    tiles,
)
from fedsplit.aggregation._device import DEVICE_BYTES_PER_VALUE, active_device
from fedsplit.aggregation._kernels import compiled, kernel_dtype
from fedsplit.aggregation._threads import map_threads, round_robin, worker_count
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from fedsplit.aggregation.building_blocks import inputs_of, make_result, site_reports, weighted_mean
from fedsplit.aggregation.registry import register
from fedsplit.protocol.update import UpdateSource
from pydantic import Field

#: Coordinates per Gram tile: short float32 dot products, accumulated in float64 per tile.
GRAM_TILE = 16384


class GramReducer(StackReducer):
    """Accumulates the centred Gram matrix of the N updates, block by block.

    A block's tiles are dealt to the worker threads (each with its own float64 accumulator;
    BLAS releases the GIL). The centring is the compiled kernel `center_columns` when the
    kernels are on (`aggregation._kernels`), numpy's mean and subtraction otherwise (the same
    bits); on a GPU (`aggregation._device`) the whole block goes to torch.
    """

    bytes_per_value = 0  # centred in place; the N x N tile product is negligible

    def __init__(self, n: int, values: int = 0) -> None:
        """``values``: N x coordinates of the whole pass (chooses kernels or device; 0: numpy)."""
        self.device = active_device(values) if values else None
        self.kernels = compiled(values) if values and self.device is None else None
        if self.device is not None:  # the device's float64 copy of the block
            self.bytes_per_value = DEVICE_BYTES_PER_VALUE
        self.workers = worker_count()
        self.grams = [np.zeros((n, n), dtype=np.float64) for _ in range(self.workers)]
        self.scratch = [Scratch() for _ in range(self.workers)]

    def takes_rows(self, plan: BlockPlan) -> bool:
        """With the kernels, each tile is gathered and centred straight from the updates.

        Each thread then holds one (N, tile) buffer instead of the (N, b) stack; blocks of at
        least one tile per thread keep those buffers within the stack the plan counted."""
        return (
            self.device is None
            and self.kernels is not None
            and kernel_dtype(plan.dtype)
            and plan.values_per_block >= self.workers * GRAM_TILE
        )

    def proof(self) -> list[np.ndarray]:
        """The Gram matrix: a non-finite value makes its tile's column mean, hence every
        centred value of that column and the diagonal, non-finite."""
        return self.grams

    @property
    def gram(self) -> np.ndarray:
        """The Gram matrix of everything reduced so far (N x N, float64)."""
        return np.sum(self.grams, axis=0)

    def _tiles(self, stack: np.ndarray, slot: int, part: Sequence[slice]) -> None:
        gram = self.grams[slot]
        for sl in part:
            tile = stack[:, sl]
            if self.kernels is not None and kernel_dtype(stack.dtype):
                self.kernels.center_columns(stack, sl.start, sl.stop)
            else:
                tile -= tile.mean(axis=0, dtype=np.float64).astype(tile.dtype)
            gram += tile @ tile.T

    def _gathered(self, rows: np.ndarray, dtype: np.dtype, slot: int, part: Sequence[slice]) -> None:
        gram = self.grams[slot]
        for sl in part:
            # the same tiles as the stacked path, so the same BLAS products, bit for bit
            tile = self.scratch[slot].get("tile", (len(rows), sl.stop - sl.start), dtype)
            self.kernels.gather_centered(rows, sl.start, sl.stop, tile)
            gram += tile @ tile.T

    def __call__(self, block: Block, stack: np.ndarray | Rows, out: np.ndarray | None) -> None:
        if isinstance(stack, Rows):  # read in place: only offered when the kernels run
            parts = list(tiles(block.size, GRAM_TILE))
            threads = max(1, min(self.workers, len(parts)))
            map_threads(
                functools.partial(self._gathered, stack.addresses, stack.views[0].dtype),
                threads, range(threads), round_robin(parts, threads),
            )
            return
        if self.device is not None:
            self.grams[0] += self.device.gram(stack)
            return
        parts = list(tiles(block.size, GRAM_TILE))
        threads = max(1, min(self.workers, len(parts)))
        map_threads(
            functools.partial(self._tiles, stack), threads, range(threads),
            round_robin(parts, threads),
        )


def squared_distances(gram: np.ndarray) -> np.ndarray:
    """Pairwise squared distances from a Gram matrix (clipped at 0, zero diagonal)."""
    diag = np.diag(gram)
    dist = diag[:, None] + diag[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(dist: np.ndarray, f: int) -> np.ndarray:
    """Score of each update: sum of its N - f - 2 smallest distances to the others."""
    n = len(dist)
    closest = max(1, n - f - 2)
    srt = np.sort(dist, axis=1)  # column 0 is the distance to itself (0)
    return srt[:, 1 : closest + 1].sum(axis=1)


class KrumParams(StrategyParams):
    """Parameters of Krum."""

    f: int = Field(
        default=1,
        ge=0,
        description=(
            "Number of hostile sites to tolerate. Each score sums the N - f - 2 nearest "
            "neighbours; at least 2f + 3 usable updates are required (Flower: num_malicious)."
        ),
    )


class MultiKrumParams(KrumParams):
    """Parameters of multi-Krum."""

    m: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Number of lowest-score updates averaged (count-weighted); at most N - f. Default "
            "(unset): N - f. m=1 is Krum (Flower: to_keep / num_nodes_to_select)."
        ),
    )


@register
class Krum(AggregationStrategy):
    """The single update closest to its N - f - 2 nearest neighbours."""

    name = "krum"
    checks_values_in_pass = True  # every value goes through the block passes
    summary = (
        "Krum (Blanchard et al. 2017): picks the one update with the smallest summed squared "
        "distance to its N-f-2 nearest neighbours; tolerates f hostile sites, needs N >= 2f+3. "
        "Same choice as Flower's Krum; Gram-matrix formulation, memory within the budget."
    )
    Params = KrumParams

    def min_updates(self) -> int:
        """2f + 3: each score sums the N - f - 2 nearest others, and the guarantee needs N > 2f + 2."""
        return 2 * int(self.params.f) + 3

    def min_updates_reason(self) -> str:
        """Why: Krum's bound with this f."""
        f = int(self.params.f)
        return (
            f"with f={f}: 2f+3 = {2 * f + 3}, as each score sums the N-f-2 nearest neighbours and "
            f"the guarantee needs N > 2f+2; lower f (--param f=...)"
        )

    def _select(self, n: int) -> int:
        """How many of the ``n`` lowest-scoring updates are averaged."""
        return 1

    def aggregate(
        self, updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET
    ) -> AggregateResult:
        """Score every update via the blockwise Gram matrix; return the selection's (mean)."""
        inputs = inputs_of(self, updates)
        n, f = len(inputs.headers), int(self.params.f)
        gram_reducer = GramReducer(n, n * sum(s.size for s in inputs.specs))
        plan = run_stacked(updates, inputs.specs, gram_reducer, memory_budget=memory_budget)
        gram = gram_reducer.gram
        scores = krum_scores(squared_distances(gram), f)
        chosen = np.sort(np.argsort(scores, kind="stable")[: self._select(n)])
        mean = weighted_mean(
            [updates[int(i)] for i in chosen], inputs.counts[chosen], memory_budget=memory_budget
        )
        weights = np.zeros(n, dtype=np.float64)
        weights[chosen] = inputs.counts[chosen] / inputs.counts[chosen].sum()
        # ||w_k - sum_j a_j w_j||^2 = G_kk - 2 (G a)_k + a^T G a   (sum_j a_j = 1)
        ga = gram @ weights
        l2sq = np.maximum(np.diag(gram) - 2.0 * ga + weights @ ga, 0.0)
        sites = site_reports(
            inputs.headers, weights,
            selected=weights > 0, score=scores, l2_to_aggregate=np.sqrt(l2sq),
        )
        return make_result(
            self, inputs, mean.arrays, sites,
            memory_budget=memory_budget,
            working_bytes=max(plan.working_bytes, mean.working_bytes),
        )


@register
class MultiKrum(Krum):
    """Count-weighted mean of the m updates with the lowest Krum scores."""

    name = "multi-krum"
    summary = (
        "Multi-Krum (El Mhamdi et al. 2018): count-weighted mean of the m lowest Krum scores "
        "(default m = N - f); needs N >= 2f+3. Same numbers as Flower's MultiKrum."
    )
    Params = MultiKrumParams

    def _m(self) -> int | None:
        return None if self.params.m is None else int(self.params.m)

    def min_updates(self) -> int:
        """max(2f + 3, m + f): Krum's bound, and m of the N - f lowest scores must exist."""
        m = self._m()
        return max(super().min_updates(), (m or 0) + int(self.params.f))

    def min_updates_reason(self) -> str:
        """Why: Krum's bound, and m <= N - f when m is set."""
        m, f = self._m(), int(self.params.f)
        if m is None:
            return super().min_updates_reason()
        return (
            f"{super().min_updates_reason()}; and with m={m}: m+f = {m + f}, as it averages m of "
            f"the N-f lowest scores and averaging more would let a hostile update in; lower m"
        )

    def _select(self, n: int) -> int:
        """m, or N - f when unset (n >= min_updates, so m <= N - f)."""
        m = self._m()
        return n - int(self.params.f) if m is None else m

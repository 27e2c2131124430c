"""Krum and multi-Krum (Blanchard et al., 2017; El Mhamdi et al., 2018).

With N updates and at most f hostile ones, each update k gets the score

    score(k) = sum of the squared distances from w_k to its N - f - 2 nearest other updates

Krum returns the update with the lowest score; multi-Krum averages the m lowest-scoring
updates weighted by sample count (as Flower's ``aggregate_krum`` with ``to_keep=m``). Krum's
guarantee needs N >= 2f + 3; fewer updates are refused.

Gram-matrix formulation: all pairwise squared distances follow from the N x N Gram matrix
G = X X^T of the (flattened) updates, ||w_i - w_j||^2 = G_ii + G_jj - 2 G_ij. G is
accumulated block by block (`aggregation._blocks`): each block of N updates is centred on its
coordinate-wise mean (distances do not change, cancellation does) and multiplied by its own
transpose with BLAS, summed in float64. No flattened second copy of the updates and no N^2
loop over full-length vectors, as Flower's reference needs; the extra memory stays within
the budget, and the distance of every update to the aggregate comes from G for free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from aggregation._blocks import (
    DEFAULT_MEMORY_BUDGET,
    Block,
    BlockReader,
    StackReducer,
    empty_like_specs,
    run_stacked,
    tiles,
)
from aggregation.base import (
    AggregateResult,
    AggregationReport,
    AggregationStrategy,
    SiteReport,
    StrategyParams,
)
from aggregation.compat import check_compatible
from aggregation.errors import NotEnoughUpdatesError
from aggregation.registry import register
from protocol.update import UpdateSource

#: Coordinates per Gram tile: short float32 dot products, accumulated in float64 per tile.
GRAM_TILE = 16384


class GramReducer(StackReducer):
    """Accumulates the centred Gram matrix of the N updates, block by block."""

    bytes_per_value = 0  # centred in place; the N x N tile product is negligible

    def __init__(self, n: int) -> None:
        self.gram = np.zeros((n, n), dtype=np.float64)

    def __call__(self, block: Block, stack: np.ndarray, out: np.ndarray | None) -> None:
        for sl in tiles(block.size, GRAM_TILE):
            tile = stack[:, sl]
            tile -= tile.mean(axis=0, dtype=np.float64).astype(tile.dtype)
            self.gram += tile @ tile.T


class WeightedMeanReducer(StackReducer):
    """Count-weighted mean of the stacked updates, accumulated in float64."""

    bytes_per_coordinate = 2 * 8

    def __init__(self, counts: np.ndarray) -> None:
        self.weights = counts.astype(np.float64) / float(counts.sum())

    def __call__(self, block: Block, stack: np.ndarray, out: np.ndarray | None) -> None:
        assert out is not None
        acc = np.zeros(block.size, dtype=np.float64)
        for row, weight in zip(stack, self.weights, strict=True):
            acc += np.multiply(row, weight, dtype=np.float64)
        out[...] = acc


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
    summary = (
        "Krum (Blanchard et al. 2017): picks the one update with the smallest summed squared "
        "distance to its N-f-2 nearest neighbours; tolerates f hostile sites, needs N >= 2f+3. "
        "Same choice as Flower's Krum; Gram-matrix formulation, memory within the budget."
    )
    Params = KrumParams

    def aggregate(self, updates: Sequence[UpdateSource]) -> AggregateResult:
        """Return the Krum choice under the default memory budget."""
        return self.aggregate_bounded(updates, memory_budget=DEFAULT_MEMORY_BUDGET)

    def _select(self, n: int) -> int:
        return 1

    def aggregate_bounded(
        self, updates: Sequence[UpdateSource], *, memory_budget: int
    ) -> AggregateResult:
        """Score every update via the blockwise Gram matrix; return the selection's (mean)."""
        headers = [u.header for u in updates]
        n, f = len(headers), int(self.params.f)
        if n < 2 * f + 3:
            raise NotEnoughUpdatesError(
                f"Strategy {self.name!r} with f={f} needs at least 2f+3 = {2 * f + 3} usable "
                f"updates (each score sums the N-f-2 nearest neighbours, and the guarantee "
                f"needs N > 2f+2). Lower f (--param f=...) or wait for more sites. "
                f"Received: {n} updates"
            )
        check_compatible(headers)
        specs = headers[0].specs
        m = self._select(n)
        gram_reducer = GramReducer(n)
        plan = run_stacked(updates, specs, gram_reducer, memory_budget=memory_budget)
        gram = gram_reducer.gram
        dist = squared_distances(gram)
        scores = krum_scores(dist, f)
        chosen = np.argsort(scores, kind="stable")[:m]
        counts = np.array([h.num_examples for h in headers], dtype=np.int64)
        total = int(counts[chosen].sum())
        weights = np.zeros(n, dtype=np.float64)
        if m == 1:
            weights[chosen[0]] = 1.0
            reader = BlockReader(updates[int(chosen[0])])
            arrays = {s.name: np.array(reader.source.array(s.name), dtype=s.dtype) for s in specs}
            l2sq = dist[:, int(chosen[0])]
        else:
            weights[chosen] = counts[chosen] / total
            arrays = empty_like_specs(specs)
            sub = [updates[int(i)] for i in chosen]
            mean_plan = run_stacked(
                sub, specs, WeightedMeanReducer(counts[chosen]),
                memory_budget=memory_budget, outputs=arrays,
            )
            plan = max(plan, mean_plan, key=lambda p: p.working_bytes)
            # ||w_k - sum_j a_j w_j||^2 = G_kk - 2 (G a)_k + a^T G a   (sum_j a_j = 1)
            ga = gram @ weights
            l2sq = np.maximum(np.diag(gram) - 2.0 * ga + weights @ ga, 0.0)
        sites = [
            SiteReport(
                site=h.label,
                num_examples=h.num_examples,
                weight=float(weights[i]),
                selected=bool(weights[i] > 0),
                score=float(scores[i]),
                l2_to_aggregate=float(np.sqrt(l2sq[i])),
            )
            for i, h in enumerate(headers)
        ]
        report = AggregationReport(
            strategy=self.name,
            params=self.params.model_dump(),
            num_examples=int(counts.sum()),
            sites=sites,
            memory_budget=memory_budget,
            working_bytes=plan.working_bytes,
        )
        return AggregateResult(arrays=arrays, num_examples=int(counts.sum()), report=report)


@register
class MultiKrum(Krum):
    """Count-weighted mean of the m updates with the lowest Krum scores."""

    name = "multi-krum"
    summary = (
        "Multi-Krum (El Mhamdi et al. 2018): count-weighted mean of the m lowest Krum scores "
        "(default m = N - f); needs N >= 2f+3. Same numbers as Flower's MultiKrum."
    )
    Params = MultiKrumParams

    def _select(self, n: int) -> int:
        f = int(self.params.f)
        m = self.params.m if self.params.m is not None else n - f
        if m > n - f:
            raise NotEnoughUpdatesError(
                f"Strategy 'multi-krum' with f={f} selects at most N-f = {n - f} of {n} usable "
                f"updates, but m={m}: averaging more would let a hostile update in. Lower m or "
                f"leave it unset (N-f). Received: m={m}, {n} updates"
            )
        return int(m)

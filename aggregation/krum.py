"""Krum and multi-Krum (Blanchard et al., 2017; El Mhamdi et al., 2018).

With N updates and at most f hostile ones, each update k gets the score

    score(k) = sum of the squared distances from w_k to its N - f - 2 nearest other updates

Krum returns the update with the lowest score; multi-Krum averages the m lowest-scoring
updates weighted by sample count (as Flower's ``aggregate_krum`` with ``to_keep=m``). Krum's
guarantee needs N >= 2f + 3, and multi-Krum's m at most N - f: `min_updates` is
max(2f + 3, m + f), and fewer updates are refused.

Gram-matrix formulation: all pairwise squared distances follow from the N x N Gram matrix
G = X X^T of the (flattened) updates, ||w_i - w_j||^2 = G_ii + G_jj - 2 G_ij. G is the
backend's ``gram`` operation (`aggregation.backend`): accumulated block by block, each block
of N updates centred on its coordinate-wise mean (distances do not change, cancellation does)
and multiplied by its own transpose, summed in float64. No flattened second copy of the
updates and no N^2 loop over full-length vectors, as Flower's reference needs; the extra
memory stays within the budget, and the distance of every update to the aggregate comes from
G for free. The selection's count-weighted mean is one streamed ``backend.weighted_sum`` pass
(for Krum's single choice the weight is exactly 1, so the update is returned bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from fedsplit.aggregation import backend
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy, StrategyParams
from fedsplit.aggregation.building_blocks import inputs_of, make_result, site_reports
from fedsplit.aggregation.registry import register
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.update import UpdateSource
from pydantic import Field


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
        self, updates: Sequence[UpdateSource], *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
        settings: BackendSettings = DEFAULT_SETTINGS,
    ) -> AggregateResult:
        """Score every update via the blockwise Gram matrix; return the selection's (mean)."""
        inputs = inputs_of(self, updates)
        n, f = len(inputs.headers), int(self.params.f)
        pairs = backend.gram(updates, settings=settings, memory_budget=memory_budget)
        gram = pairs.gram
        scores = krum_scores(squared_distances(gram), f)
        chosen = np.sort(np.argsort(scores, kind="stable")[: self._select(n)])
        mean = backend.weighted_sum(
            [updates[int(i)] for i in chosen], inputs.counts[chosen], settings=settings,
            memory_budget=memory_budget,
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
            working_bytes=max(pairs.working_bytes, mean.working_bytes),
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

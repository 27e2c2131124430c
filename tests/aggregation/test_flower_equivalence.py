"""Our median, trimmed mean, Krum and multi-Krum give Flower's reference numbers.

Reference: ``flwr.server.strategy.aggregate`` (aggregate_median, aggregate_trimmed_avg,
aggregate_krum). Many random cases: odd and even N, tied values, float16/32/64.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.server.strategy.aggregate import (
    aggregate_krum,
    aggregate_median,
    aggregate_trimmed_avg,
)

from fedsplit import aggregation

DTYPES = [np.float16, np.float32, np.float64]
CASES = range(60)


def _case(h, seed: int, n_min: int = 1, n_max: int = 12):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(n_min, n_max + 1))
    dtype = DTYPES[seed % 3]
    ties = seed % 2 == 0
    ws = h.random_weights(rng, n, dtype, ties=ties)
    counts = [int(c) for c in rng.integers(1, 40, size=n)]
    return rng, n, dtype, ws, counts


def _tolerance(dtype: type) -> dict[str, float]:
    # Flower sums the kept values in float32 (float16/32 inputs) in partition order; we sum in
    # float64. Both round to the input precision: allow two units in the last place.
    eps = float(np.finfo(dtype).eps)
    return {"rtol": 2 * eps, "atol": 2 * eps * 4}


@pytest.mark.parametrize("seed", CASES)
def test_median_equals_flower_bit_for_bit(h, seed: int) -> None:
    """Coordinate-wise median: identical values and dtype (odd/even N, ties, float16)."""
    _, _, _, ws, counts = _case(h, seed)
    ours = aggregation.get_strategy("median").aggregate(h.as_updates(ws, counts)).arrays
    ref = aggregate_median(list(zip(ws, counts, strict=True)))
    for i, expected in enumerate(ref):
        got = ours[f"p{i}"]
        assert got.dtype == np.asarray(expected).dtype
        np.testing.assert_array_equal(got, expected)


def test_median_covers_even_and_odd_n(h) -> None:
    """The random cases above include both parities and every dtype."""
    seen = {(_case(h, s)[1] % 2, _case(h, s)[2]) for s in CASES}
    assert {(0, d) for d in DTYPES} | {(1, d) for d in DTYPES} <= seen


@pytest.mark.parametrize("seed", CASES)
def test_trimmed_mean_equals_flower(h, seed: int) -> None:
    """Trimmed mean with random beta in [0, 0.5): same values within 2 ulp, same dtype."""
    rng, _, dtype, ws, counts = _case(h, seed)
    beta = float(rng.choice([0.0, 0.1, 0.2, 0.25, 0.3, 0.45, float(rng.uniform(0, 0.499))]))
    strat = aggregation.get_strategy("trimmed-mean", {"beta": beta})
    ours = strat.aggregate(h.as_updates(ws, counts)).arrays
    ref = aggregate_trimmed_avg(list(zip(ws, counts, strict=True)), beta)
    for i, expected in enumerate(ref):
        got = ours[f"p{i}"]
        assert got.dtype == np.asarray(expected).dtype
        np.testing.assert_allclose(
            got.astype(np.float64), np.asarray(expected, dtype=np.float64), **_tolerance(dtype)
        )


@pytest.mark.parametrize("seed", CASES)
def test_krum_selects_what_flower_selects(h, seed: int) -> None:
    """Krum returns exactly the update Flower's aggregate_krum returns."""
    rng = np.random.default_rng(1000 + seed)
    f = int(rng.integers(0, 3))
    n = int(rng.integers(2 * f + 3, 2 * f + 9))
    dtype = DTYPES[seed % 3]
    ws = h.random_weights(rng, n, dtype)
    counts = [int(c) for c in rng.integers(1, 40, size=n)]
    ours = aggregation.get_strategy("krum", {"f": f}).aggregate(h.as_updates(ws, counts))
    ref = aggregate_krum(list(zip(ws, counts, strict=True)), f, 0)
    for i, expected in enumerate(ref):
        np.testing.assert_array_equal(ours.arrays[f"p{i}"], expected)
    chosen = [s for s in ours.report.sites if s.selected]
    assert len(chosen) == 1 and chosen[0].l2_to_aggregate == 0.0


@pytest.mark.parametrize("seed", CASES)
def test_multi_krum_equals_flower(h, seed: int) -> None:
    """Multi-Krum: count-weighted mean of the m best, as aggregate_krum(to_keep=m)."""
    rng = np.random.default_rng(2000 + seed)
    f = int(rng.integers(0, 3))
    n = int(rng.integers(2 * f + 3, 2 * f + 9))
    m = int(rng.integers(2, n - f + 1))
    dtype = DTYPES[seed % 3]
    ws = h.random_weights(rng, n, dtype)
    counts = [int(c) for c in rng.integers(1, 5 if dtype == np.float16 else 40, size=n)]
    strat = aggregation.get_strategy("multi-krum", {"f": f, "m": m})
    ours = strat.aggregate(h.as_updates(ws, counts))
    ref = aggregate_krum(list(zip(ws, counts, strict=True)), f, m)
    for i, expected in enumerate(ref):
        got = ours.arrays[f"p{i}"]
        # Flower accumulates count * w in the input precision (float16 too); we use float64.
        tol = 4 * float(np.finfo(dtype).eps) * 8
        np.testing.assert_allclose(
            got.astype(np.float64), np.asarray(expected, dtype=np.float64), rtol=tol, atol=tol
        )
    assert sum(s.selected for s in ours.report.sites) == m

"""geometric-median: smoothed Weiszfeld (RFA) against a direct numpy reference, and robustness."""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol import Update, open_weights, write_weights

from fedsplit import aggregation


def flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """All parameters as one float64 vector."""
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays.values()])


def weiszfeld(points: np.ndarray, counts: np.ndarray, max_iter: int, eps: float, nu: float):
    """The documented rule on stacked float64 vectors: z, final shares, distances, iterations."""
    counts = counts.astype(np.float64)
    share = counts / counts.sum()
    z = share @ points
    dist = np.linalg.norm(points - z, axis=1)
    objective = [counts @ dist]
    for _ in range(max_iter):
        if objective[-1] == 0:
            break
        alpha = counts / np.maximum(nu, dist)
        share = alpha / alpha.sum()
        z = share @ points
        dist = np.linalg.norm(points - z, axis=1)
        objective.append(counts @ dist)
        if objective[-2] - objective[-1] <= eps * objective[-2]:
            break
    return z, share, dist, len(objective) - 1


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_direct_numpy_weiszfeld(h, seed, dtype) -> None:
    """Aggregate, weight shares, distances and iteration count equal the stacked reference."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    updates = h.make_updates(n, dtype=dtype, seed=seed)
    # eps well above the rounding noise of the objective (float32: ~1e-7), so both stop alike
    eps = [1e-9, 1e-6, 1e-3] if dtype == np.float64 else [1e-4, 1e-3]
    params = {"max_iter": int(rng.integers(1, 30)), "eps": float(rng.choice(eps)),
              "nu": float(rng.choice([1e-6, 1e-2]))}
    got = aggregation.get_strategy("geometric-median", params).aggregate(updates)
    points = np.stack([flat(u.arrays) for u in updates])
    counts = np.array([u.num_examples for u in updates])
    z, share, dist, iterations = weiszfeld(points, counts, **params)
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == np.float64 else {"rtol": 2e-5, "atol": 2e-6}
    assert got.report.details["iterations"] == iterations
    np.testing.assert_allclose(flat(got.arrays), z, **tol)
    np.testing.assert_allclose([s.weight for s in got.report.sites], share, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose([s.l2_to_aggregate for s in got.report.sites], dist, **tol)
    assert all(got.arrays[k].dtype == dtype for k in got.arrays)
    assert got.num_examples == int(counts.sum())


def test_minority_of_huge_outliers_barely_moves_it(h) -> None:
    """3 of 10 equal-count sites send 1e4-sized values: FedAvg follows them, the median does not."""
    rng = np.random.default_rng(3)
    centre = rng.standard_normal(500)
    updates = [
        Update({"w": (centre + 0.1 * rng.standard_normal(500)).astype(np.float32)},
               num_examples=50, site=f"h{k}")
        for k in range(7)
    ] + [
        Update({"w": np.full(500, 1e4 * (k + 1), np.float32)}, num_examples=50, site=f"bad{k}")
        for k in range(3)
    ]
    honest = np.mean([u.arrays["w"] for u in updates[:7]], axis=0, dtype=np.float64)
    spread = max(np.linalg.norm(u.arrays["w"] - honest) for u in updates[:7])
    avg = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), updates)
    moved = np.linalg.norm(avg.arrays["w"] - honest)
    assert moved > 10_000 * spread
    # 10 iterations: each one shrinks the pull by about 3/7 (hostile/honest share), not enough
    ten = aggregation.aggregate_updates(
        aggregation.get_strategy("geometric-median", {"max_iter": 10}), updates)
    assert 10 * spread < np.linalg.norm(ten.arrays["w"] - honest) < 1e-3 * moved
    assert ten.report.details["stopped"] == "max_iter"
    # defaults (at most 50): stopped by eps within the honest sites' spread
    geo = aggregation.aggregate_updates(aggregation.get_strategy("geometric-median"), updates)
    assert np.linalg.norm(geo.arrays["w"] - honest) < spread
    assert geo.report.details["stopped"] == "converged"
    # to convergence: about 0.47 x the honest radius, where 7 unit pulls balance 3
    tight = aggregation.get_strategy("geometric-median", {"max_iter": 100, "eps": 1e-9})
    assert np.linalg.norm(tight.aggregate(updates).arrays["w"] - honest) < 0.6 * spread
    weights = [s.weight for s in geo.report.sites]
    assert max(weights[7:]) < 1e-3 < min(weights[:7])
    assert sum(weights) == pytest.approx(1.0)
    far = sorted(geo.report.sites, key=lambda s: s.l2_to_aggregate)[-3:]
    assert {s.site for s in far} == {"bad0", "bad1", "bad2"}


def _collinear(ts: list[float], counts: list[int]) -> tuple[list[Update], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    direction = rng.standard_normal(40)
    direction /= np.linalg.norm(direction)
    origin = rng.standard_normal(40)
    updates = [Update({"w": origin + t * direction}, num_examples=c, site=f"s{k}")
               for k, (t, c) in enumerate(zip(ts, counts, strict=True))]
    return updates, origin, direction


@pytest.mark.parametrize(
    "ts,counts,expected",
    [
        ([0.0, 1.0, 5.0], [10, 10, 10], 1.0),  # odd, equal counts: the middle point
        ([0.0, 1.0, 1.5, 10.0, 11.0], [7, 7, 7, 7, 7], 1.5),
        ([5.0, 0.0, 1.0], [30, 10, 10], 5.0),  # one site with over half the count: its point
    ],
)
def test_collinear_points_give_the_weighted_median_point(ts, counts, expected) -> None:
    """On a line the geometric median is the (count-weighted) median point, off-line drift 0."""
    updates, origin, direction = _collinear(ts, counts)
    got = aggregation.get_strategy("geometric-median", {"max_iter": 50, "eps": 0.0}).aggregate(
        updates)
    offset = got.arrays["w"] - origin
    t = float(offset @ direction)
    assert t == pytest.approx(expected, abs=1e-6)
    assert np.linalg.norm(offset - t * direction) < 1e-9
    mean_t = float(np.average(ts, weights=counts))
    assert abs(mean_t - expected) > 0.5  # the mean is elsewhere: the test has teeth


def test_collinear_even_equal_counts_stay_in_the_middle_segment() -> None:
    """Four equal-count points on a line: every point between the middle two is a minimiser."""
    updates, origin, direction = _collinear([0.0, 1.0, 2.0, 3.0], [5, 5, 5, 5])
    got = aggregation.get_strategy("geometric-median", {"eps": 0.0}).aggregate(updates)
    t = float((got.arrays["w"] - origin) @ direction)
    assert 1.0 <= t <= 2.0
    assert got.report.details["objective"][-1] == pytest.approx(4 * 5.0, rel=1e-12)
    assert got.report.details["stopped"] == "converged"


def test_identical_updates_stop_at_once() -> None:
    """All sites send the same model: no iteration, the model itself, count shares."""
    w = np.linspace(-1, 1, 30, dtype=np.float32).reshape(5, 6)
    updates = [Update({"w": w.copy()}, num_examples=c, site=f"s{c}") for c in (1, 3)]
    got = aggregation.get_strategy("geometric-median").aggregate(updates)
    np.testing.assert_array_equal(got.arrays["w"], w)
    assert got.report.details == {"iterations": 0, "objective": [0.0], "stopped": "exact"}
    assert [s.weight for s in got.report.sites] == [0.25, 0.75]


def test_stops_at_max_iter_or_when_improvement_is_below_eps(h) -> None:
    """max_iter caps the iterations; a loose eps stops earlier and says so."""
    updates = h.make_updates(9, dtype=np.float64, seed=5)
    capped = aggregation.get_strategy("geometric-median", {"max_iter": 2, "eps": 0.0})
    report = capped.aggregate(updates).report
    assert report.details["iterations"] == 2 and report.details["stopped"] == "max_iter"
    objective = report.details["objective"]
    assert objective[0] > objective[1] > objective[2]  # Weiszfeld lowers the objective
    loose = aggregation.get_strategy("geometric-median", {"max_iter": 100, "eps": 0.05})
    details = loose.aggregate(updates).report.details
    assert details["stopped"] == "converged" and 1 <= details["iterations"] < 100
    last = details["objective"]
    assert last[-2] - last[-1] <= 0.05 * last[-2]
    assert all(a - b > 0.05 * a for a, b in itertools.pairwise(last[:-1]))


def test_parameters_are_validated() -> None:
    """nu must be > 0, eps finite and >= 0, max_iter in 1..1000; errors name the parameter."""
    for bad in ({"nu": "0"}, {"eps": "nan"}, {"eps": "-1"}, {"max_iter": "0"}, {"tol": "1"}):
        with pytest.raises(aggregation.StrategyParamsError, match=next(iter(bad))):
            aggregation.get_strategy("geometric-median", bad)
    strat = aggregation.get_strategy("geometric-median", {"max_iter": "3", "nu": "1e-3"})
    assert strat.params.max_iter == 3 and strat.params.nu == 1e-3
    assert strat.min_updates() == 1


def test_weight_files_stream_within_the_budget(h, tmp_path: Path) -> None:
    """From weight files under a 64 KiB budget: no stacking, peak memory ~ output + budget.

    Stacking the 6 updates would take 6 x 1.6 MB; the measured peak (numpy buffers, traced)
    stays under the 1.6 MB output plus the budget plus a small allowance.
    """
    updates = h.make_updates(6, shapes=[(400, 500), (200_000,)], seed=8)
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    budget = 64 * 1024
    strat = aggregation.get_strategy("geometric-median", {"max_iter": 3})
    try:
        in_memory = strat.aggregate(updates, memory_budget=budget)
        strat.aggregate(files, memory_budget=budget)  # warm-up: thread pool, HDF5 ids
        tracemalloc.start()
        got = strat.aggregate(files, memory_budget=budget)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        for f in files:
            f.close()
    output = sum(a.nbytes for a in got.arrays.values())
    assert got.report.working_bytes <= budget
    assert peak < output + budget + 256 * 1024, (peak, output)
    for key, arr in in_memory.arrays.items():
        np.testing.assert_array_equal(got.arrays[key], arr)
    assert got.report.details == in_memory.report.details

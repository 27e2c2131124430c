"""Count-weighted variants against brute-force definitions; Krum's Gram distances and errors."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.aggregation._reference import weighted_median, weighted_trimmed_mean
from fedsplit.aggregation.errors import NotEnoughUpdatesError
from fedsplit.aggregation.krum import squared_distances
from fedsplit.aggregation.settings import DEFAULT_SETTINGS

from fedsplit import aggregation


def _brute_weighted_median(values: np.ndarray, counts: np.ndarray) -> float:
    """The median of the sample where each value is repeated as many times as its count."""
    return float(np.median(np.repeat(values.astype(np.float64), counts)))


def _brute_weighted_trim(values: np.ndarray, counts: np.ndarray, beta: float) -> float:
    """Expand by counts, drop beta*W values at each end (an integer here), average the rest."""
    expanded = np.sort(np.repeat(values.astype(np.float64), counts))
    cut = round(beta * len(expanded))
    return float(expanded[cut : len(expanded) - cut].mean())


@pytest.mark.parametrize("seed", range(25))
def test_weighted_median_equals_median_of_count_expanded_sample(h, seed) -> None:
    """Weighted median == the median of each value repeated count times (ties, even totals)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    ws = h.random_weights(rng, n, np.float64, ties=seed % 2 == 0, shapes=[(4, 3)])
    counts = rng.integers(1, 6, size=n)
    got = aggregation.get_strategy("median", {"weighted": True}).aggregate(
        h.as_updates(ws, counts.tolist())).arrays["p0"]
    stack = np.stack([w[0] for w in ws]).reshape(n, -1)
    for j in range(stack.shape[1]):
        assert got.reshape(-1)[j] == pytest.approx(_brute_weighted_median(stack[:, j], counts))
        assert got.reshape(-1)[j] == pytest.approx(weighted_median(stack[:, j], counts))


@pytest.mark.parametrize("seed", range(25))
def test_weighted_trimmed_mean_equals_trimmed_count_expanded_sample(h, seed) -> None:
    """Weighted trimmed mean == trimmed mean of the count-expanded sample (beta*W integer)."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 9))
    ws = h.random_weights(rng, n, np.float64, ties=seed % 2 == 0, shapes=[(3, 3)])
    counts = rng.integers(1, 6, size=n)
    total = int(counts.sum())
    cut = int(rng.integers(0, (total - 1) // 2 + 1))
    beta = cut / total
    got = aggregation.get_strategy("trimmed-mean", {"beta": beta, "weighted": True}).aggregate(
        h.as_updates(ws, counts.tolist())).arrays["p0"]
    stack = np.stack([w[0] for w in ws]).reshape(n, -1)
    for j in range(stack.shape[1]):
        assert got.reshape(-1)[j] == pytest.approx(_brute_weighted_trim(stack[:, j], counts, beta))


def test_weighted_trimmed_mean_cuts_an_update_part_way() -> None:
    """beta*W not on an update boundary: the boundary update keeps only part of its weight."""
    values, counts = np.array([0.0, 10.0, 20.0]), np.array([3, 3, 4])
    # W=10, beta=0.25: drop mass [0,2.5) and (7.5,10]: keep 0.5 of 0.0, 3 of 10, 1.5 of 20
    assert weighted_trimmed_mean(values, counts, 0.25) == pytest.approx((30 + 30) / 5)


def test_equal_counts_reduce_to_the_unweighted_rules(h) -> None:
    """Equal counts: weighted median == median; weighted trim == trim when beta*N is whole."""
    updates = h.make_updates(8, seed=12)
    for u in updates:
        u.num_examples = 7
    for name, params in [("median", {}), ("trimmed-mean", {"beta": 0.25})]:
        plain = aggregation.get_strategy(name, params).aggregate(updates).arrays
        weighted = aggregation.get_strategy(name, {**params, "weighted": True}).aggregate(
            updates).arrays
        for key, arr in plain.items():
            np.testing.assert_allclose(weighted[key], arr, rtol=1e-6, atol=1e-6)


def test_weighted_trim_with_beta_zero_is_fedavg(h) -> None:
    """beta=0 keeps all mass: the count-weighted mean."""
    updates = h.make_updates(5, seed=13)
    got = aggregation.get_strategy("trimmed-mean", {"beta": 0.0, "weighted": True}).aggregate(
        updates).arrays
    ref = aggregation.get_strategy("fedavg").aggregate(updates).arrays
    for key, arr in ref.items():
        np.testing.assert_allclose(got[key], arr, rtol=1e-6, atol=1e-6)


def test_big_count_cannot_move_weighted_median_past_others_below_half(h) -> None:
    """A site with 40% of the rows and an outrageous value does not set the weighted median."""
    updates = h.make_updates(4, seed=14)
    updates[0].arrays = {k: np.full_like(v, 1e6) for k, v in updates[0].arrays.items()}
    counts = [40, 20, 20, 20]
    for u, n in zip(updates, counts, strict=True):
        u.num_examples = n
    got = aggregation.get_strategy("median", {"weighted": True}).aggregate(updates)
    assert np.abs(got.arrays["p0"]).max() < 100
    assert got.report.sites[0].trimmed_fraction == 1.0 and got.report.sites[0].trimmed_most


def test_gram_distances_equal_pairwise_brute_force(h) -> None:
    """Squared distances from the blockwise, centred Gram matrix equal direct computation."""
    from fedsplit.aggregation import backend

    updates = h.make_updates(6, dtype=np.float64, seed=15)
    for u in updates:  # a large common offset: centring keeps the small differences exact
        u.arrays = {k: v + 1000.0 for k, v in u.arrays.items()}
    pairs = backend.gram(updates, settings=DEFAULT_SETTINGS, memory_budget=6 * 8 * 5 + 4096)
    assert pairs.working_bytes <= 6 * 8 * 5 + 4096
    flat = np.stack([np.concatenate([a.reshape(-1) for a in u.arrays.values()]) for u in updates])
    brute = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(squared_distances(pairs.gram), brute, rtol=1e-9, atol=1e-9)


def test_krum_and_median_flag_the_outlier(h) -> None:
    """One update scaled x100: Krum does not select it; median reports it trimmed most."""
    updates = h.make_updates(5, seed=16)
    updates[3].arrays = {k: v * 100 for k, v in updates[3].arrays.items()}
    krum = aggregation.aggregate_updates(aggregation.get_strategy("krum", {"f": 1}), updates)
    assert krum.report.sites[3].selected is False
    assert krum.report.sites[3].score == max(s.score for s in krum.report.sites)
    med = aggregation.aggregate_updates(aggregation.get_strategy("median"), updates)
    assert [s.trimmed_most for s in med.report.sites] == [False, False, False, True, False]
    far = max(med.report.sites, key=lambda s: s.l2_to_aggregate)
    assert far.site == "s3"


@pytest.mark.parametrize("f,n", [(1, 4), (2, 6), (0, 2)])
def test_krum_refuses_too_few_updates_for_f(h, f, n) -> None:
    """N < 2f+3: a clear error naming the bound and how to fix it."""
    updates = h.make_updates(n)
    with pytest.raises(NotEnoughUpdatesError, match=rf"2f\+3 = {2 * f + 3}.*Received: {n} updates"):
        aggregation.get_strategy("krum", {"f": f}).aggregate(updates)


def test_multi_krum_refuses_m_above_n_minus_f(h) -> None:
    """m > N - f would let a hostile update into the average: min_updates is m + f."""
    updates = h.make_updates(5)
    strat = aggregation.get_strategy("multi-krum", {"f": 1, "m": 5})
    assert strat.min_updates() == 6
    with pytest.raises(NotEnoughUpdatesError, match=r"m\+f = 6.*lower m.*Received: 5 updates"):
        strat.aggregate(updates)
    assert len(strat.aggregate(h.make_updates(6)).arrays) == len(updates[0].arrays)


@pytest.mark.parametrize(
    "name,params,need",
    [
        ("fedavg", {}, 1),
        ("median", {"weighted": True}, 1),
        ("trimmed-mean", {"beta": 0.45}, 1),
        ("geometric-median", {}, 1),
        ("krum", {"f": 0}, 3),
        ("krum", {"f": 2}, 7),
        ("multi-krum", {"f": 2}, 7),
        ("multi-krum", {"f": 1, "m": 2}, 5),
    ],
)
def test_min_updates_is_what_each_rule_needs(h, name, params, need) -> None:
    """min_updates() updates aggregate; one fewer is refused by aggregate_updates too."""
    strat = aggregation.get_strategy(name, params)
    assert strat.min_updates() == need
    got = aggregation.aggregate_updates(strat, h.make_updates(need, seed=need))
    assert len(got.report.sites) == need
    if need > 1:
        updates = h.make_updates(need, seed=need)
        next(iter(updates[0].arrays.values())).reshape(-1)[0] = np.nan
        with pytest.raises(NotEnoughUpdatesError, match=rf"at least {need}.*s0: values.*NaN"):
            aggregation.aggregate_updates(strat, updates)


def test_strategy_params_are_validated() -> None:
    """beta out of range and negative f are parameter errors listing the accepted keys."""
    with pytest.raises(aggregation.StrategyParamsError, match="beta"):
        aggregation.get_strategy("trimmed-mean", {"beta": "0.5"})
    with pytest.raises(aggregation.StrategyParamsError, match="f"):
        aggregation.get_strategy("krum", {"f": "-1"})
    assert aggregation.get_strategy("median", {"weighted": "true"}).params.weighted is True

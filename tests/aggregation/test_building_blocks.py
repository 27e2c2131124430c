"""The shared building blocks: the backend's streamed weighted sum and distances, report rows,
update counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.backend import squared_distances, weighted_sum
from fedsplit.aggregation.building_blocks import inputs_of, site_reports
from fedsplit.aggregation.errors import AggregationError, NotEnoughUpdatesError
from fedsplit.aggregation.settings import DEFAULT_SETTINGS
from fedsplit.protocol import open_weights, write_weights

from fedsplit import aggregation


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays.values()])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_weighted_mean_and_distances_equal_numpy(h, tmp_path: Path, dtype) -> None:
    """Any non-negative weights (zeros too), from memory and files, under a tiny budget."""
    updates = h.make_updates(20, dtype=dtype, shapes=[(7, 9), (13,), ()], seed=31)
    weights = np.random.default_rng(2).uniform(0, 3, size=20)
    weights[[3, 11]] = 0.0
    points = np.stack([_flat(u.arrays) for u in updates])
    expected = weights / weights.sum() @ points
    tol = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}[dtype]
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    try:
        for source, budget in ((updates, 2**20), (files, 64)):
            mean = weighted_sum(source, weights, settings=DEFAULT_SETTINGS, memory_budget=budget)
            assert mean.working_bytes <= budget
            assert all(a.dtype == dtype for a in mean.arrays.values())
            np.testing.assert_allclose(_flat(mean.arrays), expected, rtol=tol, atol=tol)
            dist = squared_distances(source, mean.arrays, settings=DEFAULT_SETTINGS,
                                     memory_budget=budget)
            assert dist.working_bytes <= budget
            direct = np.linalg.norm(points - _flat(mean.arrays), axis=1)
            np.testing.assert_allclose(dist.values, direct, rtol=1e-5)
    finally:
        for f in files:
            f.close()


def test_weighted_mean_refuses_unusable_weights(h) -> None:
    """Wrong length, negative, NaN or all-zero weights are errors naming what was received."""
    updates = h.make_updates(3)
    for bad in ([1.0, 2.0], [1.0, -1.0, 1.0], [1.0, float("nan"), 1.0], [0.0, 0.0, 0.0]):
        with pytest.raises(AggregationError, match=r"non-negative weight per update.*Received"):
            weighted_sum(updates, bad, settings=DEFAULT_SETTINGS)
    with pytest.raises(NotEnoughUpdatesError, match="Received: 0 updates"):
        weighted_sum([], [], settings=DEFAULT_SETTINGS)
    with pytest.raises(AggregationError, match=r"one coordinate.*Received: 10"):
        weighted_sum(updates, [1, 1, 1], settings=DEFAULT_SETTINGS, memory_budget=10)


def test_inputs_and_report_rows(h) -> None:
    """inputs_of checks min_updates and the layout; site_reports fills one row per update."""
    updates = h.make_updates(4, seed=7)
    krum = aggregation.get_strategy("krum", {"f": 1})
    with pytest.raises(NotEnoughUpdatesError, match=r"at least 5 usable updates.*lower f"):
        inputs_of(krum, updates)
    inputs = inputs_of(aggregation.get_strategy("fedavg"), updates)
    assert inputs.total == sum(u.num_examples for u in updates)
    assert [s.name for s in inputs.specs] == list(updates[0].arrays)
    rows = site_reports(inputs.headers, inputs.counts / inputs.total,
                        score=np.arange(4.0), selected=np.array([True, False, True, False]),
                        flags=[[], ["x"], [], []])
    assert [r.site for r in rows] == ["s0", "s1", "s2", "s3"]
    assert rows[1].flags == ["x"] and rows[2].selected is True and type(rows[3].score) is float
    with pytest.raises(ValueError, match="column 'score'"):
        site_reports(inputs.headers, inputs.counts, score=[1.0])

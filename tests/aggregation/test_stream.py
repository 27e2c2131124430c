"""`aggregation.Fold`: updates folded one at a time give the all-at-once aggregate, for every
registered rule, held in memory or spilled to disk under a tiny budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import Fold, aggregate_updates, get_strategy, strategy_names
from fedsplit.aggregation.errors import AggregationError
from fedsplit.protocol import Update

RULES = [(name, {}) for name in strategy_names()] + [
    ("median", {"weighted": True}), ("trimmed-mean", {"weighted": True, "beta": 0.2})]


def _updates(n: int, seed: int) -> list[Update]:
    rng = np.random.default_rng(seed)
    shapes = [(6, 5), (5,), (3, 2, 4)]
    counts = [int(c) for c in rng.integers(1, 500, size=n)]  # uneven counts
    return [Update({f"layer{i}": (rng.standard_normal(s) * (1 + k % 4)).astype(np.float32)
                    for i, s in enumerate(shapes)}, num_examples=counts[k], site=f"h{k:02d}")
            for k in range(n)]


@pytest.mark.parametrize(("name", "params"), RULES, ids=lambda v: str(v))
@pytest.mark.parametrize("budget", [512 * 1024**2, 1024], ids=["held", "spilled"])
def test_folded_equals_all_at_once(name: str, params: dict, budget: int, tmp_path: Path) -> None:
    strategy = get_strategy(name, params)
    updates = _updates(9, seed=len(name) + budget)
    whole = aggregate_updates(strategy, updates, memory_budget=budget)
    arrival = np.random.default_rng(1).permutation(len(updates))
    with Fold(strategy, memory_budget=budget, spill_dir=tmp_path) as fold:
        for k in arrival:  # in another order than the key order the merge uses
            fold.add(updates[k], key=updates[k].site)
        assert fold.spilled == (len(updates) if budget == 1024 else 0)
        folded = fold.result()
    assert list(folded.arrays) == list(whole.arrays)
    for key, value in whole.arrays.items():
        np.testing.assert_allclose(folded.arrays[key], value, rtol=2e-6, atol=2e-6, err_msg=key)
        assert folded.arrays[key].dtype == value.dtype
    assert folded.num_examples == whole.num_examples
    assert [s.site for s in folded.report.sites] == [s.site for s in whole.report.sites]
    assert [s.excluded for s in folded.report.sites] == [s.excluded for s in whole.report.sites]
    assert list(tmp_path.iterdir()) == []  # the spilled files go with the fold


def test_spills_once_the_held_updates_pass_the_budget(tmp_path: Path) -> None:
    updates = _updates(4, seed=3)
    one = updates[0].header.nbytes
    with Fold(get_strategy("fedavg"), memory_budget=2 * one, spill_dir=tmp_path) as fold:
        fold.add(updates[0])
        fold.add(updates[1])
        assert fold.spilled == 0
        fold.add(updates[2])  # past the budget: everything held goes to disk, then this one
        assert fold.spilled == 3
        assert len(list(next(tmp_path.iterdir()).iterdir())) == 3
        fold.add(updates[3])
        assert fold.spilled == 4
        result = fold.result()
    whole = aggregate_updates(get_strategy("fedavg"), updates)
    for key, value in whole.arrays.items():
        np.testing.assert_allclose(result.arrays[key], value, rtol=2e-6, atol=2e-6)


def test_a_closed_fold_takes_nothing_and_a_bad_budget_is_named() -> None:
    fold = Fold(get_strategy("fedavg"))
    fold.close()
    with pytest.raises(AggregationError, match="closed"):
        fold.add(_updates(1, seed=0)[0])
    with pytest.raises(AggregationError, match="memory budget"):
        Fold(get_strategy("fedavg"), memory_budget=0)


@pytest.mark.parametrize(("expected", "held_first"), [(None, True), (2, True), (3, False), (4, False)])
def test_a_round_that_cannot_hold_all_its_updates_spills_each_as_it_arrives(
        expected: int | None, held_first: bool, tmp_path: Path) -> None:
    """Told the round expects more updates than fit, the fold writes the first one out at
    once instead of holding it until the next arrives; the aggregate is the same."""
    updates = _updates(4, seed=5)
    budget = 2 * updates[0].header.nbytes
    with Fold(get_strategy("median"), memory_budget=budget, spill_dir=tmp_path,
              expected_updates=expected) as fold:
        fold.add(updates[0])
        assert fold.spilled == (0 if held_first else 1)
        for update in updates[1:]:
            fold.add(update)
        assert fold.spilled == 4
        result = fold.result()
    whole = aggregate_updates(get_strategy("median"), updates)
    for key, value in whole.arrays.items():
        np.testing.assert_allclose(result.arrays[key], value, rtol=2e-6, atol=2e-6)
    with pytest.raises(AggregationError, match=r"expected_updates is at least 1.*Received: 0"):
        Fold(get_strategy("fedavg"), expected_updates=0)

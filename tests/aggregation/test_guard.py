"""The input guard: failing updates are excluded with a reason, counts capped, all reported."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from fedsplit.aggregation.errors import AggregationError, IncompatibleUpdatesError, NotEnoughUpdatesError
from fedsplit.aggregation.guard import guard_updates
from fedsplit.protocol import Update, open_weights, write_weights

from fedsplit import aggregation
from tests._helpers.weight_files import opened


def _poison(update: Update, name: str, value: float) -> Update:
    """Bypass Update's own check, as a buggy in-process source or a mutated array would."""
    update.arrays[name] = update.arrays[name].copy()
    update.arrays[name].flat[0] = value
    return update


@pytest.mark.parametrize("strategy", ["fedavg", "median", "trimmed-mean", "krum"])
def test_nan_update_is_excluded_and_result_matches_run_without_it(h, strategy) -> None:
    """A NaN in one update: excluded with its reason; the aggregate equals the others' alone."""
    updates = h.make_updates(6, seed=1)
    clean = [u for u in updates if u.site != "s2"]
    _poison(updates[2], "p1", float("nan"))
    strat = aggregation.get_strategy(strategy, {"f": 1} if "krum" in strategy else {})
    got = aggregation.aggregate_updates(strat, updates)
    ref = aggregation.aggregate_updates(strat, clean)
    for key, arr in ref.arrays.items():
        np.testing.assert_array_equal(got.arrays[key], arr)
    bad = got.report.sites[2]
    assert bad.site == "s2" and bad.excluded and bad.weight == 0.0
    assert "'p1'" in bad.reason and "NaN/Inf" in bad.reason
    assert [s.site for s in got.report.excluded] == ["s2"]
    assert got.num_examples == ref.num_examples


def test_inf_in_weight_file_is_excluded(h, tmp_path: Path) -> None:
    """Values in files are checked block by block before aggregation."""
    updates = h.make_updates(3, seed=2)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    with h5py.File(paths[1], "r+") as f:
        f["arrays/p0"][0, 0] = np.inf
    with opened(paths) as files:
        got = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), files)
    assert got.report.sites[1].excluded and "NaN/Inf" in got.report.sites[1].reason
    assert got.num_examples == updates[0].num_examples + updates[2].num_examples


def test_layout_mismatches_are_excluded_against_the_majority(h) -> None:
    """Wrong shape, dtype, missing and extra parameters: each excluded, naming the parameter."""
    updates = h.make_updates(9, seed=5)
    updates[1].arrays["p1"] = np.zeros(6, np.float32)
    updates[2].arrays["p0"] = updates[2].arrays["p0"].astype(np.float64)
    del updates[3].arrays["p2"]
    updates[4].arrays["extra"] = np.zeros(2, np.float32)
    got = aggregation.aggregate_updates(aggregation.get_strategy("median"), updates)
    reasons = [s.reason for s in got.report.sites]
    assert "'p1' has shape (5,)" in reasons[1] and "but (6,) (float32) in this update" in reasons[1]
    assert "'p0' (shape (3, 4)) is float32 in the round's model but float64" in reasons[2]
    assert "'p2'" in reasons[3] and "missing" in reasons[3]
    assert "'extra'" in reasons[4]
    assert [s.excluded for s in got.report.sites] == [False, *[True] * 4, *[False] * 4]


def test_expected_layout_overrides_the_majority(h) -> None:
    """With the round's model given, even a majority with another layout is excluded."""
    updates = h.make_updates(3, seed=6)
    model = {k: v for k, v in updates[0].arrays.items()}
    updates[1].arrays["p1"] = np.zeros(6, np.float32)
    updates[2].arrays["p1"] = np.zeros(6, np.float32)
    got = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), updates,
                                        expected=model)
    assert [s.excluded for s in got.report.sites] == [False, True, True]


def test_two_different_layouts_without_majority_is_an_error(h) -> None:
    """No layout held by more than half: refused, naming the parameter (vertical-fusion hint)."""
    a, b = h.make_updates(2, seed=7)
    b.arrays["p1"] = np.zeros(6, np.float32)
    with pytest.raises(IncompatibleUpdatesError, match=r"'p1'.*vertical fusion"):
        aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), [a, b])


def test_missing_count_in_file_is_excluded(h, tmp_path: Path) -> None:
    """A file without num_examples opened leniently: excluded with a count reason."""
    updates = h.make_updates(3, seed=8)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    with h5py.File(paths[0], "r+") as f:
        del f.attrs["num_examples"]
    files = [open_weights(p, require_num_examples=False) for p in paths]
    try:
        got = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), files)
    finally:
        for f in files:
            f.close()
    assert got.report.sites[0].excluded and got.report.sites[0].reason.startswith("count:")


def test_cohort_cap_clip_lowers_the_weight_and_flags_the_site(h) -> None:
    """clip: the count used is the cap, the claim is kept, the weight follows the cap."""
    updates = h.make_updates(3, seed=9)
    for u, n in zip(updates, [100, 100, 5000], strict=True):
        u.num_examples = n
    got = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), updates,
                                        cohort_caps={"s2": 200})
    s2 = got.report.sites[2]
    assert s2.num_examples == 200 and s2.claimed_examples == 5000 and not s2.excluded
    assert s2.flags == ["count 5000 clipped to cohort cap 200"]
    assert s2.weight == pytest.approx(0.5)
    assert got.num_examples == 400
    expected = sum(n * u.arrays["p0"].astype(np.float64)
                   for n, u in zip([100, 100, 200], updates, strict=True)) / 400
    np.testing.assert_allclose(got.arrays["p0"], expected, rtol=1e-6)


def test_cohort_cap_refuse_excludes_the_update(h) -> None:
    """refuse: the over-cap update is excluded and flagged; counts at or under caps pass."""
    updates = h.make_updates(3, seed=10)
    caps = {"s0": updates[0].num_examples, "s1": updates[1].num_examples - 1}
    got = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), updates,
                                        cohort_caps=caps, cap_policy="refuse")
    assert [s.excluded for s in got.report.sites] == [False, True, False]
    assert "above the registered cohort size" in got.report.sites[1].reason
    assert got.report.sites[1].flags


def test_bad_cap_settings_are_clear_errors(h) -> None:
    """Unknown policy and non-integer caps are refused with the received value."""
    updates = h.make_updates(2)
    with pytest.raises(AggregationError, match=r"cap_policy.*Received: 'drop'"):
        guard_updates(updates, cap_policy="drop")
    with pytest.raises(AggregationError, match=r"Received: s0=0"):
        guard_updates(updates, cohort_caps={"s0": 0})
    with pytest.raises(AggregationError, match=r"Received: s0=12.5"):
        guard_updates(updates, cohort_caps={"s0": 12.5})


def test_all_excluded_is_not_enough_updates(h) -> None:
    """When every update fails, the error lists each site's reason."""
    updates = h.make_updates(2, seed=11)
    for u in updates:
        _poison(u, "p0", float("inf"))
    with pytest.raises(NotEnoughUpdatesError, match=r"s0: values:.*s1: values:"):
        aggregation.aggregate_updates(aggregation.get_strategy("median"), updates)


def test_damaged_chunk_in_weight_file_is_excluded(h, tmp_path: Path) -> None:
    """A file whose compressed chunk is corrupt: excluded as unreadable, the round goes on."""
    updates = h.make_updates(3, shapes=[(64, 64)], seed=30)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5", compress=True) for u in updates]
    with h5py.File(paths[2], "r") as f:
        offset = f["arrays/p0"].id.get_chunk_info(0).byte_offset
    raw = bytearray(paths[2].read_bytes())
    raw[offset : offset + 64] = b"\xff" * 64
    paths[2].write_bytes(bytes(raw))
    with opened(paths) as files:
        got = aggregation.aggregate_updates(aggregation.get_strategy("median"), files)
    assert got.report.sites[2].excluded and "damaged" in got.report.sites[2].reason
    assert not got.report.sites[0].excluded

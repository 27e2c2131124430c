"""FedAvg: exact weighted mean, streaming from files, float64 accuracy, shape errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import IncompatibleUpdatesError, StrategyParamsError, UnknownStrategyError
from fedsplit.protocol import Update, write_weights

from fedsplit import aggregation
from tests._helpers.weight_files import opened


def make_updates(rng: np.random.Generator, counts: list[int], dtype=np.float32) -> list[Update]:
    """Random updates with a conv-like, a vector and a 0-dim parameter."""
    return [
        Update({"conv.weight": rng.normal(size=(4, 1, 3, 3)).astype(dtype),
                "conv.bias": rng.normal(size=4).astype(dtype),
                "temperature": np.array(rng.normal(), dtype=dtype)},
               num_examples=n, site=f"h{i}")
        for i, n in enumerate(counts)
    ]


def test_fedavg_equals_hand_computed_weighted_mean(rng) -> None:
    """sum(n_k w_k) / sum(n_k), to float32 rounding."""
    updates = make_updates(rng, [50, 50, 400])
    result = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), updates)
    for name in updates[0].arrays:
        expected = (50 * updates[0].arrays[name].astype(np.float64)
                    + 50 * updates[1].arrays[name] + 400 * updates[2].arrays[name]) / 500
        np.testing.assert_allclose(result.arrays[name], expected, rtol=0, atol=1e-6)
        assert result.arrays[name].dtype == np.float32
    assert result.num_examples == 500
    assert [s.weight for s in result.report.sites] == [0.1, 0.1, 0.8]


def test_fedavg_streams_from_weight_files(tmp_path: Path, rng) -> None:
    """Aggregating open weight files equals aggregating the in-memory updates."""
    updates = make_updates(rng, [3, 9, 27])
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    strat = aggregation.get_strategy("fedavg")
    with opened(paths) as files:
        from_files = aggregation.aggregate_updates(strat, files)
    in_memory = aggregation.aggregate_updates(strat, updates)
    for name in in_memory.arrays:
        np.testing.assert_array_equal(from_files.arrays[name], in_memory.arrays[name])


def test_fedavg_accumulates_in_float64() -> None:
    """Many float16 updates average without float16 accumulation error."""
    values = np.linspace(0.1, 0.9, 200)
    updates = [Update({"w": np.full(8, v, np.float16)}, num_examples=1) for v in values]
    result = aggregation.get_strategy("fedavg").aggregate(updates)
    exact = np.mean([np.float16(v) for v in values], dtype=np.float64)
    assert result.arrays["w"].dtype == np.float16
    assert abs(float(result.arrays["w"][0]) - exact) <= float(np.finfo(np.float16).eps) * exact


def test_single_update_is_returned_unchanged(rng) -> None:
    """One site: the aggregate is its weights."""
    (update,) = make_updates(rng, [10])
    result = aggregation.get_strategy("fedavg").aggregate([update])
    for name, arr in update.arrays.items():
        np.testing.assert_array_equal(result.arrays[name], arr)


def test_shape_mismatch_names_parameter_shapes_and_vertical_fusion(rng) -> None:
    """Different shapes: an error naming the first differing parameter and both shapes."""
    a, b = make_updates(rng, [1, 1])
    b.arrays["conv.bias"] = np.zeros(5, np.float32)
    with pytest.raises(IncompatibleUpdatesError) as err:
        aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), [a, b])
    message = str(err.value)
    assert "'conv.bias'" in message and "(4,)" in message and "(5,)" in message
    assert "identical names and shapes" in message and "vertical fusion" in message


def test_missing_parameter_and_dtype_mismatch_are_named(rng) -> None:
    """Missing names and differing dtypes are refused too."""
    a, b = make_updates(rng, [1, 1])
    del b.arrays["temperature"]
    with pytest.raises(IncompatibleUpdatesError, match=r"'temperature'.*missing from h1"):
        aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), [a, b])
    a, b = make_updates(rng, [1, 1])
    b.arrays["conv.bias"] = b.arrays["conv.bias"].astype(np.float64)
    with pytest.raises(IncompatibleUpdatesError, match="float32 in h0 but float64 in h1"):
        aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), [a, b])


def test_registry_errors_list_what_is_valid() -> None:
    """Unknown names and parameters get errors that list the valid ones."""
    with pytest.raises(UnknownStrategyError, match=r"Available: .*fedavg"):
        aggregation.get_strategy("fedmagic")
    with pytest.raises(StrategyParamsError, match="Extra inputs"):
        aggregation.get_strategy("fedavg", {"beta": "0.1"})
    with pytest.raises(StrategyParamsError, match="key=value"):
        aggregation.parse_param_pairs(["beta"])


def test_many_updates_sum_in_float64_across_groups(monkeypatch) -> None:
    """1000 equal float32 updates: the mean is within 4 ulp of the value.

    A float32 running sum of 1000 terms of 1e-4 drifts by about 150 ulp; summing groups of
    `GROUP` updates in float32 and the groups in float64 keeps it at float32 rounding (2 ulp).
    """
    from fedsplit.aggregation import _reference

    value = np.float32(0.1)
    updates = [Update({"w": np.full(64, value, np.float32)}, num_examples=1) for _ in range(1000)]
    result = aggregation.get_strategy("fedavg").aggregate(updates)
    ulp = float(np.spacing(value))
    assert abs(float(result.arrays["w"][0]) - float(value)) <= 4 * ulp
    # the same sum with one float32 group (no float64 total) is visibly worse: the test has teeth
    monkeypatch.setattr(_reference, "GROUP", 10_000)
    drifted = aggregation.get_strategy("fedavg").aggregate(updates)
    assert abs(float(drifted.arrays["w"][0]) - float(value)) > 50 * ulp


def test_threads_and_blocks_give_the_same_bits(rng, monkeypatch) -> None:
    """Blocks shared out among threads, from memory and from files: one and the same result."""
    from fedsplit.aggregation import _reference, _threads

    updates = make_updates(rng, [5, 7, 11, 13, 17])
    monkeypatch.setattr(_reference, "BLOCK", 7)  # several blocks per parameter
    monkeypatch.setattr(_threads, "THREADED_FROM", 0)
    one = aggregation.get_strategy("fedavg").aggregate(
        updates, settings=aggregation.BackendSettings(threads=1))
    three = aggregation.get_strategy("fedavg").aggregate(
        updates, settings=aggregation.BackendSettings(threads=3))
    for name, arr in one.arrays.items():
        np.testing.assert_array_equal(three.arrays[name], arr)
        expected = sum(u.num_examples * u.arrays[name].astype(np.float64) for u in updates) / 53
        np.testing.assert_allclose(arr, expected, rtol=0, atol=1e-6)

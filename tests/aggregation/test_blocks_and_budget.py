"""Block planning, the memory budget, and reading blocks straight from weight files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET, plan_blocks, plan_stack
from fedsplit.aggregation.errors import AggregationError
from fedsplit.protocol import open_weights, write_weights
from fedsplit.protocol.arrays import ArraySpec

from fedsplit import aggregation
from tests._helpers.weight_files import opened

ROBUST = [
    ("median", {}),
    ("median", {"weighted": True}),
    ("trimmed-mean", {"beta": 0.25}),
    ("trimmed-mean", {"beta": 0.2, "weighted": True}),
    ("krum", {"f": 1}),
    ("multi-krum", {"f": 1, "m": 3}),
    ("fedavg", {}),
    ("geometric-median", {}),
]
STREAMED = {"fedavg", "geometric-median"}


def test_every_registered_rule_is_run_under_the_budget() -> None:
    """A new strategy must join ROBUST, so the budget and file tests below cover it."""
    assert {name for name, _ in ROBUST} == set(aggregation.strategy_names())


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (4, 3, 5), (2, 1, 6, 3)])
@pytest.mark.parametrize("max_values", [1, 2, 4, 7, 16, 1000])
def test_blocks_tile_each_parameter_exactly_once(shape, max_values) -> None:
    """Blocks are contiguous, in order, cover every coordinate, and their selection matches."""
    spec = ArraySpec("w", shape, np.dtype(np.float32))
    arr = np.arange(spec.size, dtype=np.float32).reshape(shape)
    blocks = plan_blocks([spec], max_values)
    pos = 0
    for b in blocks:
        assert b.start == pos and 0 < b.size <= max(max_values, 1)
        np.testing.assert_array_equal(arr[b.selection].reshape(-1), np.arange(b.start, b.stop))
        assert arr[b.selection].shape == b.sel_shape
        pos = b.stop
    assert pos == spec.size


@pytest.mark.parametrize("name,params", ROBUST)
def test_tiny_budget_equals_default_budget_and_files_equal_memory(
    h, tmp_path: Path, name, params
) -> None:
    """A budget that splits every parameter into many blocks gives the same bits, from files too.

    The geometric median's distances are summed per block, so a budget that changes the block
    length changes their last bits (and the weights): equal within rounding there, and bit for
    bit between files and memory under the same budget.
    """
    updates = h.make_updates(7, shapes=[(6, 9), (4, 3, 5), (11,), ()], seed=3)
    strat = aggregation.get_strategy(name, params)
    # streamed rules (no stack) need 16 bytes a coordinate: 80 bytes cuts blocks of 5
    budget = 80 if name in STREAMED else 7 * 4 * 40 + 4096
    full = aggregation.aggregate_updates(strat, updates)
    tiny = aggregation.aggregate_updates(strat, updates, memory_budget=budget)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    with opened(paths) as files:
        from_files = aggregation.aggregate_updates(strat, files, memory_budget=budget)
    for key, arr in full.arrays.items():
        if name == "geometric-median":
            np.testing.assert_allclose(tiny.arrays[key], arr, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(tiny.arrays[key], arr)
        np.testing.assert_array_equal(from_files.arrays[key], tiny.arrays[key])
    assert tiny.report.working_bytes <= budget
    if name in STREAMED:
        assert budget < full.report.working_bytes
    for a, b in zip(full.report.sites, from_files.report.sites, strict=True):
        assert a.l2_to_aggregate == pytest.approx(b.l2_to_aggregate, rel=1e-5, abs=1e-6)


def test_float16_file_blocks_equal_memory(h, tmp_path: Path) -> None:
    """float16 datasets are widened to float32 while reading blocks; same median as in memory."""
    updates = h.make_updates(6, dtype=np.float16, shapes=[(5, 8), (3,)], seed=4)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    strat = aggregation.get_strategy("median")
    with opened(paths) as files:
        got = aggregation.aggregate_updates(strat, files, memory_budget=6 * 6 * 10 + 2048)
    ref = aggregation.aggregate_updates(strat, updates)
    for key, arr in ref.arrays.items():
        assert got.arrays[key].dtype == np.float16
        np.testing.assert_array_equal(got.arrays[key], arr)


def test_working_memory_stays_under_budget_for_large_n() -> None:
    """The planned stacked pass fits the budget at N=100 x ResNet-18 size."""
    specs = [ArraySpec("w", (11_700_000,), np.dtype(np.float32))]
    for reducer_bytes in (0, 9, 48):
        plan = plan_stack(100, specs, memory_budget=DEFAULT_MEMORY_BUDGET,
                          bytes_per_value=reducer_bytes)
        assert plan.working_bytes <= DEFAULT_MEMORY_BUDGET
        assert plan.values_per_block >= 1000


def test_budget_too_small_is_a_clear_error(h) -> None:
    """A budget below one coordinate of N updates names the minimum and the received value."""
    updates = h.make_updates(5)
    with pytest.raises(AggregationError, match=r"--memory-budget.*Received: 10"):
        aggregation.aggregate_updates(aggregation.get_strategy("median"), updates,
                                      memory_budget=10)
    with pytest.raises(AggregationError, match="positive number of bytes"):
        aggregation.aggregate_updates(aggregation.get_strategy("median"), updates,
                                      memory_budget=0)


def _threaded(threads: str) -> aggregation.BackendSettings:
    """The settings a process whose environment holds ``FEDSPLIT_AGG_THREADS=threads`` builds."""
    return aggregation.BackendSettings.from_environ({"FEDSPLIT_AGG_THREADS": threads})


@pytest.mark.parametrize("name,params", ROBUST[:4])
def test_worker_threads_give_the_same_bits(h, monkeypatch, tmp_path: Path, name, params) -> None:
    """FEDSPLIT_AGG_THREADS=3 splits blocks into parallel tiles: identical result and report.

    With no size threshold the stacks are filled by the threads too, from memory and from
    weight files alike.
    """
    from fedsplit.aggregation import _threads

    monkeypatch.setattr(_threads, "THREADED_FROM", 0)
    updates = h.make_updates(9, shapes=[(40, 300), (7,)], seed=21)
    strat = aggregation.get_strategy(name, params)
    one = aggregation.aggregate_updates(strat, updates, settings=_threaded("1"))
    three = aggregation.aggregate_updates(strat, updates, settings=_threaded("3"))
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    try:
        from_files = aggregation.aggregate_updates(strat, files, memory_budget=2_000_000,
                                                   settings=_threaded("3"))
    finally:
        for f in files:
            f.close()
    for key, arr in one.arrays.items():
        np.testing.assert_array_equal(three.arrays[key], arr)
        np.testing.assert_array_equal(from_files.arrays[key], arr)
    for a, b in zip(one.report.sites, three.report.sites, strict=True):
        assert a.trimmed_fraction == pytest.approx(b.trimmed_fraction, rel=1e-12)
        assert a.l2_to_aggregate == pytest.approx(b.l2_to_aggregate, rel=1e-6)
    with pytest.raises(AggregationError, match="Received: 'many'"):
        _threaded("many")


def test_non_contiguous_in_memory_arrays_read_correctly(h) -> None:
    """A transposed (non-contiguous) parameter gives the same result as its contiguous copy."""
    updates = h.make_updates(5, shapes=[(30, 20)], seed=22)
    copies = [type(u)({"p0": np.ascontiguousarray(u.arrays["p0"].T)}, num_examples=u.num_examples)
              for u in updates]
    views = [type(u)({"p0": u.arrays["p0"].T}, num_examples=u.num_examples) for u in updates]
    assert not views[0].arrays["p0"].flags.c_contiguous
    strat = aggregation.get_strategy("median")
    a = aggregation.aggregate_updates(strat, views, memory_budget=5 * 4 * 100 + 8192)
    b = aggregation.aggregate_updates(strat, copies)
    np.testing.assert_array_equal(a.arrays["p0"], b.arrays["p0"])


@pytest.mark.parametrize("threads", ["1", "3"])
def test_report_distances_equal_direct_computation(h, monkeypatch, threads) -> None:
    """l2_to_aggregate (run.py's pass for FedAvg, in-pass sums, Weiszfeld's) equals numpy's norm.

    With 3 threads and no size threshold, the guard's scans and the distance pass run in the
    pool too, and a NaN update among them is still the one excluded.
    """
    from fedsplit.aggregation import _threads

    settings = _threaded(threads)
    monkeypatch.setattr(_threads, "THREADED_FROM", 0)
    updates = h.make_updates(6, seed=23)
    poisoned = h.make_updates(7, seed=23)
    next(iter(poisoned[6].arrays.values())).reshape(-1)[3] = np.nan
    res = aggregation.aggregate_updates(aggregation.get_strategy("fedavg"), poisoned,
                                        settings=settings)
    assert [s.excluded for s in res.report.sites] == [False] * 6 + [True]
    assert "NaN/Inf" in res.report.sites[6].reason
    for name in ("fedavg", "median", "geometric-median"):
        res = aggregation.aggregate_updates(aggregation.get_strategy(name), updates,
                                            memory_budget=6 * 4 * 50 + 8192, settings=settings)
        agg = np.concatenate([a.reshape(-1) for a in res.arrays.values()]).astype(np.float64)
        for u, site in zip(updates, res.report.sites, strict=True):
            flat = np.concatenate([a.reshape(-1) for a in u.arrays.values()]).astype(np.float64)
            assert site.l2_to_aggregate == pytest.approx(np.linalg.norm(flat - agg), rel=1e-5)


def test_forked_child_gets_its_own_worker_pool(h, monkeypatch) -> None:
    """After the parent used its pool, a forked child still aggregates on threads (no hang)."""
    import multiprocessing

    from fedsplit.aggregation import _threads

    monkeypatch.setattr(_threads, "THREADED_FROM", 0)
    settings = _threaded("2")
    updates = h.make_updates(4, shapes=[(30, 20)], seed=5)
    parent = aggregation.aggregate_updates(aggregation.get_strategy("median"), updates,
                                           settings=settings)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply_async(
            aggregation.aggregate_updates, (aggregation.get_strategy("median"), updates),
            {"settings": settings}).get(timeout=60)
    np.testing.assert_array_equal(child.arrays["p0"], parent.arrays["p0"])

"""Stacked passes that read the updates in place (`aggregation._blocks.Rows`), FedAvg's fused
distances, and weight files mapped from the offsets the structure check found.

With the compiled kernels, the median, trimmed mean and Krum read each block straight from
the updates' own memory (or the weight files' mapped pages) instead of a stacked copy; the
results must be the bits of the stacked kernel path and of the numpy reference (within the
bounds of docs/aggregation.md), and a non-finite value must still be caught and excluded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import _blocks, _filereads
from fedsplit.aggregation._compiled import CompiledBackend
from fedsplit.aggregation._filereads import reads_of
from fedsplit.aggregation._reference import GRAM_TILE
from fedsplit.aggregation.backend import squared_distances
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol import Update, open_weights, write_weights

from fedsplit import aggregation
from tests._helpers.weight_files import opened

pytest.importorskip("numba")

RULES = [
    ("median", {}),
    ("median", {"weighted": True}),
    ("trimmed-mean", {"beta": 0.2}),
    ("trimmed-mean", {"beta": 0.3, "weighted": True}),
    ("krum", {"f": 1}),
    ("multi-krum", {"f": 1}),
]
# one parameter long enough for Krum's in-place tiles (at least one tile per thread)
SHAPES = [(8 * GRAM_TILE + 37,), (3, 5), (), (2, 3, 4)]


def _updates(n: int, dtype=np.float32, seed: int = 0) -> list[Update]:
    rng = np.random.default_rng(seed)
    return [
        Update(
            {f"p{i}": np.asarray(rng.standard_normal(s) * (1 + k % 3), dtype=dtype)
             for i, s in enumerate(SHAPES)},
            num_examples=int(rng.integers(1, 60)),
            site=f"s{k}",
        )
        for k in range(n)
    ]


def _run(kernels: str, name: str, params: dict, updates, *, reads=None, **kw):
    settings = BackendSettings(mode=kernels, **({"reads": reads} if reads is not None else {}))
    return aggregation.aggregate_updates(aggregation.get_strategy(name, params), updates,
                                         settings=settings, **kw)


def _count_rows(monkeypatch) -> list[int]:
    """Count the blocks handed over in place (a list holding one counter)."""
    seen = [0]
    real = _blocks._rows_of

    def counting(*args, **kw):
        rows = real(*args, **kw)
        seen[0] += rows is not None
        return rows

    monkeypatch.setattr(_blocks, "_rows_of", counting)
    return seen


def _stacked_only(monkeypatch) -> None:
    monkeypatch.setattr(CompiledBackend, "takes_rows", lambda self, operation, plan: False)


@pytest.mark.parametrize("name,params", RULES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_in_place_equals_the_stacked_kernels_and_the_reference(monkeypatch, name, params, dtype):
    updates = _updates(9, dtype, seed=len(name) + len(params))
    seen = _count_rows(monkeypatch)
    got = _run("compiled", name, params, updates)
    assert seen[0] > 0  # the in-place path ran
    ref = _run("numpy", name, params, updates)
    _stacked_only(monkeypatch)
    seen[0] = 0
    stacked = _run("compiled", name, params, updates)
    assert seen[0] == 0
    exact = "krum" in name or (name == "median" and not params.get("weighted"))
    for key, want in ref.arrays.items():
        np.testing.assert_array_equal(got.arrays[key], stacked.arrays[key])
        if exact:
            np.testing.assert_array_equal(got.arrays[key], want)
        else:  # the documented bound: 1 ulp (float32), the float64 sum-order bound
            np.testing.assert_allclose(got.arrays[key], want, rtol=1e-6 if dtype == np.float32
                                       else 1e-12, atol=1e-12)
    for a, b, c in zip(got.report.sites, stacked.report.sites, ref.report.sites, strict=True):
        assert a.selected == b.selected == c.selected
        assert a.trimmed_fraction == pytest.approx(b.trimmed_fraction, abs=1e-12) if (
            b.trimmed_fraction is not None) else a.trimmed_fraction is None
        assert a.l2_to_aggregate == pytest.approx(c.l2_to_aggregate, rel=1e-6)


@pytest.mark.parametrize("name,params", RULES)
def test_mapped_files_in_place_equal_hdf5_reads(tmp_path: Path, monkeypatch, name, params):
    """Mapped weight files go in place; FEDSPLIT_MMAP=0 (HDF5 reads into a stack) gives the
    same bits."""
    updates = _updates(7, seed=3)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]

    def from_files(mmap: str):
        with opened(paths) as files:
            return _run("compiled", name, params, files,
                        reads=_filereads.ReadSettings(mmap=mmap != "0"))

    seen = _count_rows(monkeypatch)
    mapped = from_files("1")
    assert seen[0] > 0
    seen[0] = 0
    read = from_files("0")
    assert seen[0] == 0
    memory = _run("compiled", name, params, updates)
    for key in memory.arrays:
        np.testing.assert_array_equal(mapped.arrays[key], read.arrays[key])
        np.testing.assert_array_equal(mapped.arrays[key], memory.arrays[key])


@pytest.mark.parametrize("name,params", RULES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_read_in_place_is_excluded(monkeypatch, name, params, bad):
    """No finite check on in-place reads: the rule's distances (or Gram matrix) prove the
    values finite, and a non-finite one sends the round to the full scan, which excludes it."""
    updates = _updates(9, seed=11)
    updates[4].arrays["p0"][12345] = bad
    seen = _count_rows(monkeypatch)
    got = _run("compiled", name, params, updates)
    assert seen[0] > 0
    ref = _run("numpy", name, params, updates)
    site = got.report.sites[4]
    assert site.excluded and site.reason == ref.report.sites[4].reason
    assert "NaN/Inf" in site.reason
    for key, want in ref.arrays.items():
        np.testing.assert_allclose(got.arrays[key], want, rtol=1e-6)
        assert np.all(np.isfinite(got.arrays[key]))


def test_in_place_krum_keeps_tiles_within_the_stack_it_skips(monkeypatch):
    """Krum goes in place only when blocks hold a tile per thread (its per-thread tiles then
    fit in the stack the plan counted), and its report's working memory stays in the budget."""
    updates = _updates(9, seed=2)
    budget = 9 * 4 * GRAM_TILE  # blocks shorter than one tile per thread
    seen = _count_rows(monkeypatch)
    small = _run("compiled", "krum", {"f": 1}, updates, memory_budget=budget)
    assert seen[0] == 0 and small.report.working_bytes <= budget
    big = _run("compiled", "krum", {"f": 1}, updates)
    assert seen[0] > 0
    assert [s.selected for s in small.report.sites] == [s.selected for s in big.report.sites]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_fedavg_distances_in_the_mean_pass_equal_the_distance_pass(tmp_path: Path, dtype):
    updates = _updates(20, dtype, seed=4)
    strategy = aggregation.get_strategy("fedavg", {})
    fused = strategy.aggregate(updates, distances=True)
    plain = strategy.aggregate(updates)
    assert all(s.l2_to_aggregate is None for s in plain.report.sites)
    separate = squared_distances(updates, plain.arrays, settings=DEFAULT_SETTINGS).values
    got = [s.l2_to_aggregate for s in fused.report.sites]
    np.testing.assert_allclose(got, separate, rtol=1e-12)
    for key in plain.arrays:
        np.testing.assert_array_equal(fused.arrays[key], plain.arrays[key])
    # from weight files (mapped, and read with HDF5 calls), under a budget of short blocks
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    with opened(paths) as files:
        from_files = strategy.aggregate(files, distances=True, memory_budget=4096)
    np.testing.assert_allclose(
        [s.l2_to_aggregate for s in from_files.report.sites], separate, rtol=1e-5
    )


def test_aggregate_updates_fills_fedavg_distances_from_the_fused_pass(monkeypatch):
    import fedsplit.aggregation.run as run

    def refuse(*args, **kw):  # the separate distance pass must not run
        raise AssertionError("squared_distances ran")

    monkeypatch.setattr(run.backend, "squared_distances", refuse)
    updates = _updates(6, seed=9)
    result = aggregation.aggregate_updates(aggregation.get_strategy("fedavg", {}), updates)
    want = squared_distances(updates, result.arrays, settings=DEFAULT_SETTINGS).values
    np.testing.assert_allclose([s.l2_to_aggregate for s in result.report.sites], want, rtol=1e-12)


def test_weight_files_map_from_the_offsets_the_structure_check_found(tmp_path: Path):
    update = _updates(1, seed=5)[0]
    plain = open_weights(write_weights(update, tmp_path / "plain.h5"))
    packed = open_weights(write_weights(update, tmp_path / "packed.h5", compress=True))
    try:
        offsets = plain._offsets
        assert set(offsets) == set(update.arrays)
        assert all(isinstance(o, int) for name, o in offsets.items() if update.arrays[name].size)
        for name, values in update.arrays.items():
            mapped = reads_of(plain).mapped(name)
            if values.size:
                np.testing.assert_array_equal(mapped.reshape(values.shape), values)
        # gzip-compressed (chunked) parameters cannot be mapped: read with HDF5 calls instead
        assert packed._offsets["p0"] is None and reads_of(packed).mapped("p0") is None
        np.testing.assert_array_equal(packed.array("p0"), update.arrays["p0"])
    finally:
        plain.close()
        packed.close()


def test_loading_the_kernels_does_not_import_scipy(tmp_path: Path):
    """numba's one-time probe for scipy's BLAS (0.2-0.4 s) is skipped; the kernels still run."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from fedsplit.aggregation._compiled import numba_kernels, selection_network\n"
        "from fedsplit.aggregation._blocks import stack_addresses\n"
        "k = numba_kernels()\n"
        "x = np.arange(15, dtype=np.float32).reshape(3, 5)\n"
        "lo, hi = selection_network(3, 1, 1)\n"
        "out = np.empty(5, np.float32)\n"
        "k.trim_tile(stack_addresses(x), 0, 5, lo, hi, 1, out, np.zeros(3, np.int64), np.zeros(3))\n"
        "assert (out == x[1]).all(), out\n"
        "print('scipy.linalg' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"

"""The streamed passes' C kernels (`aggregation._ckernels`): their arithmetic against the numpy
reference, weight files read by positional reads, and the build: cached, rebuilt nowhere
stale, and a failed build recorded so the passes fall back to numpy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import _ckernels
from fedsplit.aggregation._compiled import file_block
from fedsplit.aggregation._reference import GROUP
from fedsplit.aggregation.backend import squared_distances, weighted_sum
from fedsplit.aggregation.settings import DEFAULT_SETTINGS
from fedsplit.protocol import WeightFileError, open_weights, write_weights

from fedsplit import aggregation

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernels() -> _ckernels.StreamedKernels:
    built = _ckernels.load()
    if built is None:
        pytest.fail(f"the C kernels should build on the test machine: {_ckernels.failure()}")
    return built


def _reference_sum(rows: list[np.ndarray], share: np.ndarray) -> np.ndarray:
    """numpy's weighted sum as `_reference.BlockSum.sum_block` computes it."""
    dtype = rows[0].dtype
    if dtype == np.float64 or len(rows) <= GROUP:
        out = rows[0] * share[0]
        for k in range(1, len(rows)):
            out = out + rows[k] * share[k]
        return out
    total = None
    for first in range(0, len(rows), GROUP):
        group = rows[first] * share[first]
        for k in range(first + 1, min(first + GROUP, len(rows))):
            group = group + rows[k] * share[k]
        total = group.astype(np.float64) if total is None else total + group
    return total.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 16, 17, 33])
@pytest.mark.parametrize("size", [1, 7, 2048, 2049, 5000])
def test_weighted_sum_is_the_reference_bit_for_bit(kernels, dtype, n, size) -> None:
    """Same bits as numpy: products rounded before the sum, groups of 16, float64 across."""
    rng = np.random.default_rng(n * 10_000 + size)
    # magnitudes spread over 1e-3..1e3, so a fused multiply-add or another order would show
    rows = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 3, size)).astype(dtype)
            for _ in range(n)]
    share = rng.uniform(0.1, 1.0, n)
    share = (share / share.sum()).astype(dtype)
    out = np.full(size, np.nan, dtype=dtype)
    dist2 = np.zeros(n)
    call = kernels.weighted_sum(n, dtype, size, share, dist2, GROUP, reads=False)
    call.src[:] = [kernels.address(r) for r in rows]
    assert call(out) is None
    want = _reference_sum(rows, share)
    np.testing.assert_array_equal(out, want)
    # differences in the input precision, squares summed in float64 (only the order differs)
    exact = [float(np.sum((r - out).astype(np.float64) ** 2)) for r in rows]
    np.testing.assert_allclose(dist2, exact, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squared_distance_sums_squares_in_float64(kernels, dtype) -> None:
    """Differences in the input precision, squares in float64: exact up to the sum's order."""
    rng = np.random.default_rng(3)
    for size in (0, 1, 7, 8, 9, 1000, 4099):
        x = rng.standard_normal(size).astype(dtype)
        ref = rng.standard_normal(size).astype(dtype)
        want = float(np.sum((x - ref).astype(np.float64) ** 2))
        assert kernels.squared_distance(x, ref) == pytest.approx(want, rel=1e-13, abs=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fedavg_over_files_equals_fedavg_in_memory(h, tmp_path: Path, monkeypatch, dtype) -> None:
    """Files read by positional reads into the kernels' rows: the in-memory result, bit for
    bit, under the default and a budget that cuts parameters into blocks; numpy agrees."""
    monkeypatch.delenv("FEDSPLIT_AGG_BACKEND", raising=False)
    updates = h.make_updates(19, dtype=dtype, shapes=[(400, 300), (7,), (), (3, 5, 2)], seed=11)
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    try:
        fedavg = aggregation.get_strategy("fedavg", {})
        mem = aggregation.aggregate_updates(fedavg, updates)
        rows = 19 * file_block(19) * np.dtype(dtype).itemsize  # the C calls' rows
        for budget in (64 * 2**20, rows + 24 * 5000):  # the second cuts (400, 300) in blocks
            got = aggregation.aggregate_updates(fedavg, files, memory_budget=budget)
            assert got.report.working_bytes <= budget
            for key, want in mem.arrays.items():
                np.testing.assert_array_equal(got.arrays[key], want)
            for a, b in zip(mem.report.sites, got.report.sites, strict=True):
                assert b.l2_to_aggregate == pytest.approx(a.l2_to_aggregate, rel=1e-12)
        ref = aggregation.aggregate_updates(fedavg, files,
                                            settings=aggregation.BackendSettings(mode="numpy"))
        for key, want in ref.arrays.items():
            np.testing.assert_array_equal(mem.arrays[key], want)
        for a, b in zip(ref.report.sites, mem.report.sites, strict=True):
            assert b.l2_to_aggregate == pytest.approx(a.l2_to_aggregate, rel=1e-5)
    finally:
        for f in files:
            f.close()


def test_the_call_reads_files_itself_and_names_one_that_shrank(kernels, tmp_path: Path) -> None:
    """Rows read by the call (fd >= 0) and rows at an address mix; a file cut short while
    open fails the call with the update's index, and FedAvg then refuses the file."""
    rng = np.random.default_rng(9)
    values = rng.standard_normal((3, 5000)).astype(np.float32)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"\0" * 64 + values[1].tobytes())
    fd = os.open(raw, os.O_RDONLY)
    try:
        share = np.array([0.2, 0.3, 0.5], np.float32)
        dist2 = np.zeros(3)
        call = kernels.weighted_sum(3, np.float32, 5000, share, dist2, GROUP, reads=True)
        call.src[:] = [kernels.address(values[0]), 64, kernels.address(values[2])]
        call.fd[:] = [-1, fd, -1]
        out = np.empty(5000, np.float32)
        assert call(out) is None
        np.testing.assert_array_equal(out, _reference_sum(list(values), share))
        os.truncate(raw, 64 + 4 * 4000)
        assert call(out) == (1, 0, 4 * 4000)
    finally:
        os.close(fd)


def test_fedavg_refuses_a_weight_file_cut_short_while_open(h, tmp_path: Path) -> None:
    updates = h.make_updates(3, shapes=[(300, 100)], seed=2)
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    try:
        os.truncate(tmp_path / f"{updates[1].site}.h5", os.path.getsize(
            tmp_path / f"{updates[1].site}.h5") - 40_000)
        with pytest.raises(WeightFileError, match="ends early") as err:
            weighted_sum(files, [1, 1, 1], settings=DEFAULT_SETTINGS)
        assert err.value.reason == "corrupt" and updates[1].site in str(err.value)
    finally:
        for f in files:
            f.close()


def test_a_budget_without_room_for_the_rows_uses_numpy(h, tmp_path: Path) -> None:
    """Files need one row per update a coordinate; a budget below that streams in numpy."""
    updates = h.make_updates(20, shapes=[(9, 7)], seed=4)
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    try:
        weights = [u.num_examples for u in updates]
        small = weighted_sum(files, weights, settings=DEFAULT_SETTINGS, memory_budget=64,
                             distances=True)
        full = weighted_sum(files, weights, settings=DEFAULT_SETTINGS, distances=True)
        assert small.working_bytes <= 64 < full.working_bytes
        np.testing.assert_array_equal(small.arrays["p0"], full.arrays["p0"])
        np.testing.assert_allclose(small.distances, full.distances, rtol=1e-5)
        dist = squared_distances(files, full.arrays, settings=DEFAULT_SETTINGS)
        np.testing.assert_allclose(dist.values, full.distances, rtol=1e-12)
    finally:
        for f in files:
            f.close()


def _child(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def test_a_fresh_directory_builds_once_and_later_processes_load_it(tmp_path: Path) -> None:
    env = {**os.environ, "FEDSPLIT_KERNEL_DIR": str(tmp_path / "k")}
    code = (
        "from fedsplit.aggregation import _ckernels as c\n"
        "k = c.load(); import numpy as np\n"
        "x = np.arange(9, dtype=np.float32)\n"
        "print(k.path.name, k.squared_distance(x, x * 0))\n"
    )
    first = _child(env, code)
    assert first.returncode == 0, first.stderr
    name, value = first.stdout.split()
    assert name == _ckernels._filename() and float(value) == float(sum(i * i for i in range(9)))
    built = tmp_path / "k" / name
    stamp = built.stat().st_mtime_ns
    again = _child(env, code)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert [p.name for p in (tmp_path / "k").iterdir()] == [name]  # no build leftovers


def test_a_failed_build_is_recorded_and_auto_falls_back_to_numpy(tmp_path: Path) -> None:
    """No C compiler: the reason is kept, auto runs numpy, compiled fails naming the fix."""
    env = {**os.environ, "FEDSPLIT_KERNEL_DIR": str(tmp_path / "k"), "CC": str(tmp_path / "no-cc")}
    build = subprocess.run([sys.executable, "-m", "fedsplit.aggregation._ckernels"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=180)
    assert build.returncode == 1
    assert "not built" in build.stderr and "install a C compiler" in build.stderr
    assert list((tmp_path / "k").glob("*.failed"))
    code = (
        "import os, numpy as np\n"
        "import fedsplit.aggregation as aggregation\n"
        "from fedsplit.aggregation.settings import BackendSettings\n"
        "from fedsplit.protocol import Update\n"
        "ups = [Update(arrays={'w': np.full(5, float(i), np.float32)}, num_examples=1) "
        "for i in range(3)]\n"
        "assert BackendSettings().select('weighted_sum', 1 << 30).name == 'numpy'\n"
        "r = aggregation.aggregate_updates(aggregation.get_strategy('fedavg', {}), ups)\n"
        "print(r.arrays['w'].tolist())\n"
        "os.environ['FEDSPLIT_AGG_BACKEND'] = 'compiled'\n"
        "try:\n"
        "    BackendSettings.from_environ(os.environ).select('weighted_sum', 10)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    done = _child(env, code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[1.0, 1.0, 1.0, 1.0, 1.0]"
    assert lines[1].startswith("AggregationError") and "install a C compiler" in lines[1]
    assert "Received: FEDSPLIT_AGG_BACKEND=compiled" in lines[1]

"""The finite-value check fused into the rule's pass, and weight files read through mappings."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from fedsplit.aggregation import _filereads
from fedsplit.aggregation import guard as guard_module
from fedsplit.aggregation._blocks import BlockReader, ValueWatch, Watched, plan_blocks
from fedsplit.aggregation._filereads import reads_of
from fedsplit.aggregation.guard import guard_updates
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol import open_weights, write_weights

from fedsplit import aggregation
from tests._helpers.weight_files import opened

RULES = ["fedavg", "median", "trimmed-mean", "krum", "multi-krum", "geometric-median"]


def _params(rule: str) -> dict:
    return {"f": 1} if "krum" in rule else {}


@pytest.fixture
def scans(monkeypatch) -> list[str]:
    """Record every full finite-value scan the guard makes (the wrapped function still runs)."""
    calls: list[str] = []
    real = guard_module._first_non_finite

    def counting(source, specs, budget):
        calls.append(source.header.label)
        return real(source, specs, budget)

    monkeypatch.setattr(guard_module, "_first_non_finite", counting)
    return calls


def _files(h, tmp_path: Path, n: int, seed: int, poison: int | None = None) -> list[Path]:
    updates = h.make_updates(n, shapes=[(40, 30), (7,), (3, 5, 4)], seed=seed)
    paths = [write_weights(u, tmp_path / f"{u.site}.h5") for u in updates]
    if poison is not None:
        with h5py.File(paths[poison], "r+") as f:
            f["arrays/p2"][1, 2, 3] = np.nan
    return paths


@pytest.mark.parametrize("rule", RULES)
def test_finite_inputs_are_read_once_and_give_the_scanned_result(h, tmp_path, scans, rule) -> None:
    """No separate scan when every value is finite; result and report equal the scanned run."""
    paths = _files(h, tmp_path, 7, seed=3)
    strategy = aggregation.get_strategy(rule, _params(rule))
    with opened(paths) as files:
        got = aggregation.aggregate_updates(strategy, files)
        assert scans == []
        scanned = guard_updates(files)  # the old order: scan first, then the rule
        ref = strategy.aggregate(scanned.accepted)
    for name, arr in ref.arrays.items():
        np.testing.assert_array_equal(got.arrays[name], arr)
    assert [s.excluded for s in got.report.sites] == [False] * 7
    if rule != "fedavg":  # FedAvg's distances come from run.py's own pass
        assert [s.l2_to_aggregate for s in got.report.sites] == [
            s.l2_to_aggregate for s in ref.report.sites
        ]


@pytest.mark.parametrize("rule", RULES)
def test_nan_in_a_file_redoes_the_round_with_the_scan(h, tmp_path, scans, rule) -> None:
    """A NaN met in the pass: the round is redone with the scan, the file excluded by name."""
    paths = _files(h, tmp_path, 7, seed=4, poison=3)
    strategy = aggregation.get_strategy(rule, _params(rule))
    files = [open_weights(p, default_site=p.stem) for p in paths]
    try:
        got = aggregation.aggregate_updates(strategy, files)
        assert len(scans) == 7  # the redo scanned every update
        ref = aggregation.aggregate_updates(strategy, [f for k, f in enumerate(files) if k != 3])
    finally:
        for f in files:
            f.close()
    bad = got.report.sites[3]
    assert bad.excluded and bad.reason.startswith("values: parameter 'p2' holds 1 NaN/Inf")
    for name, arr in ref.arrays.items():
        np.testing.assert_array_equal(got.arrays[name], arr)


def test_guard_with_a_watch_defers_the_scan_and_reads_flag_it(h) -> None:
    """With a watch the guard accepts a poisoned update; reading its values flags the watch."""
    updates = h.make_updates(3, seed=6)
    updates[1].arrays["p0"] = updates[1].arrays["p0"].copy()
    updates[1].arrays["p0"].flat[0] = np.inf
    watch = ValueWatch()
    result = guard_updates(updates, watch=watch)
    assert len(result.accepted) == 3 and all(isinstance(u, Watched) for u in result.accepted)
    specs = updates[0].header.specs
    reader = BlockReader(result.accepted[0])
    for block in plan_blocks(specs, 4):
        reader.view(block)
    assert not watch.flagged
    reader = BlockReader(result.accepted[1])
    for block in plan_blocks(specs, 4):
        reader.read(block, np.empty(block.size, dtype=np.float32))
    assert watch.flagged


def test_weighted_mean_output_check_flags_a_nan_even_with_weight_zero(h) -> None:
    """0 * NaN is NaN: a finite weighted sum proves every input finite, whatever the weights."""
    from fedsplit.aggregation.backend import weighted_sum

    updates = h.make_updates(3, seed=7)
    updates[2].arrays["p1"] = updates[2].arrays["p1"].copy()
    updates[2].arrays["p1"].flat[0] = np.nan
    watch = ValueWatch()
    weighted_sum([Watched(u, watch) for u in updates], [1.0, 1.0, 0.0], settings=DEFAULT_SETTINGS)
    assert watch.flagged


# ------------------------------------------------------------------------------ mapped reads


def test_mapped_values_equal_the_stored_ones(h, tmp_path) -> None:
    """Contiguous parameters are mapped; the mapping equals the values, reads still work."""
    (u,) = h.make_updates(1, shapes=[(300, 70), (5,), ()], seed=8)
    path = write_weights(u, tmp_path / "m.h5")
    with open_weights(path) as f:
        for name in f.header.names:
            mapped = reads_of(f).mapped(name)
            assert mapped is not None
            np.testing.assert_array_equal(mapped, u.arrays[name].reshape(-1))
        big = reads_of(f).mapped("p0")
        reads_of(f).unmap("p0", 0, big.size)  # pages dropped from the process, values still there
        np.testing.assert_array_equal(big, u.arrays["p0"].reshape(-1))


def _resident_kb(path: Path) -> int:
    """Resident size (kB) of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


needs_smaps = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc only")


@needs_smaps
def test_done_values_are_dropped_in_runs_and_at_the_end(tmp_path, monkeypatch) -> None:
    """`unmap` drops pages once `UNMAP_RUN_BYTES` are done (not block by block); `drop_done`
    drops the rest; the values read the same afterwards."""
    from fedsplit.protocol import Update

    monkeypatch.setattr(_filereads, "UNMAP_RUN_BYTES", 1024 * 1024)
    monkeypatch.setattr(_filereads, "UNMAP_TOTAL_BYTES", 2**40)
    values = np.random.default_rng(11).standard_normal(1_000_000).astype(np.float32)  # 4 MB
    path = write_weights(Update({"p": values}, num_examples=3), tmp_path / "big.h5").resolve()
    with open_weights(path) as f:
        mapped = reads_of(f).mapped("p")
        assert mapped is not None
        assert float(mapped.sum(dtype=np.float64)) == pytest.approx(float(values.sum(dtype=np.float64)))
        full = _resident_kb(path)
        assert full >= 3900
        reads_of(f).unmap("p", 0, 200_000)  # 0.8 MB done: under the run, nothing dropped yet
        assert _resident_kb(path) >= full - 8
        reads_of(f).unmap("p", 200_000, 300_000)  # 1.2 MB done: dropped in one go
        assert _resident_kb(path) <= full - 1150
        reads_of(f).unmap("p", 300_000, 400_000)  # 0.4 MB more: kept until the run is long enough
        assert _resident_kb(path) >= full - 1200 - 8
        reads_of(f).drop_done()  # the end of a pass drops what is left
        assert _resident_kb(path) <= full - 1550
        np.testing.assert_array_equal(mapped, values)  # mapped again from the page cache


def test_runs_shorten_when_many_files_are_mapped(h, tmp_path, monkeypatch) -> None:
    """The run of done pages a file drops at once is `UNMAP_RUN_BYTES`, shorter when more files
    are mapped than `UNMAP_TOTAL_BYTES` allows runs for, never under `UNMAP_MIN_RUN_BYTES`."""

    monkeypatch.setattr(_filereads, "UNMAP_RUN_BYTES", 4 << 20)
    monkeypatch.setattr(_filereads, "UNMAP_MIN_RUN_BYTES", 1 << 20)
    updates = h.make_updates(4, shapes=[(30, 20)], seed=13)
    files = [open_weights(write_weights(u, tmp_path / f"{u.site}.h5")) for u in updates]
    try:
        before = _filereads._MAPPED[0]
        for f in files:
            assert reads_of(f).mapped("p0") is not None
        assert _filereads._MAPPED[0] == before + 4
        monkeypatch.setattr(_filereads, "UNMAP_TOTAL_BYTES", (before + 4) * (2 << 20))
        assert _filereads._unmap_run() == 2 << 20
        monkeypatch.setattr(_filereads, "UNMAP_TOTAL_BYTES", 1 << 30)
        assert _filereads._unmap_run() == 4 << 20
        monkeypatch.setattr(_filereads, "UNMAP_TOTAL_BYTES", 1)
        assert _filereads._unmap_run() == 1 << 20
    finally:
        for f in files:
            f.close()
    assert _filereads._MAPPED[0] == before


@needs_smaps
def test_a_pass_leaves_no_done_block_resident(h, tmp_path) -> None:
    """After FedAvg's pass over mapped files, none of their blocks stays in the process."""
    from fedsplit.aggregation.backend import weighted_sum

    updates = h.make_updates(3, shapes=[(600, 500)], seed=12)  # 1.2 MB each
    paths = [write_weights(u, tmp_path / f"{u.site}.h5").resolve() for u in updates]
    with opened(paths) as files:
        mean = weighted_sum(files, [1.0, 2.0, 3.0], settings=DEFAULT_SETTINGS)
        weighted = zip([1, 2, 3], updates, strict=True)
        expected = sum(w * u.arrays["p0"].astype(np.float64) for w, u in weighted) / 6
        np.testing.assert_allclose(mean.arrays["p0"], expected, rtol=1e-5, atol=1e-6)
        assert all(_resident_kb(p) <= 64 for p in paths), [_resident_kb(p) for p in paths]


def test_compressed_big_endian_and_userblock_files(tmp_path) -> None:
    """Not mapped when compressed or in the other byte order; a userblock shifts nothing."""
    rng = np.random.default_rng(9)
    values = rng.standard_normal((64, 64)).astype(np.float32)
    cases = {
        "gzip": ({"compression": "gzip"}, {}, False),
        "big_endian": ({"dtype": ">f4"}, {}, False),
        "userblock": ({}, {"userblock_size": 1024}, True),
    }
    for label, (ds_kw, file_kw, mapped) in cases.items():
        path = tmp_path / f"{label}.h5"
        with h5py.File(path, "w", **file_kw) as f:
            f.attrs["format"] = "fedsplit.weights"
            f.attrs["format_version"] = 1
            f.attrs["num_examples"] = 5
            g = f.create_group("arrays")
            g.create_dataset("w", data=values, **ds_kw)
            g.attrs["order"] = ["w"]
        with open_weights(path) as wf:
            got = reads_of(wf).mapped("w")
            assert (got is not None) == mapped, label
            if got is not None:
                np.testing.assert_array_equal(got, values.reshape(-1))
            out = np.empty(values.size, dtype=np.float32)
            BlockReader(wf).read(plan_blocks(wf.header.specs, values.size)[0], out)
            np.testing.assert_array_equal(out, values.reshape(-1))


def test_mapping_off_reads_the_same(h, tmp_path, monkeypatch) -> None:
    """FEDSPLIT_MMAP=0: every read goes through HDF5, with the same aggregate."""
    paths = _files(h, tmp_path, 5, seed=10)
    strategy = aggregation.get_strategy("median")
    results = []
    for flag in ("1", "0"):
        settings = BackendSettings(reads=_filereads.ReadSettings(mmap=flag != "0"))
        with opened(paths) as files:
            results.append(aggregation.aggregate_updates(strategy, files, settings=settings))
            assert (reads_of(files[0]).mapped("p0") is None) == (flag == "0")
    for name, arr in results[0].arrays.items():
        np.testing.assert_array_equal(results[1].arrays[name], arr)


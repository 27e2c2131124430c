"""`FileReads.read_values` (aggregation._filereads): the streamed passes' positional reads of a
weight file, and the read settings built once (`ReadSettings`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import _filereads, backend
from fedsplit.aggregation._filereads import reads_of
from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol import Update, WeightFileError, open_weights, write_weights


def _update(dtype=np.float32) -> Update:
    rng = np.random.default_rng(0)
    return Update(
        arrays={"w": rng.standard_normal((30, 40)).astype(dtype),
                "b": rng.standard_normal(7).astype(dtype),
                "s": np.array(2.5, dtype=dtype)},
        num_examples=3,
    )


def test_blocks_read_are_the_parameter_values(tmp_path: Path) -> None:
    u = _update()
    with open_weights(write_weights(u, tmp_path / "a.h5")) as f:
        flat = u.arrays["w"].reshape(-1)
        for start, size in ((0, 1200), (0, 1), (517, 300), (1199, 1)):
            out = np.full(size, np.nan, np.float32)
            assert reads_of(f).read_values("w", start, out)
            np.testing.assert_array_equal(out, flat[start : start + size])
        out = np.empty(1, np.float32)
        assert reads_of(f).read_values("s", 0, out) and out[0] == 2.5
        assert reads_of(f).read_values("b", 7, np.empty(0, np.float32))  # nothing to read


def test_what_it_cannot_read_as_it_lies_is_left_to_read_into(tmp_path: Path) -> None:
    """False (never wrong values) for another dtype, a range outside the parameter, a
    non-contiguous buffer, a compressed file, FEDSPLIT_MMAP=0 or a closed file."""
    u = _update()
    path = write_weights(u, tmp_path / "a.h5")
    with open_weights(path) as f:
        assert not reads_of(f).read_values("w", 0, np.empty(10, np.float64))
        assert not reads_of(f).read_values("w", 1195, np.empty(10, np.float32))
        assert not reads_of(f).read_values("w", -1, np.empty(10, np.float32))
        assert not reads_of(f).read_values("w", 0, np.empty(20, np.float32)[::2])
        with pytest.raises(WeightFileError, match="no parameter"):
            reads_of(f).read_values("nope", 0, np.empty(1, np.float32))
    with open_weights(write_weights(u, tmp_path / "z.h5", compress=True)) as f:
        assert not reads_of(f).read_values("w", 0, np.empty(10, np.float32))
    with open_weights(path) as f:
        off = reads_of(f, _filereads.ReadSettings(mmap=False))
        assert not off.read_values("w", 0, np.empty(10, np.float32))
    f = open_weights(path)
    reads = reads_of(f)
    assert reads.read_values("b", 0, np.empty(7, np.float32))
    f.close()
    assert not reads.read_values("b", 0, np.empty(7, np.float32))


def test_a_file_renamed_over_is_not_seen_and_a_truncated_one_is_refused(tmp_path: Path) -> None:
    u = _update()
    path = write_weights(u, tmp_path / "a.h5")
    with open_weights(path) as f:
        out = np.empty(5, np.float32)
        assert reads_of(f).read_values("b", 0, out)  # the descriptor is opened on first use
        other = _update()
        other.arrays["b"][:] = 0
        write_weights(other, path)  # atomic: a new file renamed over the name
        assert reads_of(f).read_values("b", 0, out)
        np.testing.assert_array_equal(out, u.arrays["b"][:5])
    with open_weights(path) as f:
        assert reads_of(f).read_values("b", 0, np.empty(1, np.float32))
        os.truncate(path, 4096)  # shrunk in place while open (fedsplit never does this)
        with pytest.raises(WeightFileError, match="ends early") as err:
            reads_of(f).read_values("w", 1100, np.empty(100, np.float32))
        assert err.value.reason == "corrupt"


def test_hdf5_reads_of_a_file_cut_short_while_open_are_refused(tmp_path: Path) -> None:
    """HDF5 itself fills a read past the end with zeros: the size check refuses it instead."""
    path = write_weights(_update(), tmp_path / "a.h5")
    with open_weights(path) as f:
        reads_of(f, _filereads.ReadSettings(mmap=False))  # every read through HDF5 calls
        out = np.empty(7, np.float32)
        f.read_into("b", out)  # whole: fine before
        os.truncate(path, os.path.getsize(path) - 2000)
        with pytest.raises(WeightFileError, match="shrank") as err:
            f.read_into("w", np.empty(1200, np.float32))
        assert err.value.reason == "corrupt"
        with pytest.raises(WeightFileError, match="shrank"):
            f.array("w")


def test_settings_come_from_the_environment_once_and_stay_with_each_file(tmp_path: Path,
                                                                        monkeypatch) -> None:
    """``FEDSPLIT_MMAP=0`` turns reading values where they lie off; the environment is read when
    the backend settings are built (start-up), not during a pass; each pass makes its files'
    engines with the settings passed in, and a file keeps the settings its engine was made with."""
    off = _filereads.ReadSettings(mmap=False)
    assert _filereads.ReadSettings.from_environ({"FEDSPLIT_MMAP": "0"}) == off
    assert _filereads.ReadSettings.from_environ({}) == _filereads.ReadSettings(mmap=True)
    assert BackendSettings.from_environ({"FEDSPLIT_MMAP": "0"}).reads == off
    path = write_weights(_update(), tmp_path / "a.h5")
    monkeypatch.setenv("FEDSPLIT_MMAP", "0")  # read by nothing below
    with open_weights(path) as f:
        assert reads_of(f).read_values("b", 0, np.empty(7, np.float32))  # default: mapping on
        BackendSettings(reads=off).prepare_reads([f])
        assert reads_of(f).settings.mmap  # made before: keeps its settings
    with open_weights(path) as f:
        backend.squared_distances([f], {n: np.zeros(s.shape, s.dtype) for n, s in
                                        ((s.name, s) for s in f.header.specs)},
                                  settings=BackendSettings(reads=off))
        assert not reads_of(f).settings.mmap  # the pass made it with the settings passed in
        assert not reads_of(f).read_values("b", 0, np.empty(7, np.float32))
        assert reads_of(f).mapped("b") is None


def test_the_engine_goes_with_its_file(tmp_path: Path) -> None:
    """Closing the file closes its engine (descriptor, mapping) and forgets it."""
    path = write_weights(_update(), tmp_path / "a.h5")
    f = open_weights(path)
    reads = reads_of(f)
    assert reads_of(f) is reads and reads.mapped("b") is not None
    f.close()
    assert f not in _filereads._ENGINES and reads.raw_location("b") is None

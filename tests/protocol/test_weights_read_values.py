"""`WeightFile.read_values`: the streamed passes' positional reads of a weight file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
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
            assert f.read_values("w", start, out)
            np.testing.assert_array_equal(out, flat[start : start + size])
        out = np.empty(1, np.float32)
        assert f.read_values("s", 0, out) and out[0] == 2.5
        assert f.read_values("b", 7, np.empty(0, np.float32))  # nothing to read


def test_what_it_cannot_read_as_it_lies_is_left_to_read_into(tmp_path: Path, monkeypatch) -> None:
    """False (never wrong values) for another dtype, a range outside the parameter, a
    non-contiguous buffer, a compressed file, FEDSPLIT_MMAP=0 or a closed file."""
    u = _update()
    path = write_weights(u, tmp_path / "a.h5")
    with open_weights(path) as f:
        assert not f.read_values("w", 0, np.empty(10, np.float64))
        assert not f.read_values("w", 1195, np.empty(10, np.float32))
        assert not f.read_values("w", -1, np.empty(10, np.float32))
        assert not f.read_values("w", 0, np.empty(20, np.float32)[::2])
        with pytest.raises(WeightFileError, match="no parameter"):
            f.read_values("nope", 0, np.empty(1, np.float32))
    with open_weights(write_weights(u, tmp_path / "z.h5", compress=True)) as f:
        assert not f.read_values("w", 0, np.empty(10, np.float32))
    monkeypatch.setenv("FEDSPLIT_MMAP", "0")
    with open_weights(path) as f:
        assert not f.read_values("w", 0, np.empty(10, np.float32))
    monkeypatch.delenv("FEDSPLIT_MMAP")
    f = open_weights(path)
    assert f.read_values("b", 0, np.empty(7, np.float32))
    f.close()
    assert not f.read_values("b", 0, np.empty(7, np.float32))


def test_a_file_renamed_over_is_not_seen_and_a_truncated_one_is_refused(tmp_path: Path) -> None:
    u = _update()
    path = write_weights(u, tmp_path / "a.h5")
    with open_weights(path) as f:
        out = np.empty(5, np.float32)
        assert f.read_values("b", 0, out)  # the descriptor is opened on first use
        other = _update()
        other.arrays["b"][:] = 0
        write_weights(other, path)  # atomic: a new file renamed over the name
        assert f.read_values("b", 0, out)
        np.testing.assert_array_equal(out, u.arrays["b"][:5])
    with open_weights(path) as f:
        assert f.read_values("b", 0, np.empty(1, np.float32))
        os.truncate(path, 4096)  # shrunk in place while open (fedsplit never does this)
        with pytest.raises(WeightFileError, match="ends early") as err:
            f.read_values("w", 1100, np.empty(100, np.float32))
        assert err.value.reason == "corrupt"


def test_hdf5_reads_of_a_file_cut_short_while_open_are_refused(tmp_path: Path, monkeypatch) -> None:
    """HDF5 itself fills a read past the end with zeros: the size check refuses it instead."""
    monkeypatch.setenv("FEDSPLIT_MMAP", "0")  # every read through HDF5 calls
    path = write_weights(_update(), tmp_path / "a.h5")
    with open_weights(path) as f:
        out = np.empty(7, np.float32)
        f.read_into("b", out)  # whole: fine before
        os.truncate(path, os.path.getsize(path) - 2000)
        with pytest.raises(WeightFileError, match="shrank") as err:
            f.read_into("w", np.empty(1200, np.float32))
        assert err.value.reason == "corrupt"
        with pytest.raises(WeightFileError, match="shrank"):
            f.array("w")

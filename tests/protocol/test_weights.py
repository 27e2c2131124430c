"""The weight-file format: round trips, atomic writes and every refusal of the strict reader."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from fedsplit.protocol import (
    FORMAT,
    Update,
    WeightFileError,
    open_weights,
    read_weights,
    write_weights,
)

from tests._helpers.weight_files import raw_weights


def make_update(**fields) -> Update:
    """A small update with every allowed dtype and a 0-dim parameter."""
    arrays = {
        "features.0.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "features.0.bias": np.array([0.5, -1.5], dtype=np.float16),
        "scale": np.array(2.0, dtype=np.float64),
    }
    return Update(arrays=arrays, num_examples=fields.pop("num_examples", 42), **fields)


def write_raw(path: Path, *, attrs=None, arrays=None, order=None) -> Path:
    """Write an HDF5 file by hand, bypassing the writer, to build malformed files."""
    attrs = {"format": FORMAT, "format_version": 1, "num_examples": 10} if attrs is None else attrs
    arrays = {"w": np.ones(3, np.float32)} if arrays is None else arrays
    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        g = f.create_group("arrays")
        for name, arr in arrays.items():
            g.create_dataset(name, data=arr)
        g.attrs["order"] = list(arrays) if order is None else order
    return path


def refusal_reason(path: Path, match: str) -> str:
    """The reason `read_weights` refuses ``path`` with, its message matching ``match``."""
    with pytest.raises(WeightFileError, match=match) as err:
        read_weights(path)
    return err.value.reason


def test_round_trip_keeps_names_order_dtypes_and_metadata(tmp_path: Path) -> None:
    """What is written is read back identically."""
    # Prepare
    update = make_update(site="h1", round=3, model="mlp/classification/3/2/8")
    # Execute
    back = read_weights(write_weights(update, tmp_path / "w.h5"))
    # Assert
    assert list(back.arrays) == list(update.arrays)
    for name, arr in update.arrays.items():
        assert back.arrays[name].dtype == arr.dtype
        np.testing.assert_array_equal(back.arrays[name], arr)
    assert (back.num_examples, back.site, back.round, back.model) == (
        42, "h1", 3, "mlp/classification/3/2/8")


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path, monkeypatch) -> None:
    """A failing write leaves the previous file intact and no temp file behind."""
    target = write_weights(make_update(num_examples=7), tmp_path / "w.h5")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(h5py.Group, "create_dataset", boom)
    with pytest.raises(OSError, match="disk full"):
        write_weights(make_update(num_examples=99), target)
    monkeypatch.undo()
    assert read_weights(target).num_examples == 7
    assert [p.name for p in tmp_path.iterdir()] == ["w.h5"]


def test_open_weights_reads_lazily_and_header_matches(tmp_path: Path) -> None:
    """The lazy reader exposes the header without reading values."""
    path = write_weights(make_update(), tmp_path / "w.h5")
    with open_weights(path) as wf:
        assert wf.header.names == ("features.0.weight", "features.0.bias", "scale")
        assert wf.header.specs[0].shape == (2, 3)
        np.testing.assert_array_equal(wf.array("scale"), np.array(2.0))


def test_num_examples_may_come_from_the_caller(tmp_path: Path) -> None:
    """A file without a count is readable when the caller supplies one."""
    path = write_raw(tmp_path / "w.h5", attrs={"format": FORMAT, "format_version": 1})
    assert read_weights(path, num_examples=5).num_examples == 5
    with pytest.raises(WeightFileError, match="no 'num_examples'"):
        read_weights(path)


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"format": "keras", "format_version": 1, "num_examples": 3}, "not a fedsplit weight file"),
        ({"format_version": 1, "num_examples": 3}, "not a fedsplit weight file"),  # format missing
        ({"format": FORMAT, "format_version": 2, "num_examples": 3}, "format_version 2"),
        ({"format": FORMAT, "format_version": 1, "num_examples": 3.5}, "must be an integer"),
        ({"format": FORMAT, "format_version": 1, "num_examples": "12"}, "must be an integer"),
        ({"format": FORMAT, "format_version": 1, "num_examples": 0}, ">= 1"),
        ({"format": FORMAT, "format_version": 1, "num_examples": -4}, ">= 1"),
    ],
)
def test_bad_root_attributes_are_refused(tmp_path: Path, attrs, match) -> None:
    """Wrong format, version or count: refused with a message naming the problem."""
    path = write_raw(tmp_path / "w.h5", attrs=attrs)
    with pytest.raises(WeightFileError, match=match):
        read_weights(path)


@pytest.mark.parametrize(
    ("arrays", "order", "match"),
    [
        ({"w": np.ones(3, np.float32)}, ["w", "b"], "'b' is listed in order but has no dataset"),
        ({"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)}, ["w"], "not listed in order"),
        ({"w": np.ones(3, np.float32)}, ["w", "w"], "listed twice"),
        ({"w": np.ones(3, np.int64)}, None, "dtype int64"),
        ({"w": np.array([1.0, np.nan], np.float32)}, None, "NaN/Inf"),
        ({"w": np.array([1.0, np.inf], np.float64)}, None, "NaN/Inf"),
    ],
)
def test_bad_arrays_are_refused(tmp_path: Path, arrays, order, match) -> None:
    """Order/dataset mismatches, non-float dtypes and non-finite values are refused."""
    path = write_raw(tmp_path / "w.h5", arrays=arrays, order=order)
    with pytest.raises(WeightFileError, match=match):
        read_weights(path)


def test_not_hdf5_is_refused(tmp_path: Path) -> None:
    """Random bytes are refused as not HDF5, naming the file."""
    path = tmp_path / "w.h5"
    path.write_bytes(b"PK\x03\x04 this is a zip, not HDF5")
    with pytest.raises(WeightFileError, match="not an HDF5 file"):
        read_weights(path)
    with pytest.raises(WeightFileError, match="does not exist"):
        read_weights(tmp_path / "missing.h5")


def test_links_of_every_kind_are_refused(tmp_path: Path) -> None:
    """Soft links, external links (to other files) and links at the root are refused."""
    other = write_raw(tmp_path / "other.h5")
    for kind in ("soft", "external", "root-external"):
        path = write_raw(tmp_path / f"{kind}.h5")
        with h5py.File(path, "a") as f:
            if kind == "soft":
                f["arrays"]["alias"] = h5py.SoftLink("/arrays/w")
                f["arrays"].attrs["order"] = ["w", "alias"]
            elif kind == "external":
                f["arrays"]["stolen"] = h5py.ExternalLink(str(other), "/arrays/w")
                f["arrays"].attrs["order"] = ["w", "stolen"]
            else:
                f["elsewhere"] = h5py.ExternalLink(str(other), "/arrays")
        assert refusal_reason(path, "link") == "link"


def test_hard_link_aliases_are_refused(tmp_path: Path) -> None:
    """A second hard link to the same dataset (a repeated parameter) is refused."""
    path = write_raw(tmp_path / "alias.h5")
    with h5py.File(path, "a") as f:
        f["arrays"]["copy"] = f["arrays"]["w"]
        f["arrays"].attrs["order"] = ["w", "copy"]
    assert refusal_reason(path, "second hard link") == "link"


def test_external_storage_is_refused(tmp_path: Path) -> None:
    """A dataset whose bytes live in another file is refused before it is read."""
    raw = tmp_path / "secret.bin"
    raw.write_bytes(np.ones(4, np.float32).tobytes())
    path = raw_weights(tmp_path / "w.h5", lambda f, g: g.create_dataset(
        "w", shape=(4,), dtype="f4", external=[(str(raw), 0, 16)]))
    assert refusal_reason(path, "external raw storage") == "external_storage"


def test_virtual_dataset_is_refused(tmp_path: Path) -> None:
    """A virtual dataset mapping another file's data is refused."""
    src = write_raw(tmp_path / "src.h5")
    path = tmp_path / "w.h5"
    layout = h5py.VirtualLayout(shape=(3,), dtype="f4")
    layout[:] = h5py.VirtualSource(str(src), "/arrays/w", shape=(3,))
    raw_weights(path, lambda f, g: g.create_virtual_dataset("w", layout))
    assert refusal_reason(path, "virtual dataset") == "virtual_dataset"


def test_nested_group_and_stray_root_objects_are_refused(tmp_path: Path) -> None:
    """Groups inside /arrays and anything beside /arrays are refused."""
    nested = write_raw(tmp_path / "nested.h5")
    with h5py.File(nested, "a") as f:
        f["arrays"].create_group("layer")
        f["arrays"].attrs["order"] = ["w", "layer"]
    with pytest.raises(WeightFileError, match="nested groups"):
        read_weights(nested)
    stray = write_raw(tmp_path / "stray.h5")
    with h5py.File(stray, "a") as f:
        f.create_dataset("extra", data=np.ones(2))
    with pytest.raises(WeightFileError, match="unexpected object /extra"):
        read_weights(stray)


def test_plugin_filters_are_refused(tmp_path: Path) -> None:
    """lzf (or any filter beyond gzip, shuffle, fletcher32) is refused before reading."""
    path = write_raw(tmp_path / "w.h5")
    with h5py.File(path, "a") as f:
        del f["arrays"]["w"]
        f["arrays"].create_dataset("w", data=np.ones(64, np.float32), compression="lzf")
    assert refusal_reason(path, "filter 32000") == "filter"


def test_shape_bomb_limit(tmp_path: Path) -> None:
    """max_elements refuses files declaring more parameter values than allowed."""
    path = write_raw(tmp_path / "w.h5", arrays={"w": np.zeros((100, 100), np.float32)})
    with pytest.raises(WeightFileError, match=r"\(10000 values\), more than the 1000") as err:
        open_weights(path, max_elements=1000)
    assert err.value.reason == "too_large"
    # the total over all parameters is capped too
    two = write_raw(tmp_path / "two.h5", arrays={"a": np.zeros(600, np.float32),
                                                 "b": np.zeros(600, np.float32)})
    with pytest.raises(WeightFileError, match="more than 1000 parameter values in total"):
        open_weights(two, max_elements=1000)


def test_writer_refuses_wrong_suffix(tmp_path: Path) -> None:
    """Weight files end in .h5 or .hdf5."""
    with pytest.raises(WeightFileError, match="must end in"):
        write_weights(make_update(), tmp_path / "weights.pt")


def test_read_into_whole_parameter_and_converts_precision(tmp_path: Path) -> None:
    """A whole parameter lands in a 1-D buffer; a float16 file fills a float32 buffer."""
    path = write_weights(make_update(), tmp_path / "w.h5")
    with open_weights(path) as wf:
        whole = np.empty(6, np.float64)
        wf.read_into("features.0.weight", whole)
        half = np.empty(2, np.float32)
        wf.read_into("features.0.bias", half)
        scalar = np.empty(1, np.float32)
        wf.read_into("scale", scalar)
    np.testing.assert_array_equal(whole, np.arange(6, dtype=np.float64))
    assert half.dtype == np.float32
    np.testing.assert_array_equal(half, [0.5, -1.5])
    assert scalar[0] == 2.0


def test_read_into_hyperslab_of_a_2d_parameter(tmp_path: Path) -> None:
    """start/count select a block of rows and columns, read in C order."""
    values = np.arange(20, dtype=np.float32).reshape(4, 5)
    path = write_weights(Update(arrays={"w": values}, num_examples=3), tmp_path / "w.h5")
    with open_weights(path) as wf:
        out = np.empty(6, np.float32)
        wf.read_into("w", out, start=(1, 2), count=(2, 3))
        again = np.empty(6, np.float32)
        wf.read_into("w", again, start=(1, 2), count=(2, 3))  # cached dataset id
    np.testing.assert_array_equal(out, values[1:3, 2:5].reshape(-1))
    np.testing.assert_array_equal(again, out)


def test_read_into_refuses_bad_requests(tmp_path: Path) -> None:
    """Unknown names, wrong buffers and out-of-range hyperslabs are named errors."""
    path = write_weights(make_update(), tmp_path / "w.h5")
    with open_weights(path) as wf:
        with pytest.raises(WeightFileError, match=r"no parameter 'nope'.*Received: 'nope'"):
            wf.read_into("nope", np.empty(1, np.float32))
        with pytest.raises(WeightFileError, match=r"exactly 6 values"):
            wf.read_into("features.0.weight", np.empty(5, np.float32))
        with pytest.raises(WeightFileError, match=r"float buffer"):
            wf.read_into("features.0.weight", np.empty(6, np.int64))
        with pytest.raises(WeightFileError, match=r"float buffer"):
            wf.read_into("features.0.weight", np.empty((2, 3), np.float32))
        with pytest.raises(WeightFileError, match=r"inside parameter"):
            wf.read_into("features.0.weight", np.empty(4, np.float32), start=(1, 0), count=(2, 2))
        with pytest.raises(WeightFileError, match=r"both start and count"):
            wf.read_into("features.0.weight", np.empty(6, np.float32), start=(0, 0))


def test_read_into_damaged_chunk_is_a_corrupt_weight_file_error(tmp_path: Path) -> None:
    """Overwritten compressed bytes surface as WeightFileError(reason='corrupt')."""
    values = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    path = write_weights(Update(arrays={"p0": values}, num_examples=3), tmp_path / "w.h5",
                         compress=True)
    with h5py.File(path, "r") as f:
        offset = f["arrays/p0"].id.get_chunk_info(0).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset : offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(raw))
    with open_weights(path) as wf, pytest.raises(WeightFileError, match="damaged") as caught:
        wf.read_into("p0", np.empty(64 * 64, np.float32))
    assert caught.value.reason == "corrupt"

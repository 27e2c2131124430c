"""The fast paths of opening a weight file agree with the full checks they stand in for.

`protocol.h5safety.walk` reads each dataset's storage from its object header when that shows
plain contiguous bytes (the creation property list otherwise), matches types with ``H5Tequal``
against the standard IEEE/integer types, tells hard-link aliases by object address and opens
datasets without h5o's type lookup after a dataset; `protocol.weights` reads the attributes it
writes with h5py's low-level calls. Each test builds real files and compares with h5py's own
high-level answers (or proves the refusal still happens).
"""

from __future__ import annotations

import io
from pathlib import Path

import h5py
import numpy as np
import pytest
from fedsplit.aggregation._filereads import reads_of
from fedsplit.protocol import FORMAT, WeightFileError, h5safety, open_weights, read_weights
from fedsplit.protocol.h5safety import UNKNOWN, check_dataset, mappable_offset, walk
from fedsplit.protocol.weights import _attr
from h5py import h5d, h5p, h5s, h5t

ROOT_ATTRS = {"format": FORMAT, "format_version": 1, "num_examples": 10}


def write_file(path: Path, build, *, attrs=None, order=None) -> Path:
    """A weight file whose /arrays group ``build(group)`` fills; order: the names, sorted."""
    with h5py.File(path, "w") as f:
        for key, value in (ROOT_ATTRS if attrs is None else attrs).items():
            f.attrs[key] = value
        group = f.create_group("arrays")
        build(group)
        group.attrs["order"] = sorted(group) if order is None else order
    return path


def odd_float32() -> h5t.TypeID:
    """A 4-byte float with a 24-bit layout: h5py calls it float32, HDF5 converts it on reads."""
    tid = h5t.IEEE_F32LE.copy()
    tid.set_fields(23, 16, 7, 0, 16)
    tid.set_precision(24)
    tid.set_ebias(63)
    return tid


def every_storage_kind(group: h5py.Group) -> None:
    """One dataset of each storage and type the walk may meet."""
    group["f32"] = np.arange(6, dtype=np.float32).reshape(2, 3)
    group["f64"] = np.ones(5)
    group["f16"] = np.ones(3, np.float16)
    group["f32be"] = np.ones(4, ">f4")
    group["i8"] = np.ones(3, np.int8)
    group["u64"] = np.ones(2, np.uint64)
    group["scalar"] = np.float32(2.5)
    group["empty"] = np.zeros(0, np.float32)
    group.create_dataset("unallocated", shape=(4,), dtype="f4")
    group.create_dataset("chunked", data=np.ones(64, np.float32), chunks=(16,))
    group.create_dataset("gzip", data=np.ones(64, np.float32), compression="gzip")
    group.create_dataset("checked", data=np.ones(64, np.float32), shuffle=True, fletcher32=True)
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_layout(h5d.COMPACT)
    h5d.create(group.id, b"compact", h5t.IEEE_F32LE, h5s.create_simple((4,)), dcpl=dcpl)
    odd = h5d.create(group.id, b"odd", odd_float32(), h5s.create_simple((4,)))
    odd.write(h5s.ALL, h5s.ALL, np.arange(1, 5, dtype=np.float32))  # HDF5 converts


def reference_offset(ds: h5py.Dataset) -> int | None:
    """Where values can be read as they lie, from the creation property list and h5py's dtype."""
    plist = ds.id.get_create_plist()
    plain = ds.id.get_type().equal(h5t.py_create(ds.dtype))
    if (plist.get_layout() != h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count()
            or not ds.dtype.isnative or not plain):
        return None
    offset = ds.id.get_offset()
    return None if offset is None or offset % ds.dtype.itemsize else offset


def test_walk_agrees_with_the_full_check_for_every_storage_kind(tmp_path: Path) -> None:
    """Shapes and dtypes are check_dataset's; offsets the property list's; odd floats not mapped."""
    path = write_file(tmp_path / "kinds.h5", every_storage_kind)
    with h5py.File(path, "r") as f:
        tree = walk(f, where="x", max_depth=2, max_elements=10**6)
        infos = {info.path: info for info in tree.datasets}
        group = f["arrays"]
        for name in group:
            info, full = infos[f"arrays/{name}"], check_dataset(group[name], name, 10**6, "x")
            assert (info.shape, info.dtype) == (full.shape, full.dtype), name
            if info.offset is not UNKNOWN:
                assert info.offset == reference_offset(group[name]), name
        mapped = {n for n in group if isinstance(infos[f"arrays/{n}"].offset, int)}
        assert {"f32", "f64", "f16", "i8"} <= mapped  # (others here lie misaligned)
        # the float with another bit layout is left to the full check and never read as it lies
        assert infos["arrays/odd"].offset is UNKNOWN
        odd = group["odd"]
        assert odd.dtype == np.float32
        assert mappable_offset(odd.id, odd.id.get_create_plist(), odd.dtype) is None
        plain = group["f32"]
        assert mappable_offset(plain.id, plain.id.get_create_plist(), plain.dtype) == (
            plain.id.get_offset())


def test_plain_types_are_the_ones_h5py_names() -> None:
    """Each standard type's numpy dtype is h5py's own; the native dtype is numpy's instance."""
    for entries in h5safety._PLAIN_TYPES.values():
        for std, dtype, native in entries:
            assert std.dtype == dtype
            assert native is np.dtype(dtype.type)


def test_header_summary_gives_an_offset_only_for_plain_contiguous_bytes(tmp_path: Path) -> None:
    """External storage, filters, chunks, compact and virtual layouts all go to the plist."""
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.ones(4, np.float32).tobytes())

    def build(group: h5py.Group) -> None:
        every_storage_kind(group)
        group.create_dataset("external", shape=(4,), dtype="f4", external=[(str(raw), 0, 16)])
        layout = h5py.VirtualLayout(shape=(4,), dtype="f4")
        layout[:] = h5py.VirtualSource(group["unallocated"])
        group.create_virtual_dataset("virtual", layout)

    path = write_file(tmp_path / "kinds.h5", build)
    with h5py.File(path, "r") as f:
        for name, ds in f["arrays"].items():
            plist = ds.id.get_create_plist()
            plain = (plist.get_layout() == h5d.CONTIGUOUS and not plist.get_nfilters()
                     and not plist.get_external_count() and ds.id.get_offset() is not None)
            found = h5safety._plain_contiguous(ds.id)
            assert found == (ds.id.get_offset() if plain else None), name


@pytest.mark.parametrize(
    ("build", "match", "reason"),
    [
        (lambda g: g.create_dataset("w", data=h5py.Empty("f4")), "null dataspace", "dtype"),
        (lambda g: g.create_dataset("w", data=np.array([True, False])), "dtype bool", "dtype"),
        (lambda g: g.__setitem__("w", np.zeros(2, "S4")), r"dtype \|S4 \(string\)", "dtype"),
        (lambda g: g.__setitem__("w", np.dtype("f4")), "is a Datatype", "unexpected_object"),
        (lambda g: g.create_dataset("w", data=np.ones(4, "f4"), chunks=(2,), compression="lzf"),
         "filter 32000", "filter"),
    ],
    ids=["null-space", "bool", "fixed-string", "committed-type", "lzf"],
)
def test_what_the_fast_path_hands_on_is_still_refused(tmp_path: Path, build, match, reason) -> None:
    """Datasets and objects the fast check does not accept are refused by the full check."""
    path = write_file(tmp_path / "w.h5", build)
    with pytest.raises(WeightFileError, match=match) as err:
        open_weights(path)
    assert err.value.reason == reason


def test_group_alias_and_alias_across_groups_are_refused(tmp_path: Path) -> None:
    """A second hard link to a group, or to a dataset from another group, is refused."""
    for kind in ("group", "dataset"):
        path = write_file(tmp_path / f"{kind}.h5", lambda g: g.__setitem__("w", np.ones(3, "f4")))
        with h5py.File(path, "a") as f:
            if kind == "group":
                f["more"] = f["arrays"]
            else:
                f.create_group("other")["w"] = f["arrays"]["w"]
        with pytest.raises(WeightFileError, match="second hard link") as err:
            open_weights(path)
        assert err.value.reason == "link"


def test_distinct_datasets_are_not_taken_for_aliases(tmp_path: Path) -> None:
    """Equal values in many datasets are distinct objects (addresses differ)."""
    names = [f"w{i}" for i in range(40)]

    def build(group: h5py.Group) -> None:
        for name in names:
            group[name] = np.ones(3, np.float32)

    with open_weights(write_file(tmp_path / "w.h5", build, order=names)) as wf:
        assert wf.header.names == tuple(names)


def test_a_group_after_datasets_is_found(tmp_path: Path) -> None:
    """A group listed after datasets (opened after a failed dataset open) is still a group."""

    def build(group: h5py.Group) -> None:
        group["a"] = np.ones(3, np.float32)
        group["b"] = np.ones(3, np.float32)
        group.create_group("c")["d"] = np.ones(2, np.float32)
        group["e"] = np.ones(3, np.float32)

    path = write_file(tmp_path / "w.h5", build, order=["a", "b", "c", "e"])
    with h5py.File(path, "r") as f:
        tree = walk(f, where="x", max_depth=3, max_elements=100)
    assert tree.groups == ["arrays", "arrays/c"]
    assert [d.path for d in tree.datasets] == ["arrays/a", "arrays/b", "arrays/c/d", "arrays/e"]
    with pytest.raises(WeightFileError, match="nested groups") as err:
        open_weights(path)
    assert err.value.reason == "nested_group"


def test_datasets_come_in_natural_order(tmp_path: Path) -> None:
    """vars/2 before vars/10, whatever order HDF5 lists them in."""
    names = ["w10", "w2", "w1", "b", "w9"]

    def build(group: h5py.Group) -> None:
        for name in names:
            group[name] = np.ones(1, np.float32)

    with h5py.File(write_file(tmp_path / "w.h5", build), "r") as f:
        tree = walk(f, where="x", max_depth=2, max_elements=100)
    assert [d.path for d in tree.datasets] == ["arrays/b", "arrays/w1", "arrays/w2", "arrays/w9",
                                               "arrays/w10"]


def test_depth_and_object_count_limits(tmp_path: Path, monkeypatch) -> None:
    """Groups deeper than the limit and more objects than the limit are refused."""
    path = write_file(tmp_path / "deep.h5", lambda g: g.create_group("a").create_group("b"))
    with h5py.File(path, "r") as f, pytest.raises(WeightFileError, match="deeper than 1") as err:
        walk(f, where="x", max_depth=1, max_elements=100)
    assert err.value.reason == "too_deep"

    def build(group: h5py.Group) -> None:
        for i in range(5):
            group[f"w{i}"] = np.ones(1, np.float32)

    monkeypatch.setattr(h5safety, "MAX_OBJECTS", 5)  # arrays + 5 datasets: one too many
    with pytest.raises(WeightFileError, match="more than 5 groups") as err:
        open_weights(write_file(tmp_path / "many.h5", build))
    assert err.value.reason == "too_many_objects"


ATTRIBUTE_VALUES = {
    "str": "fedsplit.weights",
    "ascii": np.array("abc", dtype=h5py.string_dtype("ascii")),
    "bytes": np.bytes_(b"abc"),
    "strings": ["a", "bc", "d\u00e9"],
    "strings2d": np.array([["a", "b"], ["c", "d"]], dtype=h5py.string_dtype()),
    "int64": np.int64(7),
    "int32": np.int32(-3),
    "uint8be": np.array(5, ">u1"),
    "int64be": np.array(9, ">i8"),
    "float": 3.5,
    "float16": np.float16(1.5),
    "bool": True,
    "ints": np.array([1, 2]),
    "one": np.array([1]),
    "empty": h5py.Empty("f4"),
    "compound": np.array((1, 2.0), dtype=[("a", "i4"), ("b", "f8")]),
}


def test_low_level_attribute_reads_match_h5py() -> None:
    """Every kind of attribute reads back as h5py's attrs[...] gives it: value, type, dtype."""
    with h5py.File(io.BytesIO(), "w") as f:
        group = f.create_group("g")
        for key, value in ATTRIBUTE_VALUES.items():
            group.attrs[key] = value
        for key in ATTRIBUTE_VALUES:
            ours, theirs = _attr(group.id, key), group.attrs[key]
            assert type(ours) is type(theirs), key
            if isinstance(theirs, np.ndarray | np.generic):
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, key
                assert ours.dtype.metadata == theirs.dtype.metadata, key
                np.testing.assert_array_equal(ours, theirs)
            elif isinstance(theirs, h5py.Empty):
                assert ours.dtype == theirs.dtype
            else:
                assert ours == theirs, key
        assert _attr(group.id, "missing") is None
        assert _attr(group.id, "missing", "default") == "default"


@pytest.mark.parametrize(
    ("attrs", "match", "reason"),
    [
        ({**ROOT_ATTRS, "format_version": "1"}, "'format_version' must be an integer. "
         "Received: '1'", "wrong_format"),
        ({**ROOT_ATTRS, "format_version": [1]}, r"Received: array\(\[1\]\)", "wrong_format"),
        ({**ROOT_ATTRS, "format_version": True}, "Received: True", "wrong_format"),
        ({**ROOT_ATTRS, "format_version": np.int32(2)}, "format_version 2", "wrong_format"),
        ({**ROOT_ATTRS, "num_examples": True}, "must be an integer >= 1", "num_examples"),
        ({**ROOT_ATTRS, "num_examples": [3]}, "must be an integer >= 1", "num_examples"),
        ({**ROOT_ATTRS, "round": 1.5}, "'round' must be an integer", "wrong_format"),
        ({**ROOT_ATTRS, "schema": 3}, "'schema' must be a JSON string", "schema"),
        ({**ROOT_ATTRS, "schema": "{"}, "not a valid table schema", "schema"),
        ({**ROOT_ATTRS, "format": b"fedsplit.other"}, "not a fedsplit weight file", "wrong_format"),
    ],
)
def test_root_attribute_refusals(tmp_path: Path, attrs, match, reason) -> None:
    """Wrong kinds of root attribute (read through either reader) are refused by name."""
    path = write_file(tmp_path / "w.h5", lambda g: g.__setitem__("w", np.ones(3, "f4")),
                      attrs=attrs)
    with pytest.raises(WeightFileError, match=match) as err:
        open_weights(path)
    assert err.value.reason == reason


def test_attributes_of_other_kinds_still_read(tmp_path: Path) -> None:
    """Fixed-length byte strings and 32-bit counts (h5py's slow reader) give the same header."""
    attrs = {"format": np.bytes_(FORMAT.encode()), "format_version": np.int32(1),
             "num_examples": np.uint16(12), "site": np.bytes_(b"h1"), "round": np.int8(4),
             "model": np.array("mlp", dtype=h5py.string_dtype("ascii"))}
    path = write_file(tmp_path / "w.h5", lambda g: g.__setitem__("w", np.ones(3, "f4")),
                      attrs=attrs, order=np.array([b"w"], dtype="S1"))
    update = read_weights(path)
    assert (update.num_examples, update.site, update.round, update.model) == (12, "h1", 4, "mlp")
    assert list(update.arrays) == ["w"]


def test_file_objects_open_like_paths(tmp_path: Path) -> None:
    """An upload (file object) is checked the same way, values mapped or not."""
    path = write_file(tmp_path / "w.h5", every_storage_kind)
    with pytest.raises(WeightFileError, match="dtype int8"):
        open_weights(io.BytesIO(path.read_bytes()))
    ok = write_file(tmp_path / "ok.h5", lambda g: g.__setitem__("w", np.arange(3, dtype="f4")))
    np.testing.assert_array_equal(read_weights(io.BytesIO(ok.read_bytes())).arrays["w"],
                                  np.arange(3, dtype="f4"))


def test_a_float_of_another_layout_reads_its_values_by_every_path(tmp_path: Path) -> None:
    """Bytes that are not IEEE float32 are never read as they lie (mapped or by read_values)."""

    def build(group: h5py.Group) -> None:
        dsid = h5d.create(group.id, b"w", odd_float32(), h5s.create_simple((4,)))
        dsid.write(h5s.ALL, h5s.ALL, np.arange(1, 5, dtype=np.float32))

    expected = np.arange(1, 5, dtype=np.float32)
    with open_weights(write_file(tmp_path / "w.h5", build)) as wf:
        assert wf.header.specs[0].dtype == np.float32
        out = np.zeros(4, np.float32)
        if reads_of(wf).read_values("w", 0, out):
            np.testing.assert_array_equal(out, expected)
        view = reads_of(wf).mapped("w")
        if view is not None:
            np.testing.assert_array_equal(view, expected)
        wf.read_into("w", out)
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(wf.array("w"), expected)

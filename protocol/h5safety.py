"""Structural safety checks for untrusted HDF5 files, run before any dataset value is read.

Walks every link of the file once and refuses, with a `WeightFileError` whose ``reason`` is a
short machine-readable code (``link``, ``virtual_dataset``, ``filter``, ...): soft, external
and user-defined links (and hard-link aliases, which make cycles and repeated parameters),
committed datatypes, trees deeper than the limit, more objects than the limit, virtual
datasets, external raw storage, filters other than gzip/shuffle/fletcher32 (anything else
needs a plugin library: code loaded at read time), compound/string/object/reference/enum
dtypes, null dataspaces and datasets whose declared size is over the limit. Only `h5py`
metadata calls are made; no data is read.

`protocol.weights` runs it on every weight file it opens; the admin API runs it on every upload
(fedsplit or Keras layout) inside its sandboxed parser.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import h5py
import h5py.h5pl
import numpy as np
from h5py import h5d, h5g, h5l, h5o, h5s, h5t

from protocol.errors import WeightFileError

#: HDF5 filter ids allowed in an upload: deflate (gzip), shuffle, fletcher32.
ALLOWED_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32"}
#: Objects (groups + datasets) one file may hold.
MAX_OBJECTS = 100_000


@dataclass
class DatasetInfo:
    """A dataset found by `walk`, by path."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    #: where the values lie in the file when they can be memory-mapped as they are (contiguous
    #: storage, no filters, this machine's byte order, allocated, aligned); None when they
    #: cannot; `UNKNOWN` when the walk did not look (the high-level check's datasets)
    offset: int | object | None = None


#: `DatasetInfo.offset` of a dataset whose storage the walk did not inspect
UNKNOWN = object()


@dataclass
class Tree:
    """What `walk` found: groups (parents first, with attributes) and datasets, in natural order."""

    groups: list[str] = field(default_factory=list)
    datasets: list[DatasetInfo] = field(default_factory=list)


def natural_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key that puts 'vars/2' before 'vars/10'."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def walk(f: h5py.File, *, where: str, max_depth: int, max_elements: int) -> Tree:
    """Check the whole file's structure and return its groups and datasets.

    ``where`` starts every message ("Weight file x.h5", "The uploaded file"). Uses h5py's
    low-level API (a few microseconds an object); anything unusual (a link that is not a hard
    link, an object that is neither group nor dataset, a dataset the fast check does not
    accept) is handed to the high-level checks, which make the refusal.
    """
    tree = Tree()
    seen: set[int] = set()
    _walk_group(h5g.open(f.id, b"/"), "", 0, tree, seen, max_depth, max_elements, where)
    return tree


def _walk_group(
    gid: h5g.GroupID, prefix: str, depth: int, tree: Tree, seen: set[int], max_depth: int,
    max_elements: int, where: str,
) -> None:
    if depth > max_depth:
        raise WeightFileError(
            f"{where} nests groups deeper than {max_depth} levels at /{prefix}; weight files are "
            f"shallow (fedsplit: /arrays/NAME, Keras: layers/NAME/vars/N). Received: depth > {max_depth}",
            reason="too_deep",
        )
    names = {raw.decode("utf-8", "surrogateescape"): raw for raw in gid}
    for name in sorted(names, key=natural_key):
        raw = names[name]
        path = f"{prefix}{name}"
        try:
            hard = gid.links.get_info(raw).type == h5l.TYPE_HARD
        except Exception:  # h5py cannot even describe this link: the high-level check refuses
            hard = False
        if not hard:
            _refuse_link(h5py.Group(gid), name, path, where)
        obj = h5o.open(gid, raw)
        key = hash(obj)
        if key in seen:
            raise WeightFileError(
                f"{where}: /{path} is a second hard link to an object already seen; every group and "
                f"parameter must appear once (aliases make cycles and duplicate weights). "
                f"Received: /{path}",
                reason="link",
            )
        seen.add(key)
        if len(seen) > MAX_OBJECTS:
            raise WeightFileError(
                f"{where} holds more than {MAX_OBJECTS} groups and datasets; no model needs that "
                f"many. Received: > {MAX_OBJECTS} objects",
                reason="too_many_objects",
            )
        if isinstance(obj, h5g.GroupID):
            tree.groups.append(path)
            _walk_group(obj, f"{path}/", depth + 1, tree, seen, max_depth, max_elements, where)
        elif isinstance(obj, h5d.DatasetID):
            info = _fast_dataset_info(obj, path, max_elements)
            if info is None:  # something the fast check does not accept: the full check decides
                info = check_dataset(h5py.Dataset(obj), f"/{path}", max_elements, where)
            tree.datasets.append(info)
        else:
            kind = type(h5py.Group(gid)[name]).__name__
            raise WeightFileError(
                f"{where}: /{path} is a {kind}; a weight file holds only groups and "
                f"datasets. Received: /{path}",
                reason="unexpected_object",
            )


def _refuse_link(group: h5py.Group, name: str, path: str, where: str) -> None:
    """Raise the refusal of the soft, external or user-defined link ``name`` in ``group``."""
    try:
        link = group.get(name, getlink=True)
    except Exception as e:  # h5py cannot even describe user-defined link classes
        raise _link_error(where, path, "a user-defined link", f"({type(e).__name__})") from None
    if isinstance(link, h5py.ExternalLink):
        raise _link_error(where, path, "an external link", f"-> {link.filename}:{link.path}")
    if isinstance(link, h5py.SoftLink):
        raise _link_error(where, path, "a soft link", f"-> {link.path}")
    raise _link_error(where, path, "a user-defined link", f"({type(link).__name__})")


#: (class, size, order/sign) -> dtype, for the plain numeric types the fast check accepts
_FAST_TYPES: dict[tuple[int, int, int], np.dtype] = {
    **{(h5t.FLOAT, n, o): np.dtype(f"{e}f{n}") for n in (2, 4, 8)
       for o, e in ((h5t.ORDER_LE, "<"), (h5t.ORDER_BE, ">"))},
    **{(h5t.INTEGER, n, s): np.dtype(f"{k}{n}") for n in (1, 2, 4, 8)
       for s, k in ((h5t.SGN_2, "i"), (h5t.SGN_NONE, "u"))},
}


def _fast_dataset_info(dsid: h5d.DatasetID, path: str, max_elements: int) -> DatasetInfo | None:
    """The dataset's info when it plainly passes `check_dataset`, else None (low-level calls).

    Accepts only: not virtual, no external storage, allowed filters, a simple or scalar
    dataspace within ``max_elements``, and an IEEE float or integer type whose numpy dtype
    h5py gives as the plain one of that size.
    """
    plist = dsid.get_create_plist()
    if plist.get_layout() == h5d.VIRTUAL or plist.get_external_count() > 0:
        return None
    if any(plist.get_filter(i)[0] not in ALLOWED_FILTERS for i in range(plist.get_nfilters())):
        return None
    space = dsid.get_space()
    if space.get_simple_extent_type() not in (h5s.SIMPLE, h5s.SCALAR):
        return None
    shape = tuple(int(d) for d in space.shape)
    size = math.prod(shape)
    if size > max_elements:
        return None
    tid = dsid.get_type()
    cls = tid.get_class()
    if cls == h5t.FLOAT:
        dtype = _FAST_TYPES.get((cls, tid.get_size(), tid.get_order()))
    elif cls == h5t.INTEGER:
        dtype = _FAST_TYPES.get((cls, tid.get_size(), tid.get_sign()))
    else:
        return None
    if dtype is None or dsid.dtype != dtype:  # h5py's own mapping must agree (e.g. no odd floats)
        return None
    return DatasetInfo(path, shape, dtype.newbyteorder("="), mappable_offset(dsid, plist, dtype))


def mappable_offset(dsid: h5d.DatasetID, plist: Any, dtype: np.dtype) -> int | None:
    """The file offset of the dataset's values when they can be mapped as they lie (contiguous,
    in the file itself, unfiltered, native byte order, aligned), else None. ``plist`` and
    ``dtype`` are the dataset's creation property list and numpy dtype."""
    if (plist.get_layout() != h5d.CONTIGUOUS or plist.get_nfilters()
            or plist.get_external_count()):
        return None
    if not dtype.isnative:
        return None
    offset = dsid.get_offset()
    if offset is None or offset % dtype.itemsize:
        return None
    return int(offset)


def _link_error(where: str, path: str, kind: str, target: str) -> WeightFileError:
    """The refusal of a soft, external or user-defined link at ``/path``."""
    return WeightFileError(
        f"{where}: /{path} is {kind}; weight files may not contain soft, external or "
        f"user-defined links (they can point into other files). Save the weights without "
        f"links. Received: /{path} {target}",
        reason="link",
    )


def check_dataset(ds: h5py.Dataset, path: str, max_elements: int, where: str) -> DatasetInfo:
    """Check one dataset's storage, filters, dtype and declared size; read no values."""
    if ds.is_virtual:
        raise WeightFileError(
            f"{where}: {path} is a virtual dataset (it maps data from other files). Write the "
            f"values into the file itself. Received: {path}",
            reason="virtual_dataset",
        )
    if ds.external:
        raise WeightFileError(
            f"{where}: {path} uses external raw storage (its bytes live in another file). Write "
            f"the values into the file itself. Received: external={[e[0] for e in ds.external]!r}",
            reason="external_storage",
        )
    plist = ds.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        code = plist.get_filter(i)[0]
        if code not in ALLOWED_FILTERS:
            raise WeightFileError(
                f"{where}: {path} uses HDF5 filter {code}; only {', '.join(ALLOWED_FILTERS.values())} "
                f"are accepted (any other filter needs a plugin library loaded at read time). "
                f"Save without compression or with gzip. Received: filter {code}",
                reason="filter",
            )
    if ds.shape is None:
        raise WeightFileError(
            f"{where}: {path} has a null dataspace (no shape). Received: shape None", "dtype"
        )
    dtype = ds.dtype
    if dtype.kind not in "fiu" or dtype.names is not None or dtype.subdtype is not None:
        raise WeightFileError(
            f"{where}: {path} has dtype {dtype} ({_kind_name(ds)}); weight files hold numeric "
            f"arrays only, parameters float16/32/64. Received: dtype={dtype}",
            reason="dtype",
        )
    size = int(np.prod(ds.shape, dtype=np.int64)) if ds.shape else 1
    if size > max_elements:
        raise WeightFileError(
            f"{where}: {path} declares shape {ds.shape} ({size} values), more than the "
            f"{max_elements} values this round accepts (its model's size or the upload limit). "
            f"Upload the round's model. Received: shape {ds.shape}",
            reason="too_large",
        )
    return DatasetInfo(
        path.lstrip("/"), tuple(int(d) for d in ds.shape), dtype.newbyteorder("="), UNKNOWN
    )


def _kind_name(ds: h5py.Dataset) -> str:
    dtype = ds.dtype
    if dtype.names is not None:
        return "compound"
    if h5py.check_string_dtype(dtype) is not None or dtype.kind in "SU":
        return "string"
    if h5py.check_ref_dtype(dtype) is not None:
        return "reference"
    if h5py.check_vlen_dtype(dtype) is not None or dtype.kind == "O":
        return "object"
    if h5py.check_enum_dtype(dtype) is not None:
        return "enum"
    return dtype.kind


def disable_plugins() -> None:
    """Empty HDF5's plugin search path: no filter plugin library can be loaded afterwards."""
    while h5py.h5pl.size() > 0:
        h5py.h5pl.remove(0)


def looks_like_hdf5(fh: object, size: int) -> bool:
    """True if the HDF5 signature is at offset 0, 512, 1024, 2048, ... (where HDF5 may put it)."""
    signature = b"\x89HDF\r\n\x1a\n"
    offset = 0
    while offset + len(signature) <= size:
        fh.seek(offset)  # type: ignore[attr-defined]
        if fh.read(len(signature)) == signature:  # type: ignore[attr-defined]
            fh.seek(0)  # type: ignore[attr-defined]
            return True
        offset = 512 if offset == 0 else offset * 2
    fh.seek(0)  # type: ignore[attr-defined]
    return False

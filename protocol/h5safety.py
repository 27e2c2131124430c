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

import re
from dataclasses import dataclass, field

import h5py
import h5py.h5pl
import numpy as np

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

    ``where`` starts every message ("Weight file x.h5", "The uploaded file").
    """
    tree = Tree()
    seen: set[int] = set()
    _walk_group(f, "", 0, tree, seen, max_depth, max_elements, where)
    return tree


def _walk_group(
    group: h5py.Group, prefix: str, depth: int, tree: Tree, seen: set[int], max_depth: int,
    max_elements: int, where: str,
) -> None:
    if depth > max_depth:
        raise WeightFileError(
            f"{where} nests groups deeper than {max_depth} levels at /{prefix}; weight files are "
            f"shallow (fedsplit: /arrays/NAME, Keras: layers/NAME/vars/N). Received: depth > {max_depth}",
            reason="too_deep",
        )
    for name in sorted(group.keys(), key=natural_key):
        path = f"{prefix}{name}"
        try:
            link = group.get(name, getlink=True)
        except Exception as e:  # h5py cannot even describe user-defined link classes
            raise _link_error(where, path, "a user-defined link", f"({type(e).__name__})") from None
        if isinstance(link, h5py.ExternalLink):
            raise _link_error(where, path, "an external link", f"-> {link.filename}:{link.path}")
        if isinstance(link, h5py.SoftLink):
            raise _link_error(where, path, "a soft link", f"-> {link.path}")
        if not isinstance(link, h5py.HardLink):
            raise _link_error(where, path, "a user-defined link", f"({type(link).__name__})")
        obj = group[name]
        key = hash(obj.id)
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
        if isinstance(obj, h5py.Group):
            tree.groups.append(path)
            _walk_group(obj, f"{path}/", depth + 1, tree, seen, max_depth, max_elements, where)
        elif isinstance(obj, h5py.Dataset):
            tree.datasets.append(check_dataset(obj, f"/{path}", max_elements, where))
        else:
            raise WeightFileError(
                f"{where}: /{path} is a {type(obj).__name__}; a weight file holds only groups and "
                f"datasets. Received: /{path}",
                reason="unexpected_object",
            )


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
    return DatasetInfo(path.lstrip("/"), tuple(int(d) for d in ds.shape), dtype.newbyteorder("="))


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

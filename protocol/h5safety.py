"""Structural safety checks for untrusted HDF5 files, run before any dataset value is read.

Walks every link of the file once and refuses, with a `WeightFileError` whose ``reason`` is a
short machine-readable code (``link``, ``virtual_dataset``, ``filter``, ...): soft, external
and user-defined links (and hard-link aliases, which make cycles and repeated parameters),
committed datatypes, trees deeper than the limit, more objects than the limit, virtual
datasets, external raw storage, filters other than gzip/shuffle/fletcher32 (anything else
needs a plugin library: code loaded at read time), compound/string/object/reference/enum
dtypes, null dataspaces, datasets whose declared size is over the limit, chunks smaller than
`MIN_CHUNK_BYTES` (past a few) and more than `MAX_CHUNKS` chunks in a file. Only `h5py` metadata calls are
made; no data is read.

The walk is h5py's low-level API, each property asked once (about 30 us a dataset, most of it
HDF5 opening and closing it): a group's links and their object addresses in one pass (an
address seen twice is an alias), a dataset's storage from its object header when that shows
plain contiguous bytes (no external file list, no filter pipeline; the creation property list
otherwise), its type matched with ``H5Tequal`` against the standard IEEE float and integer
types. Anything it does not plainly accept goes to the high-level checks (`check_dataset`,
`_refuse_link`), which make the refusal.

`protocol.weights` runs it on every weight file it opens; the admin API runs it on every upload
(fedsplit or Keras layout) inside its sandboxed parser.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

import h5py
import h5py.h5pl
import numpy as np
from fedsplit.protocol.errors import WeightFileError
from h5py import h5d, h5g, h5l, h5o, h5s, h5t

#: HDF5 filter ids allowed in an upload: deflate (gzip), shuffle, fletcher32.
ALLOWED_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32"}
#: Objects (groups + datasets) one file may hold.
MAX_OBJECTS = 100_000
#: Chunks all of a file's chunked datasets may declare together. HDF5 keeps an index entry per
#: chunk and reading pays for each: a 7 KB file declaring 10^6 one-value chunks made its reader
#: peak at 3.75 GiB; a real model's chunks are tens of KiB (h5py's own chunking: 8 KiB to 1 MiB).
MAX_CHUNKS = 32_768
#: Smallest chunk, in bytes, of a dataset stored in more than `SMALL_CHUNKS_ALLOWED` chunks.
MIN_CHUNK_BYTES = 1024
SMALL_CHUNKS_ALLOWED = 256


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


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that puts 'vars/2' before 'vars/10'."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGITS.split(name) if t)


#: `natural_key` of names up to this long is remembered (files of one model repeat their names)
_CACHED_KEY_CHARS = 256
_cached_natural_key = functools.lru_cache(maxsize=4096)(natural_key)


def _sort_key(name: str) -> tuple[tuple[int, int, str], ...]:
    return _cached_natural_key(name) if len(name) <= _CACHED_KEY_CHARS else natural_key(name)


def walk(f: h5py.File, *, where: str, max_depth: int, max_elements: int) -> Tree:
    """Check the whole file's structure and return its groups and datasets.

    ``where`` starts every message ("Weight file x.h5", "The uploaded file"). Uses h5py's
    low-level API (a few microseconds an object, each property asked of HDF5 once); anything
    unusual (a link that is not a hard link, an object that is neither group nor dataset, a
    dataset the fast check does not accept) is handed to the high-level checks, which make the
    refusal.
    """
    walker = _Walk(where, max_depth, max_elements)
    walker.group(h5g.open(f.id, b"/"), "", 0)
    return walker.tree


def _links(gid: h5g.GroupID) -> dict[str, tuple[bytes, int | None]]:
    """The group's links by name: (raw name, the object's address for a hard link, else None).

    One pass over the group (``H5Literate``); a group whose links h5py cannot describe that way
    is listed link by link, a link it cannot describe at all counting as not hard.
    """
    found: list[tuple[bytes, int | None]] = []

    def visit(raw: bytes, info: Any) -> None:
        found.append((raw, info.u if info.type == h5l.TYPE_HARD else None))

    try:
        gid.links.iterate(visit, info=True)
    except Exception:  # described link by link below
        found = []
        for raw in gid:
            try:
                info = gid.links.get_info(raw)
                found.append((raw, info.u if info.type == h5l.TYPE_HARD else None))
            except Exception:  # h5py cannot even describe this link: the high-level check refuses
                found.append((raw, None))
    return {raw.decode("utf-8", "surrogateescape"): (raw, address) for raw, address in found}


class _Walk:
    """One structure walk: its limits, what it found, the object addresses it has seen, and the
    plain type the last dataset had (the next dataset's type is compared with it first)."""

    __slots__ = ("chunks", "last_type", "max_depth", "max_elements", "seen", "tree", "where")

    def __init__(self, where: str, max_depth: int, max_elements: int) -> None:
        self.where = where
        self.max_depth = max_depth
        self.max_elements = max_elements
        self.tree = Tree()
        self.seen: set[int] = set()
        self.last_type: tuple[h5t.TypeID, np.dtype, np.dtype] | None = None
        self.chunks = 0  # chunks declared so far, every dataset together

    def count_chunks(self, count: int, path: str) -> None:
        """Add a dataset's chunks to the file's total; refuse past `MAX_CHUNKS`."""
        self.chunks += count
        if self.chunks > MAX_CHUNKS:
            raise WeightFileError(
                f"{self.where} declares more than {MAX_CHUNKS} HDF5 chunks (at /{path} the total "
                f"reached {self.chunks}); each chunk costs the reader memory and time. Save the "
                f"weights unchunked, or with h5py's default chunking. Received: > {MAX_CHUNKS} chunks",
                reason="chunks",
            )

    def group(self, gid: h5g.GroupID, prefix: str, depth: int) -> None:
        """Check group ``gid`` (at ``/prefix``) and everything under it."""
        where = self.where
        if depth > self.max_depth:
            raise WeightFileError(
                f"{where} nests groups deeper than {self.max_depth} levels at /{prefix}; weight "
                f"files are shallow (fedsplit: /arrays/NAME, Keras: layers/NAME/vars/N). "
                f"Received: depth > {self.max_depth}",
                reason="too_deep",
            )
        links = _links(gid)
        seen = self.seen
        after_dataset = False  # the previous object here was a dataset: this one likely is too
        for name in sorted(links, key=_sort_key):
            raw, address = links[name]
            path = f"{prefix}{name}"
            if address is None:
                _refuse_link(h5py.Group(gid), name, path, where)
            # a hard link gives its object's address (one file: one address space), so a link
            # to an address already seen is a second hard link to that object
            if address in seen:
                raise WeightFileError(
                    f"{where}: /{path} is a second hard link to an object already seen; every "
                    f"group and parameter must appear once (aliases make cycles and duplicate "
                    f"weights). Received: /{path}",
                    reason="link",
                )
            seen.add(address)
            if len(seen) > MAX_OBJECTS:
                raise WeightFileError(
                    f"{where} holds more than {MAX_OBJECTS} groups and datasets; no model needs "
                    f"that many. Received: > {MAX_OBJECTS} objects",
                    reason="too_many_objects",
                )
            obj: Any = None
            if after_dataset:  # opening it as a dataset skips h5o's type lookup
                try:
                    obj = h5d.open(gid, raw)
                except Exception:  # not a dataset: opened as any object below
                    obj = None
            if obj is None:
                obj = h5o.open(gid, raw)
            after_dataset = isinstance(obj, h5d.DatasetID)
            if after_dataset:
                info = self.dataset(obj, path)
                if info is None:  # something the fast check does not accept: the full check decides
                    dataset = h5py.Dataset(obj)
                    info = check_dataset(dataset, f"/{path}", self.max_elements, where)
                    if dataset.chunks is not None:
                        self.count_chunks(chunk_count(info.shape, dataset.chunks), path)
                self.tree.datasets.append(info)
            elif isinstance(obj, h5g.GroupID):
                self.tree.groups.append(path)
                self.group(obj, f"{path}/", depth + 1)
            else:
                kind = type(h5py.Group(gid)[name]).__name__
                raise WeightFileError(
                    f"{where}: /{path} is a {kind}; a weight file holds only groups and "
                    f"datasets. Received: /{path}",
                    reason="unexpected_object",
                )

    def dataset(self, dsid: h5d.DatasetID, path: str) -> DatasetInfo | None:
        """The dataset's info when it plainly passes `check_dataset`, else None.

        Accepts only: not virtual, no external storage, allowed filters, a simple or scalar
        dataspace within ``max_elements``, and a type that is exactly a standard IEEE float or
        integer type (`_PLAIN_TYPES`). Each property is asked of HDF5 once.
        """
        offset = _plain_contiguous(dsid)  # the values' offset when stored as plain bytes
        chunk: tuple[int, ...] | None = None
        if offset is None:  # anything else: the creation property list tells
            plist = dsid.get_create_plist()
            layout = plist.get_layout()
            if layout == h5d.CHUNKED:
                chunk = tuple(int(c) for c in plist.get_chunk())
            if layout == h5d.VIRTUAL or plist.get_external_count() > 0:
                return None
            nfilters = plist.get_nfilters()
            if nfilters and any(plist.get_filter(i)[0] not in ALLOWED_FILTERS
                                for i in range(nfilters)):
                return None
            if layout == h5d.CONTIGUOUS and not nfilters:  # and no external storage
                offset = dsid.get_offset()
        space = dsid.get_space()
        shape = space.get_simple_extent_dims()  # dims (only simple dataspaces have any), ()
        # when scalar, None when null
        if not shape and (shape is None or space.get_simple_extent_type() != h5s.SCALAR):
            return None
        if math.prod(shape) > self.max_elements:
            return None
        tid = dsid.get_type()
        plain = self.last_type
        if plain is None or not tid.equal(plain[0]):
            plain = _plain_entry(tid)
            if plain is None:
                return None
            self.last_type = plain
        _std, dtype, native = plain
        if chunk is not None:
            check_chunks(shape, chunk, dtype.itemsize, f"/{path}", self.where)
            self.count_chunks(chunk_count(shape, chunk), path)
        if offset is not None and (not dtype.isnative or offset % dtype.itemsize):
            offset = None  # mapped as it lies only in this machine's byte order, aligned
        return DatasetInfo(path, shape, native, offset)


def chunk_count(shape: tuple[int, ...], chunk: tuple[int, ...]) -> int:
    """How many chunks a dataset of ``shape`` stored in chunks of ``chunk`` declares."""
    return math.prod(-(-int(n) // max(1, int(c))) for n, c in zip(shape, chunk, strict=False))


def check_chunks(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, path: str,
                 where: str) -> None:
    """Refuse (``chunks``) a dataset declaring more than `MAX_CHUNKS` chunks, or more than
    `SMALL_CHUNKS_ALLOWED` chunks smaller than `MIN_CHUNK_BYTES`, from the metadata alone."""
    count = chunk_count(shape, chunk)
    chunk_bytes = math.prod(chunk) * itemsize
    if count > MAX_CHUNKS or (count > SMALL_CHUNKS_ALLOWED and chunk_bytes < MIN_CHUNK_BYTES):
        raise WeightFileError(
            f"{where}: {path} is stored in {count} chunks of {chunk_bytes} bytes (shape {shape}, "
            f"chunks {chunk}); at most {MAX_CHUNKS} chunks, and chunks of at least "
            f"{MIN_CHUNK_BYTES} bytes past {SMALL_CHUNKS_ALLOWED} of them, are accepted (each "
            f"chunk costs the reader memory and time). Save the weights unchunked, or with "
            f"h5py's default chunking. Received: chunks {chunk}",
            reason="chunks",
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


def _plain_types() -> dict[tuple[int, int], tuple[tuple[h5t.TypeID, np.dtype, np.dtype], ...]]:
    """(class, size) -> (HDF5 type, its numpy dtype, that dtype in native byte order) for every
    standard IEEE float (16/32/64 bits) and integer (8 to 64 bits, signed or not), little- and
    big-endian."""
    table: dict[tuple[int, int], list[tuple[h5t.TypeID, np.dtype, np.dtype]]] = {}
    kinds = [(h5t.FLOAT, n, "IEEE_F", "f") for n in (2, 4, 8)]
    kinds += [(h5t.INTEGER, n, f"STD_{k.upper()}", k) for n in (1, 2, 4, 8) for k in "iu"]
    for cls, size, h5name, kind in kinds:
        for order, suffix in (("<", "LE"), (">", "BE")):
            dtype = np.dtype(f"{order}{kind}{size}")
            std = getattr(h5t, f"{h5name}{size * 8}{suffix}")
            native = np.dtype(dtype.type)  # numpy's own instance: `in` and `==` find it first
            table.setdefault((cls, size), []).append((std, dtype, native))
    return {key: tuple(entries) for key, entries in table.items()}


#: the plain numeric types the fast check accepts, by (class, size): a dataset's type must equal
#: one of them (``H5Tequal``: byte order, precision, offset, bit fields, exponent bias, padding),
#: so a float of another bit layout, which h5py still calls float32 and HDF5 converts when
#: reading, is never taken for a plain one (nor read as it lies)
_PLAIN_TYPES = _plain_types()


def _plain_entry(tid: h5t.TypeID) -> tuple[h5t.TypeID, np.dtype, np.dtype] | None:
    """The `_PLAIN_TYPES` entry ``tid`` is equal to, else None."""
    for entry in _PLAIN_TYPES.get((tid.get_class(), tid.get_size()), ()):
        if tid.equal(entry[0]):
            return entry
    return None


def plain_type(tid: h5t.TypeID) -> tuple[np.dtype, h5t.TypeID] | None:
    """(numpy dtype, standard HDF5 type) of HDF5 type ``tid`` when it is exactly a standard IEEE
    float or integer type (the dtype is the one h5py gives for it; the standard type reads it
    without conversion), else None."""
    entry = _plain_entry(tid)
    return None if entry is None else (entry[1], entry[0])


#: object header message types (HDF5 file format ids) every dataset's header holds: dataspace
#: (0x01), datatype (0x03), data layout (0x08)
_DATASET_MESSAGES = (1 << 0x01) | (1 << 0x03) | (1 << 0x08)
#: ... and those that put a dataset's values anywhere but as plain bytes in the file: external
#: file list (0x07: raw storage in other files), filter pipeline (0x0B)
_STORAGE_MESSAGES = (1 << 0x07) | (1 << 0x0B)


def _plain_contiguous(dsid: h5d.DatasetID) -> int | None:
    """The dataset's file offset when its object header shows it is stored as plain bytes in the
    file: contiguous (only contiguous storage has an offset: chunked, compact and virtual
    datasets have none), with no external file list and no filter pipeline message; else None
    (the creation property list then tells).

    What the creation property list would say (`check_dataset`, `mappable_offset`), read from
    the header HDF5 builds it from, without building it (a third of the walk's time per
    dataset); a header summary that lacks the messages every dataset has is not trusted.
    """
    offset = dsid.get_offset()
    if offset is None:
        return None
    try:
        present = h5o.get_info(dsid).hdr.mesg.present
    except Exception:  # no header summary from this h5py: the property list tells
        return None
    if present & _DATASET_MESSAGES != _DATASET_MESSAGES or present & _STORAGE_MESSAGES:
        return None
    return int(offset)


def mappable_offset(dsid: h5d.DatasetID, plist: Any, dtype: np.dtype) -> int | None:
    """The file offset of the dataset's values when they can be mapped as they lie (contiguous,
    in the file itself, unfiltered, a standard type in native byte order, aligned), else None.
    ``plist`` and ``dtype`` are the dataset's creation property list and numpy dtype."""
    if (plist.get_layout() != h5d.CONTIGUOUS or plist.get_nfilters()
            or plist.get_external_count()):
        return None
    found = plain_type(dsid.get_type()) if dtype.isnative else None
    if found is None or found[0] != dtype:
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
            f"{where}: {path} has a null dataspace (no shape, no values); weight files hold "
            f"arrays. Write the parameter's values. Received: shape None",
            reason="dtype",
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
    if ds.chunks is not None:
        check_chunks(tuple(ds.shape), tuple(ds.chunks), dtype.itemsize, path, where)
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

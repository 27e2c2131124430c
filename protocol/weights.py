"""The fedsplit weight file: HDF5, ``format_version`` 1 (docs/weights-format.md).

Layout::

    / (root) attributes
      format          = "fedsplit.weights"
      format_version  = 1
      num_examples    = integer >= 1      # the sample count these weights were trained on
      site            = string            # optional
      round           = integer           # optional
      model           = string            # optional architecture id
      schema          = string            # optional: the table schema the model reads (JSON,
                                          # protocol.schema, format "fedsplit.schema" version 1)
    /arrays           group, one dataset per parameter, named by its state_dict key
                      dtype float16/float32/float64
    /arrays attribute "order" = the parameter names in model order

This module is the only code that reads or writes the format. The reader is strict: weight
files come from other institutions, so anything that is not exactly the layout above (links,
external storage, virtual datasets, nested groups, filter plugins, non-float data, NaN/Inf)
is refused with a `WeightFileError` that names the problem. The writer is atomic: a reader
never sees a half-written file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import h5py
import numpy as np
from fedsplit.protocol.arrays import ALLOWED_DTYPES, ArraySpec, check_array, check_num_examples
from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.errors import UpdateError, WeightFileError
from fedsplit.protocol.h5safety import UNKNOWN, DatasetInfo, mappable_offset, plain_type, walk
from fedsplit.protocol.update import Update, UpdateHeader
from h5py import h5a, h5d, h5g, h5s, h5t

FORMAT = "fedsplit.weights"
FORMAT_VERSION = 1
ARRAYS_GROUP = "arrays"
ORDER_ATTR = "order"
SUFFIXES = (".h5", ".hdf5")

_NO_LIMIT = 2**62  # per-parameter size limit when the caller sets none

PathOrFile = str | os.PathLike[str] | IO[bytes]


def _describe(source: PathOrFile) -> str:
    return str(source) if isinstance(source, str | os.PathLike) else "<uploaded file>"


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "SUO":
        return _text(value.item())
    return None


#: an attribute that is not there (`_attr`)
_MISSING = object()

#: (numpy dtype, h5py memory type) to read variable-length strings with, by HDF5 character
#: set: what h5py's high-level attribute reader uses for them
_VLEN_STRINGS = {
    cset: (dtype, h5t.py_create(dtype))
    for cset, dtype in (
        (h5t.CSET_ASCII, h5py.string_dtype("ascii")),
        (h5t.CSET_UTF8, h5py.string_dtype("utf-8")),
    )
}


def _attr(gid: h5g.GroupID, name: str, default: Any = None) -> Any:
    """Attribute ``name`` of the group ``gid`` as ``h5py.Group(gid).attrs[name]`` gives it, or
    ``default`` when there is none.

    The kinds of attribute `write_weights` writes (a scalar standard integer or float, a scalar
    or 1-D variable-length string) are read with h5py's low-level calls, the way its high-level
    reader reads them (same values, types and dtypes) but without its per-read type building
    (about 40 us an attribute against 15); every other attribute goes through that reader.
    """
    key = name.encode("utf-8")
    if not h5a.exists(gid, key):
        return default
    attr = h5a.open(gid, key)
    space = attr.get_space()
    extent = space.get_simple_extent_type()
    tid = attr.get_type()
    if extent == h5s.SCALAR:
        plain = plain_type(tid)
        if plain is not None:
            value = np.zeros((), plain[0])
            attr.read(value, mtype=plain[1])
            return value[()]
    strings = (
        _VLEN_STRINGS.get(tid.get_cset())
        if isinstance(tid, h5t.TypeStringID) and tid.is_variable_str() else None
    )
    if strings is not None and (
        extent == h5s.SCALAR or (extent == h5s.SIMPLE and space.get_simple_extent_ndims() == 1)
    ):
        dtype, mtype = strings
        raw = np.zeros(space.get_simple_extent_dims(), dtype)
        attr.read(raw, mtype=mtype)
        text = [b.decode("utf-8", "surrogateescape") for b in raw.flat]
        if extent == h5s.SCALAR:
            return text[0]
        return np.array(text, dtype=dtype).reshape(raw.shape)
    return h5py.Group(gid).attrs[name]


def _optional_int(gid: h5g.GroupID, key: str, where: str) -> int | None:
    value = _attr(gid, key, _MISSING)
    if value is _MISSING:
        return None
    if isinstance(value, np.ndarray | np.generic) and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise WeightFileError(
            f"{where}: root attribute {key!r} must be an integer. Received: {value!r}",
            reason="wrong_format",
        )
    return int(value)


class WeightFile:
    """An open, structurally validated weight file; parameters are read on demand.

    Use `open_weights`, not this constructor. Implements `protocol.update.UpdateSource`, so
    strategies can stream parameters from disk one at a time.
    """

    def __init__(
        self,
        handle: h5py.File,
        header: UpdateHeader,
        where: str,
        offsets: dict[str, int | None] | None = None,
    ) -> None:
        self._file = handle
        # where each parameter's values lie when `walk` saw they can be mapped (None: they
        # cannot); a parameter missing here is inspected when first mapped
        self._offsets = dict(offsets or {})
        self._header = header
        self._where = where
        self._group_id: Any = None  # low-level id of /arrays, looked up once
        self._dataset_ids: dict[str, Any] = {}  # low-level dataset ids by parameter name
        self._specs = {spec.name: spec for spec in header.specs}
        self._close_hooks: list[Callable[[], None]] = []  # `on_close`
        # the file's size when opened (sec2 driver: a path): reads past it are refused
        self._size = (
            os.fstat(handle.id.get_vfd_handle()).st_size if handle.driver == "sec2" else 0
        )

    @property
    def header(self) -> UpdateHeader:
        """Counts, names, shapes and dtypes (``num_examples`` 0 means the file carries none)."""
        return self._header

    def relabel(self, site: str) -> None:
        """Name this update ``site`` in reports (the file itself is not changed)."""
        self._header = dataclasses.replace(self._header, site=site)

    def recount(self, num_examples: int) -> None:
        """Weight this update by ``num_examples`` (checked >= 1) instead of the file's own count
        (the file itself is not changed): the admin API's count recorded at upload."""
        count = check_num_examples(num_examples, where=self._where)
        self._header = dataclasses.replace(self._header, num_examples=count)

    def dataset(self, name: str) -> h5py.Dataset:
        """Return the validated HDF5 dataset of parameter ``name`` (for block-wise reads)."""
        if name not in self._header.names:
            raise WeightFileError(
                f"{self._where} has no parameter {name!r}. Its parameters: "
                f"{', '.join(self._header.names)}. Received: {name!r}"
            )
        return self._file[ARRAYS_GROUP][name]

    def array(self, name: str) -> np.ndarray:
        """Return parameter ``name`` in native byte order, checked finite."""
        dataset = self.dataset(name)
        try:
            raw = np.asarray(dataset[()])
        except (OSError, RuntimeError) as e:  # damaged or unreadable chunks
            raise self._unreadable(name, e) from e
        self._check_not_shrunk(name)
        arr = raw.astype(raw.dtype.newbyteorder("="), copy=False)
        try:
            return check_array(name, arr, where=self._where)
        except UpdateError as e:
            raise WeightFileError(str(e), reason=e.reason) from e

    def read_into(
        self,
        name: str,
        out: np.ndarray,
        *,
        start: tuple[int, ...] | None = None,
        count: tuple[int, ...] | None = None,
    ) -> None:
        """Read parameter ``name`` (whole, or the hyperslab ``start``/``count``) into ``out``.

        ``out`` is a C-contiguous 1-D float buffer (float16, float32 or float64) holding exactly
        the values read, in C order; HDF5 converts byte order and precision on the way. This is
        the fast path for block-wise passes: it uses HDF5's low-level dataset ids (cached per
        file, the /arrays group looked up once) instead of h5py's selection machinery, which
        costs about a millisecond a call. Values are not checked finite here (callers that scan
        blocks do); a damaged file raises `WeightFileError` with reason ``corrupt``.
        """
        spec = self._spec(name)
        shape = tuple(spec.shape)
        if (start is None) != (count is None):
            raise WeightFileError(
                f"{self._where}: read_into takes both start and count (a hyperslab) or neither "
                f"(the whole parameter). Received: start={start!r}, count={count!r}",
                reason="read_into",
            )
        if start is not None and count is not None:
            start, count = tuple(int(i) for i in start), tuple(int(n) for n in count)
            if (
                len(start) != len(shape)
                or len(count) != len(shape)
                or any(i < 0 or n < 0 or i + n > d for i, n, d in zip(start, count, shape, strict=True))
            ):
                raise WeightFileError(
                    f"{self._where}: the hyperslab must lie inside parameter {name!r} of shape "
                    f"{shape} (one start and one count per axis). Received: start={start}, "
                    f"count={count}",
                    reason="read_into",
                )
            size = int(np.prod(count, dtype=np.int64))
        else:
            size = spec.size
        if (
            not isinstance(out, np.ndarray)
            or out.ndim != 1
            or not out.flags.c_contiguous
            or not out.flags.writeable
            or out.dtype.kind != "f"
            or out.size != size
        ):
            got = (
                f"shape {out.shape}, dtype {out.dtype}, contiguous {out.flags.c_contiguous}"
                if isinstance(out, np.ndarray) else type(out).__name__
            )
            raise WeightFileError(
                f"{self._where}: read_into needs a writeable C-contiguous 1-D float buffer of "
                f"exactly {size} values for parameter {name!r}. Received: {got}",
                reason="read_into",
            )
        if size == 0:
            return
        try:
            dsid = self._dataset_ids.get(name)
            if dsid is None:
                if self._group_id is None:
                    self._group_id = self._file[ARRAYS_GROUP].id
                dsid = self._dataset_ids[name] = h5d.open(self._group_id, name.encode("utf-8"))
            if start is None:
                dsid.read(h5s.ALL, h5s.ALL, out.reshape(shape))
            else:
                fspace = dsid.get_space()
                fspace.select_hyperslab(start, count)
                dsid.read(h5s.create_simple((size,)), fspace, out)
        except (OSError, RuntimeError, KeyError) as e:  # damaged or unreadable chunks
            raise self._unreadable(name, e) from e
        self._check_not_shrunk(name)

    def _unreadable(self, name: str, error: Exception) -> WeightFileError:
        """The refusal of parameter ``name``, whose values HDF5 could not read (damaged chunks)."""
        return WeightFileError(
            f"{self._where}: parameter {name!r} could not be read ({error}); the file is damaged. "
            f"Re-export or re-upload it. Received: {name!r}",
            reason="corrupt",
        )

    def _check_not_shrunk(self, name: str) -> None:
        """Refuse values read from a file that is now shorter than when it was opened: HDF5
        fills a read past the end with zeros instead of failing (a file opened from a path)."""
        if not self._size:
            return
        try:
            now = os.fstat(self._file.id.get_vfd_handle()).st_size
        except (OSError, ValueError, RuntimeError):
            return  # closed: HDF5's own call failed first
        if now < self._size:
            raise WeightFileError(
                f"{self._where}: the file shrank from {self._size} to {now} bytes while open, so "
                f"parameter {name!r} cannot be trusted (HDF5 reads zeros past the end); it was "
                f"truncated or rewritten in place. Send it again. Received: {now} bytes",
                reason="corrupt",
            )

    # -- for readers of the values where they lie (aggregation._filereads) --------------------
    @property
    def where(self) -> str:
        """How errors name this file (``Weight file 'x.h5'``)."""
        return self._where

    @property
    def opened_size(self) -> int:
        """The file's size in bytes when it was opened from a path (0: a file object)."""
        return self._size

    def vfd_handle(self) -> int | None:
        """HDF5's own descriptor of the file when it was opened from a path (sec2 driver), else
        None. Valid until `close`; duplicate it to keep it."""
        return self._file.id.get_vfd_handle() if self._file.driver == "sec2" else None

    def spec(self, name: str) -> ArraySpec:
        """Parameter ``name``'s spec (shape and dtype); `WeightFileError` for an unknown name."""
        return self._spec(name)

    def storage_offset(self, name: str) -> int | None:
        """Byte offset of parameter ``name``'s first value when its values lie in the file as
        they are (contiguous, unfiltered, allocated, aligned, this machine's byte order:
        `h5safety.mappable_offset`), else None; looked up once."""
        return self._offset_of(name, self._spec(name))

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when this file is closed, before HDF5 closes it (readers that keep a
        mapping or a descriptor of the file release them)."""
        self._close_hooks.append(hook)

    def _offset_of(self, name: str, spec: ArraySpec) -> int | None:
        """Where parameter ``name``'s values lie in the file when they can be read as they lie
        (`h5safety.mappable_offset`), else None; looked up once."""
        if name in self._offsets:  # the structure check already saw the storage
            return self._offsets[name]
        if self._group_id is None:
            self._group_id = self._file[ARRAYS_GROUP].id
        dsid = self._dataset_ids.get(name)
        if dsid is None:
            dsid = self._dataset_ids[name] = h5d.open(self._group_id, name.encode("utf-8"))
        offset = None
        if dsid.dtype.newbyteorder("=") == spec.dtype:
            offset = mappable_offset(dsid, dsid.get_create_plist(), dsid.dtype)
        self._offsets[name] = offset
        return offset

    def _spec(self, name: str) -> ArraySpec:
        spec = self._specs.get(name)
        if spec is not None:
            return spec
        raise WeightFileError(
            f"{self._where} has no parameter {name!r}. Its parameters: "
            f"{', '.join(self._header.names)}. Received: {name!r}"
        )

    def to_update(self, num_examples: int | None = None) -> Update:
        """Read every parameter and return an in-memory `Update`."""
        h = self._header
        count = num_examples if num_examples is not None else h.num_examples
        try:
            return Update(
                arrays={name: self.array(name) for name in h.names},
                num_examples=check_num_examples(count, where=self._where),
                site=h.site,
                round=h.round,
                model=h.model,
            )
        except UpdateError as e:
            raise WeightFileError(str(e), reason=e.reason) from e

    def close(self) -> None:
        """Close the underlying HDF5 file (after the `on_close` hooks)."""
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook()
        self._dataset_ids.clear()
        self._group_id = None
        self._file.close()

    def __enter__(self) -> WeightFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_weights(
    source: PathOrFile,
    *,
    require_num_examples: bool = True,
    max_elements: int | None = None,
    default_site: str | None = None,
) -> WeightFile:
    """Open and validate a weight file's structure; values are checked as they are read.

    Parameters
    ----------
    source : path or binary file object
        The file to read. A file object (e.g. an upload being processed) must be seekable.
    require_num_examples : bool (default: True)
        Refuse a file without ``num_examples``. When False, such a file opens with
        ``header.num_examples == 0`` and the caller supplies the count.
    max_elements : int | None (default: None)
        Refuse files whose parameters hold more elements than this in total (shape bombs).
    default_site : str | None (default: None)
        Site label for reports when the file has no ``site`` attribute (e.g. its file name).
    """
    where = f"Weight file {_describe(source)}"
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.is_file():
            raise WeightFileError(f"{where} does not exist or is not a file. Received: {path}",
                                  reason="missing")
        if not h5py.is_hdf5(path):
            raise WeightFileError(
                f"{where} is not an HDF5 file. fedsplit weight files are HDF5 (.h5); write one "
                f"with `fedsplit export` or protocol.write_weights. Received: {path.name}",
                reason="not_hdf5",
            )
    try:
        handle = h5py.File(source, "r")
    except (OSError, ValueError) as e:
        raise WeightFileError(
            f"{where} is not a readable HDF5 file ({e}). fedsplit weight files are HDF5 (.h5). "
            f"Received: {_describe(source)}",
            reason="corrupt",
        ) from e
    try:
        header, offsets = _validate(handle, where, require_num_examples, max_elements)
        if header.site is None and default_site is not None:
            header = dataclasses.replace(header, site=default_site)
    except BaseException:
        handle.close()
        raise
    return WeightFile(handle, header, where, offsets)


def _validate(
    f: h5py.File, where: str, require_num_examples: bool, max_elements: int | None
) -> tuple[UpdateHeader, dict[str, int | None]]:
    """The file's header, and where each parameter's values lie when they can be mapped."""
    root = h5g.open(f.id, b"/")
    fmt = _text(_attr(root, "format"))
    if fmt != FORMAT:
        raise WeightFileError(
            f"{where} is HDF5 but not a fedsplit weight file: root attribute 'format' must be "
            f"{FORMAT!r}. Keras or plain torch files must be converted first (`fedsplit export`). "
            f"Received: format={fmt!r}",
            reason="wrong_format",
        )
    version = _optional_int(root, "format_version", where)
    if version != FORMAT_VERSION:
        raise WeightFileError(
            f"{where} has format_version {version}; this fedsplit reads version "
            f"{FORMAT_VERSION}. Upgrade fedsplit or re-export the file. Received: {version!r}",
            reason="wrong_format",
        )
    _check_schema(f, where, root)
    raw = _attr(root, "num_examples", _MISSING)
    if raw is not _MISSING:
        if isinstance(raw, np.ndarray | np.generic) and np.ndim(raw) == 0:
            raw = raw.item()
        if isinstance(raw, bool | np.bool_) or not isinstance(raw, int | np.integer):
            raise WeightFileError(
                f"{where}: root attribute 'num_examples' must be an integer >= 1 (the number of "
                f"training rows behind these weights). Received: {raw!r}",
                reason="num_examples",
            )
        try:
            num_examples = check_num_examples(int(raw), where=where)
        except UpdateError as e:
            raise WeightFileError(str(e), reason=e.reason) from e
    elif require_num_examples:
        raise WeightFileError(
            f"{where} has no 'num_examples' root attribute; FedAvg weights every update by its "
            f"sample count. Re-export with --num-examples N. Received: attributes "
            f"{sorted(f.attrs.keys())}",
            reason="num_examples",
        )
    else:
        num_examples = 0

    # Links, storage, filters, dtype kinds and declared sizes: checked before any value is read.
    tree = walk(f, where=where, max_depth=2, max_elements=max_elements or _NO_LIMIT)
    prefix = f"{ARRAYS_GROUP}/"
    for group_path in tree.groups:
        if group_path.startswith(prefix):
            raise WeightFileError(
                f"{where}: /{group_path} is a group; nested groups are not allowed in "
                f"/{ARRAYS_GROUP} (flatten names as 'layer.0.weight'). Received: /{group_path}",
                reason="nested_group",
            )
        if group_path != ARRAYS_GROUP:
            raise WeightFileError(
                f"{where}: unexpected object /{group_path} at the root; only /{ARRAYS_GROUP} is "
                f"allowed. Received: /{group_path}",
                reason="unexpected_object",
            )
    for info in tree.datasets:
        if not info.path.startswith(prefix):
            raise WeightFileError(
                f"{where}: unexpected object /{info.path} at the root; only /{ARRAYS_GROUP} is "
                f"allowed. Received: /{info.path}",
                reason="unexpected_object",
            )
    if ARRAYS_GROUP not in tree.groups:
        raise WeightFileError(
            f"{where} has no /{ARRAYS_GROUP} group holding the parameters. Received: root "
            f"entries {list(f.keys())}",
            reason="wrong_format",
        )
    group = h5g.open(f.id, ARRAYS_GROUP.encode())
    datasets = {info.path[len(prefix):]: info for info in tree.datasets}
    order_raw = _attr(group, ORDER_ATTR)
    if order_raw is None:
        raise WeightFileError(
            f"{where}: /{ARRAYS_GROUP} lacks the {ORDER_ATTR!r} attribute listing parameter names "
            f"in model order. Received: attributes {sorted(h5py.Group(group).attrs.keys())}",
            reason="order",
        )
    if isinstance(order_raw, np.ndarray) and order_raw.ndim == 1 and order_raw.dtype == object:
        order = order_raw.tolist()  # what `write_weights` writes: a list of str, kept as it is
        if not all(type(v) is str for v in order):  # anything else: `_text` each
            order = [_text(v) for v in order]
    else:
        order = [_text(v) for v in np.atleast_1d(np.asarray(order_raw, dtype=object))]
    if any(v is None for v in order):
        raise WeightFileError(
            f"{where}: /{ARRAYS_GROUP}.{ORDER_ATTR} must be a list of strings. "
            f"Received: {order_raw!r}",
            reason="order",
        )
    if len(set(order)) != len(order):
        dup = next(n for n in order if order.count(n) > 1)
        raise WeightFileError(
            f"{where}: parameter {dup!r} is listed twice in {ORDER_ATTR}. Received: {order}",
            reason="order",
        )
    for name in order:
        if name not in datasets:
            raise WeightFileError(
                f"{where}: {name!r} is listed in {ORDER_ATTR} but has no dataset in "
                f"/{ARRAYS_GROUP}. Received: datasets {list(datasets)}",
                reason="order",
            )
    listed = set(order)
    for name in datasets:
        if name not in listed:
            raise WeightFileError(
                f"{where}: dataset /{ARRAYS_GROUP}/{name} is not listed in {ORDER_ATTR}; every "
                f"parameter must be named there in model order. Received: order {order}",
                reason="order",
            )

    specs = []
    total = 0
    for name in order:
        info = datasets[name]
        specs.append(parameter_spec(name, info, where))
        total += math.prod(info.shape)  # the spec's size
        if max_elements is not None and total > max_elements:
            raise WeightFileError(
                f"{where} declares more than {max_elements} parameter values in total; this "
                f"coordinator refuses models that large. Received: > {max_elements} at {name!r}",
                reason="too_large",
            )
    offsets = {
        name: info.offset for name, info in datasets.items() if info.offset is not UNKNOWN
    }
    header = UpdateHeader(
        num_examples=num_examples,
        specs=tuple(specs),
        site=_text(_attr(root, "site")),
        round=_optional_int(root, "round", where),
        model=_text(_attr(root, "model")),
    )
    return header, offsets


def parameter_spec(name: str, info: DatasetInfo, where: str) -> ArraySpec:
    """Dataset ``info`` as parameter ``name``, refused unless its dtype is float16, 32 or 64."""
    if info.dtype not in ALLOWED_DTYPES:
        raise WeightFileError(
            f"{where}: /{info.path} has dtype {info.dtype}; parameters must be float16, "
            f"float32 or float64. Received: dtype={info.dtype}",
            reason="dtype",
        )
    return ArraySpec(name, info.shape, info.dtype)


def _schema_text(f: h5py.File, where: str, root: h5g.GroupID | None = None) -> str | None:
    """The file's ``schema`` root attribute (``root``: its root group, when open already)."""
    value = _attr(h5g.open(f.id, b"/") if root is None else root, "schema", _MISSING)
    if value is _MISSING:
        return None
    text = _text(value)
    if text is None:
        raise WeightFileError(f"{where}: root attribute 'schema' must be a JSON string. "
                              f"Received: {type(value).__name__}", reason="schema")
    return text


def _check_schema(f: h5py.File, where: str, root: h5g.GroupID | None = None) -> None:
    text = _schema_text(f, where, root)
    if text is None:
        return
    from fedsplit.protocol.schema import Schema  # loaded only for a file that carries one

    try:
        Schema.from_json(text)
    except Exception as e:  # ConfigError from the strict schema reader
        raise WeightFileError(f"{where}: root attribute 'schema' is not a valid table schema: {e}",
                              reason="schema") from e


def read_schema(source: PathOrFile) -> str | None:
    """The table schema (JSON, validated) stored with a weight file's model, or None."""
    with open_weights(source, require_num_examples=False) as wf:
        return _schema_text(wf._file, _describe(source))


def read_weights(source: PathOrFile, *, num_examples: int | None = None) -> Update:
    """Read and fully validate a weight file into an `Update`.

    ``num_examples`` overrides (or supplies) the file's sample count.
    """
    with open_weights(source, require_num_examples=num_examples is None) as wf:
        return wf.to_update(num_examples)


def write_weights(update: Update, path: str | os.PathLike[str], *, compress: bool = False,
                  schema: str | None = None) -> Path:
    """Write ``update`` to ``path`` atomically (temp file, fsync, rename) and return the path.

    ``schema``: the table schema (JSON) the model reads, stored as the ``schema`` attribute.
    """
    if schema is not None:
        from fedsplit.protocol.schema import Schema

        Schema.from_json(schema)  # never write a schema the reader would refuse
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        raise WeightFileError(
            f"Weight files must end in {' or '.join(SUFFIXES)}. Received: {target.name}"
        )
    with atomic_path(target) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = np.int64(FORMAT_VERSION)
        f.attrs["num_examples"] = np.int64(update.num_examples)
        if update.site is not None:
            f.attrs["site"] = str(update.site)
        if update.round is not None:
            f.attrs["round"] = np.int64(update.round)
        if update.model is not None:
            f.attrs["model"] = str(update.model)
        if schema is not None:
            f.attrs["schema"] = str(schema)
        group = f.create_group(ARRAYS_GROUP)
        names = list(update.arrays)
        group.attrs[ORDER_ATTR] = np.array(names, dtype=h5py.string_dtype())
        for name, arr in update.arrays.items():
            kwargs: dict[str, Any] = {"compression": "gzip"} if compress and arr.ndim else {}
            group.create_dataset(name, data=arr, **kwargs)
    return target

"""Keras weight files <-> named arrays: the one module that knows Keras's HDF5 layouts.

It sits next to the fedsplit weight format (`protocol.weights`): together they are the only
code that speaks HDF5. `open_upload` opens an untrusted file (structure walked first with
`protocol.h5safety`) and says which layout it holds; Keras files are read through it, fedsplit
files through `protocol.weights.open_weights`. Refusals are `WeightFileError` with a ``reason``.

Two layouts are read (inside the admin API's upload sandbox) and written back (for
``?format=keras``):

- ``keras3``: Keras 3 ``model.save_weights("x.weights.h5")``: ``layers/NAME/vars/0..N`` (nested
  models repeat ``layers/``), plus ``optimizer/vars/...``, which is not a model parameter:
  it is validated, never read, and not returned (``load_weights`` then keeps the optimizer's
  own state, with a warning).
- ``keras-legacy``: Keras 2 / tf.keras ``save_weights("x.h5")``: root attribute ``layer_names``,
  each layer group lists its datasets in attribute ``weight_names``.

A Keras 3 parameter's name is its dataset path with ``/`` replaced by ``.``
(``layers.dense.vars.0``; Keras 3 derives these paths from the model's structure). A legacy
parameter is named by position, ``LAYER.WEIGHT.basename`` (``0.1.bias``), because legacy
loading matches layers by order and their names (``dense_7``) depend on the process. The
`KerasLayout` descriptor keeps the real paths, groups and their attributes so the
aggregate can be written back in the layout the sites uploaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import h5py
import numpy as np
from fedsplit.protocol.arrays import ArraySpec, check_array
from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.errors import UpdateError, WeightFileError
from fedsplit.protocol.h5safety import Tree, looks_like_hdf5, walk
from fedsplit.protocol.weights import parameter_spec

WHERE = "The uploaded file"

KERAS3 = "keras3"
KERAS_LEGACY = "keras-legacy"
FEDSPLIT = "fedsplit"
_OPTIMIZER = "optimizer"
_MAX_ATTR_ITEMS = 100_000
_MAX_ATTR_CHARS = 1_000_000

KerasLayout = dict[str, Any]
"""JSON descriptor: {kind, root_attrs, groups: [{path, attrs}], datasets: [{path, name}]}."""


def detect_layout(f: h5py.File) -> str:
    """Return ``fedsplit``, ``keras3`` or ``keras-legacy``; refuse anything else."""
    fmt = f.attrs.get("format")
    if fmt is not None:
        return FEDSPLIT  # protocol.open_weights checks the value and the version
    if "layer_names" in f.attrs:
        return KERAS_LEGACY
    root = set(f.keys())
    if "layers" in root or ("vars" in root and root <= {"vars", _OPTIMIZER, "layers"}):
        return KERAS3
    if "model_weights" in root:
        raise WeightFileError(
            f"{WHERE} is a whole legacy Keras model (model.save('x.h5')), not a weights file. "
            f"Upload model.save_weights('x.weights.h5') or a fedsplit weight file "
            f"(`fedsplit export`). Received: root entries {sorted(root)[:10]}",
            reason="wrong_format",
        )
    raise WeightFileError(
        f"{WHERE} is HDF5 but neither a fedsplit weight file (root attribute format="
        f"'fedsplit.weights') nor a Keras weights file (layers/... or layer_names). Write one with "
        f"`fedsplit export CHECKPOINT.pt --num-examples N -o FILE.h5` or Keras's "
        f"model.save_weights('x.weights.h5'). Received: root entries {sorted(root)[:10]}",
        reason="wrong_format",
    )


def param_name(path: str) -> str:
    """Name of the parameter stored at dataset ``path``."""
    return path.replace("/", ".")


def describe_keras(
    f: h5py.File, kind: str, tree: Tree, max_elements: int
) -> tuple[KerasLayout, list[ArraySpec]]:
    """Return the layout descriptor and the parameter specs of a walked Keras file."""
    by_path = {d.path: d for d in tree.datasets}
    if kind == KERAS3:
        groups = [g for g in tree.groups if g.split("/")[0] != _OPTIMIZER]
        paths = [d.path for d in tree.datasets if d.path.split("/")[0] != _OPTIMIZER]
        names = [param_name(p) for p in paths]
    else:
        groups = list(tree.groups)
        paths, names = [], []
        for layer in _str_list(f.attrs, "layer_names", "/"):
            if layer not in f or not isinstance(f[layer], h5py.Group):
                raise WeightFileError(
                    f"{WHERE}: layer_names lists {layer!r} but the file has no such group; the "
                    f"legacy Keras file is truncated or edited. Re-save it with save_weights. "
                    f"Received: {layer!r}",
                    reason="corrupt",
                )
            weights = _str_list(f[layer].attrs, "weight_names", f"/{layer}")
            # Legacy loading matches layers by position, not by their (auto-generated) names.
            position = len({n.split(".", 1)[0] for n in names})
            for j, weight in enumerate(weights):
                path = f"{layer}/{weight}"
                if path not in by_path:
                    raise WeightFileError(
                        f"{WHERE}: /{layer} lists weight {weight!r} but holds no dataset there. "
                        f"Re-save the model with save_weights. Received: /{path}",
                        reason="corrupt",
                    )
                paths.append(path)
                names.append(f"{position}.{j}.{weight.rsplit('/', 1)[-1]}")
    specs: list[ArraySpec] = []
    seen: set[str] = set()
    total = 0
    for path, name in zip(paths, names, strict=True):
        info = by_path[path]
        spec = parameter_spec(name, info, WHERE)
        if name in seen:
            raise WeightFileError(
                f"{WHERE}: two datasets map to the parameter name {name!r}; rename the layers so "
                f"that no name differs only by '/' versus '.'. Received: /{path}",
                reason="wrong_format",
            )
        seen.add(name)
        total += int(np.prod(info.shape, dtype=np.int64))
        if total > max_elements:
            raise WeightFileError(
                f"{WHERE} declares more than {max_elements} parameter values (the round's model "
                f"size or the upload limit). Upload the round's model. Received: > {max_elements} "
                f"at /{path}",
                reason="too_large",
            )
        specs.append(spec)
    if not specs:
        raise WeightFileError(
            f"{WHERE} is a Keras weights file without any model weights (build the model before "
            f"save_weights). Received: 0 parameters",
            reason="wrong_format",
        )
    layout: KerasLayout = {
        "kind": kind,
        "root_attrs": _encode_attrs(f.attrs),
        "groups": [{"path": g, "attrs": _encode_attrs(f[g].attrs)} for g in groups],
        "datasets": [{"path": p, "name": n} for p, n in zip(paths, names, strict=True)],
    }
    return layout, specs


class KerasFile:
    """An open Keras weights file whose structure `open_upload` checked; values read on demand."""

    def __init__(self, handle: h5py.File, kind: str, layout: KerasLayout,
                 specs: list[ArraySpec]) -> None:
        self._file = handle
        self.kind = kind
        self.layout = layout
        self.specs: tuple[ArraySpec, ...] = tuple(specs)
        self._paths = {ds["name"]: ds["path"] for ds in layout["datasets"]}

    def array(self, name: str) -> np.ndarray:
        """Return parameter ``name`` in native byte order, checked finite (`WeightFileError`)."""
        path = self._paths.get(name)
        if path is None:
            raise WeightFileError(
                f"{WHERE} has no parameter {name!r}. Its parameters: {', '.join(self._paths)}. "
                f"Received: {name!r}"
            )
        try:
            return check_array(name, read_keras_array(self._file, path), where="uploaded file")
        except UpdateError as e:
            raise WeightFileError(str(e), reason=e.reason) from None

    def close(self) -> None:
        """Close the HDF5 file."""
        self._file.close()

    def __enter__(self) -> KerasFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_upload(
    fh: IO[bytes], *, max_depth: int, max_elements: int, max_total_elements: int
) -> KerasFile | None:
    """Open an untrusted HDF5 file, check its whole structure, and tell its layout.

    Returns a `KerasFile` for the two Keras layouts, or None for a fedsplit weight file (read
    it with `protocol.weights.open_weights` after ``fh.seek(0)``). ``max_depth`` and
    ``max_elements`` bound the structure walk (group depth, values per dataset);
    ``max_total_elements`` bounds a Keras file's parameter values in total. Anything else
    (not HDF5, truncated, unknown layout, links, plugins, ...) raises `WeightFileError`.
    """
    size = fh.seek(0, 2)
    fh.seek(0)
    if not looks_like_hdf5(fh, size):
        fh.seek(0)
        head = fh.read(8)
        raise WeightFileError(
            "The uploaded file is not HDF5 (no HDF5 signature). Upload a fedsplit weight file "
            "(`fedsplit export CHECKPOINT.pt --num-examples N -o FILE.h5`) or a Keras "
            f"save_weights file. Received: {size} bytes starting {head!r}",
            reason="not_hdf5",
        )
    fh.seek(0)
    try:
        f = h5py.File(fh, "r")
    except (OSError, ValueError) as e:
        text = str(e) if len(str(e)) <= 200 else str(e)[:200] + "..."
        raise WeightFileError(
            f"The uploaded file has an HDF5 signature but cannot be opened: it is truncated or "
            f"corrupt ({text}). Re-export it and upload again. Received: {size} bytes",
            reason="corrupt",
        ) from None
    try:
        kind = detect_layout(f)
        tree = walk(f, where=WHERE, max_depth=max_depth, max_elements=max_elements)
        if kind == FEDSPLIT:
            f.close()
            return None
        layout, specs = describe_keras(f, kind, tree, max_total_elements)
    except BaseException:
        f.close()
        raise
    return KerasFile(f, kind, layout, specs)


def read_keras_array(f: h5py.File, path: str) -> np.ndarray:
    """Read the parameter at ``path`` in native byte order (validated by the caller)."""
    raw = np.asarray(f[path][()])
    return raw.astype(raw.dtype.newbyteorder("="), copy=False)


def write_keras(layout: KerasLayout, arrays: Mapping[str, np.ndarray], target: Path) -> Path:
    """Write ``arrays`` in ``layout`` to ``target`` atomically (temp file, fsync, rename)."""
    with atomic_path(target) as tmp, h5py.File(tmp, "w") as f:
        _decode_attrs(f.attrs, layout["root_attrs"])
        for group in layout["groups"]:
            _decode_attrs(f.require_group(group["path"]).attrs, group["attrs"])
        for ds in layout["datasets"]:
            f.create_dataset(ds["path"], data=np.ascontiguousarray(arrays[ds["name"]]))
    return target


def _str_list(attrs: h5py.AttributeManager, key: str, where: str) -> list[str]:
    value = attrs.get(key)
    if value is None:
        raise WeightFileError(
            f"{WHERE}: {where} lacks the {key!r} attribute of legacy Keras weight files. Re-save "
            f"the model with save_weights. Received: attributes {sorted(attrs.keys())[:10]}",
            reason="wrong_format",
        )
    arr = np.atleast_1d(np.asarray(value))
    if arr.size == 0:
        return []
    if arr.dtype.kind not in "SUO" or arr.ndim != 1:
        raise WeightFileError(
            f"{WHERE}: {where} attribute {key!r} must be a list of strings. Received: dtype={arr.dtype}",
            reason="wrong_format",
        )
    out = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in arr.tolist()]
    if not all(isinstance(v, str) and v for v in out):
        raise WeightFileError(
            f"{WHERE}: {where} attribute {key!r} must be a list of non-empty strings. "
            f"Received: {out[:5]!r}",
            reason="wrong_format",
        )
    return out


def _encode_attrs(attrs: h5py.AttributeManager) -> dict[str, Any]:
    """Keep attributes of known-safe kinds (strings, numbers, 1-D lists of them) as JSON."""
    out: dict[str, Any] = {}
    for key in attrs:
        with contextlib.suppress(Exception):  # an attribute h5py cannot read is dropped
            value = attrs[key]
            arr = np.asarray(value)
            if arr.ndim > 1 or arr.size > _MAX_ATTR_ITEMS:
                continue
            if arr.dtype.kind in "SUO":
                items = [
                    v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                    for v in arr.ravel().tolist()
                ]
                if not all(isinstance(v, str) for v in items) or sum(map(len, items)) > _MAX_ATTR_CHARS:
                    continue
                out[key] = {"t": "str", "v": items[0]} if arr.ndim == 0 else {"t": "str_list", "v": items}
            elif arr.dtype.kind in "biuf":
                kind = "num" if arr.ndim == 0 else "num_list"
                out[key] = {"t": kind, "dtype": arr.dtype.newbyteorder("=").str, "v": arr.tolist()}
    return out


def _decode_attrs(attrs: h5py.AttributeManager, encoded: Mapping[str, Any]) -> None:
    for key, item in encoded.items():
        if item["t"] == "str":
            attrs[key] = item["v"]
        elif item["t"] == "str_list":
            attrs[key] = np.array(item["v"], dtype=h5py.string_dtype())
        else:
            attrs[key] = np.array(item["v"], dtype=np.dtype(item["dtype"]))

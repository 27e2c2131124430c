"""Keras weight files <-> named arrays: the one module that knows Keras's HDF5 layouts.

Two layouts are read (inside the upload sandbox) and written back (for ``?format=keras``):

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
from typing import Any

import h5py
import numpy as np

from protocol.arrays import ALLOWED_DTYPES, ArraySpec
from protocol.atomic import atomic_path
from protocol.h5safety import Tree
from server.admin.errors import UploadRefusedError

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
        raise UploadRefusedError(
            f"{WHERE} is a whole legacy Keras model (model.save('x.h5')), not a weights file. "
            f"Upload model.save_weights('x.weights.h5') or a fedsplit weight file "
            f"(`fedsplit export`). Received: root entries {sorted(root)[:10]}",
            "wrong_format",
        )
    raise UploadRefusedError(
        f"{WHERE} is HDF5 but neither a fedsplit weight file (root attribute format="
        f"'fedsplit.weights') nor a Keras weights file (layers/... or layer_names). Write one with "
        f"`fedsplit export CHECKPOINT.pt --num-examples N -o FILE.h5` or Keras's "
        f"model.save_weights('x.weights.h5'). Received: root entries {sorted(root)[:10]}",
        "wrong_format",
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
                raise UploadRefusedError(
                    f"{WHERE}: layer_names lists {layer!r} but the file has no such group; the "
                    f"legacy Keras file is truncated or edited. Re-save it with save_weights. "
                    f"Received: {layer!r}",
                    "corrupt",
                )
            weights = _str_list(f[layer].attrs, "weight_names", f"/{layer}")
            # Legacy loading matches layers by position, not by their (auto-generated) names.
            position = len({n.split(".", 1)[0] for n in names})
            for j, weight in enumerate(weights):
                path = f"{layer}/{weight}"
                if path not in by_path:
                    raise UploadRefusedError(
                        f"{WHERE}: /{layer} lists weight {weight!r} but holds no dataset there. "
                        f"Re-save the model with save_weights. Received: /{path}",
                        "corrupt",
                    )
                paths.append(path)
                names.append(f"{position}.{j}.{weight.rsplit('/', 1)[-1]}")
    specs: list[ArraySpec] = []
    seen: set[str] = set()
    total = 0
    for path, name in zip(paths, names, strict=True):
        info = by_path[path]
        if info.dtype not in ALLOWED_DTYPES:
            raise UploadRefusedError(
                f"{WHERE}: /{path} has dtype {info.dtype}; model parameters must be float16, "
                f"float32 or float64. Received: dtype={info.dtype}",
                "dtype",
            )
        if name in seen:
            raise UploadRefusedError(
                f"{WHERE}: two datasets map to the parameter name {name!r}; rename the layers so "
                f"that no name differs only by '/' versus '.'. Received: /{path}",
                "wrong_format",
            )
        seen.add(name)
        total += int(np.prod(info.shape, dtype=np.int64))
        if total > max_elements:
            raise UploadRefusedError(
                f"{WHERE} declares more than {max_elements} parameter values (the round's model "
                f"size or the upload limit). Upload the round's model. Received: > {max_elements} "
                f"at /{path}",
                "too_large",
            )
        specs.append(ArraySpec(name, info.shape, info.dtype))
    if not specs:
        raise UploadRefusedError(
            f"{WHERE} is a Keras weights file without any model weights (build the model before "
            f"save_weights). Received: 0 parameters",
            "wrong_format",
        )
    layout: KerasLayout = {
        "kind": kind,
        "root_attrs": _encode_attrs(f.attrs),
        "groups": [{"path": g, "attrs": _encode_attrs(f[g].attrs)} for g in groups],
        "datasets": [{"path": p, "name": n} for p, n in zip(paths, names, strict=True)],
    }
    return layout, specs


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
        raise UploadRefusedError(
            f"{WHERE}: {where} lacks the {key!r} attribute of legacy Keras weight files. Re-save "
            f"the model with save_weights. Received: attributes {sorted(attrs.keys())[:10]}",
            "wrong_format",
        )
    arr = np.atleast_1d(np.asarray(value))
    if arr.size == 0:
        return []
    if arr.dtype.kind not in "SUO" or arr.ndim != 1:
        raise UploadRefusedError(
            f"{WHERE}: {where} attribute {key!r} must be a list of strings. Received: dtype={arr.dtype}",
            "wrong_format",
        )
    out = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in arr.tolist()]
    if not all(isinstance(v, str) and v for v in out):
        raise UploadRefusedError(
            f"{WHERE}: {where} attribute {key!r} must be a list of non-empty strings. "
            f"Received: {out[:5]!r}",
            "wrong_format",
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

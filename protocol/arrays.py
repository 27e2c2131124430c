"""Checks every path applies to named parameter arrays and sample counts.

One place decides what a valid parameter array and a valid sample count are, so the
weight-file reader, the Flower adapter and the REST upload path refuse the same things.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np

from protocol.errors import UpdateError

#: Parameter dtypes a weight file and an update may carry.
ALLOWED_DTYPES: tuple[np.dtype, ...] = (
    np.dtype("float16"),
    np.dtype("float32"),
    np.dtype("float64"),
)


@dataclass(frozen=True)
class ArraySpec:
    """Name, shape and dtype of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes the parameter occupies in memory."""
        return self.size * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly description."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.name}


def check_num_examples(value: Any, *, where: str = "update") -> int:
    """Return ``value`` as an int if it is an integer >= 1, else raise `UpdateError`."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        if isinstance(value, float | np.floating) and float(value).is_integer() and value >= 1:
            # Flower carries counts as MetricRecord numbers; 120.0 means 120.
            return int(value)
        raise UpdateError(
            f"The {where}'s sample count (num_examples) must be an integer >= 1: it weights the "
            f"update in the average. Send the number of training rows used. Received: {value!r}",
            reason="num_examples",
        )
    if int(value) < 1:
        raise UpdateError(
            f"The {where}'s sample count (num_examples) must be >= 1: an update trained on no rows "
            f"carries no information. Received: {int(value)}",
            reason="num_examples",
        )
    return int(value)


def check_array(name: str, array: Any, *, where: str = "update") -> np.ndarray:
    """Return ``array`` as a numpy array if it is a finite float parameter, else raise."""
    if not isinstance(name, str) or not name:
        raise UpdateError(
            f"Every parameter in the {where} needs a non-empty string name (its state_dict key). "
            f"Received: {name!r}",
            reason="name",
        )
    arr = np.asarray(array)
    if arr.dtype not in ALLOWED_DTYPES:
        raise UpdateError(
            f"Parameter {name!r} in the {where} has dtype {arr.dtype}; weights must be float16, "
            f"float32 or float64. Convert integer buffers (e.g. BatchNorm's num_batches_tracked) "
            f"to float or leave them out. Received: dtype={arr.dtype}",
            reason="dtype",
        )
    if not np.all(np.isfinite(arr)):
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise UpdateError(
            f"Parameter {name!r} in the {where} holds {bad} NaN/Inf value(s); a diverged or "
            f"corrupted update cannot be aggregated. Retrain with a lower learning rate or check "
            f"the site's data. Received: {bad} non-finite of {arr.size}",
            reason="non_finite",
        )
    return arr


def check_arrays(arrays: Mapping[str, Any], *, where: str = "update") -> dict[str, np.ndarray]:
    """Check every named array (see `check_array`) and return them in order."""
    if not arrays:
        raise UpdateError(f"The {where} holds no parameters. Received: 0 arrays", reason="empty")
    return {name: check_array(name, arr, where=where) for name, arr in arrays.items()}


def specs_of(arrays: Mapping[str, np.ndarray]) -> tuple[ArraySpec, ...]:
    """Return the `ArraySpec` of each array, in order."""
    return tuple(ArraySpec(n, tuple(int(d) for d in a.shape), a.dtype) for n, a in arrays.items())

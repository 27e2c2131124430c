"""Checks every path applies to named parameter arrays and sample counts.

One place decides what a valid parameter array and a valid sample count are, so the
weight-file reader, the Flower adapter and the REST upload path refuse the same things.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
from fedsplit.protocol.errors import UpdateError

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
        return int(math.prod(self.shape))  # Python ints: exact, and no numpy call per block read

    @property
    def nbytes(self) -> int:
        """Bytes the parameter occupies in memory."""
        return self.size * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly description."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.name}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArraySpec:
        """Rebuild a spec from `to_dict`'s form, refusing anything else with `UpdateError`.

        ``name`` must be a non-empty string, ``shape`` a list of non-negative integers and
        ``dtype`` one of `ALLOWED_DTYPES` by name (``"float32"``).
        """
        if not isinstance(d, Mapping) or set(d) != {"name", "shape", "dtype"}:
            keys = sorted(map(str, d)) if isinstance(d, Mapping) else type(d).__name__
            raise UpdateError(
                "A parameter description is a mapping with exactly the keys 'name', 'shape' and "
                "'dtype' (as ArraySpec.to_dict writes it). Received: " + repr(keys),
                reason="spec",
            )
        name, shape, dtype = d["name"], d["shape"], d["dtype"]
        if not isinstance(name, str) or not name:
            raise UpdateError(
                f"A parameter's 'name' must be a non-empty string (its state_dict key). "
                f"Received: {name!r}",
                reason="spec",
            )
        if not isinstance(shape, list | tuple) or not all(
            isinstance(n, Integral) and not isinstance(n, bool) and int(n) >= 0 for n in shape
        ):
            raise UpdateError(
                f"Parameter {name!r}: 'shape' must be a list of non-negative integers, e.g. "
                f"[64, 3]. Received: {shape!r}",
                reason="spec",
            )
        allowed = [t.name for t in ALLOWED_DTYPES]
        if not isinstance(dtype, str) or dtype not in allowed:
            raise UpdateError(
                f"Parameter {name!r}: 'dtype' must be one of {allowed} by name. "
                f"Received: {dtype!r}",
                reason="spec",
            )
        return cls(name, tuple(int(n) for n in shape), np.dtype(dtype))


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
    if not _all_finite(arr):
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise UpdateError(
            f"Parameter {name!r} in the {where} holds {bad} NaN/Inf value(s); a diverged or "
            f"corrupted update cannot be aggregated. Retrain with a lower learning rate or check "
            f"the site's data. Received: {bad} non-finite of {arr.size}",
            reason="non_finite",
        )
    return arr


def _all_finite(arr: np.ndarray) -> bool:
    """No NaN or infinity in ``arr``, without a boolean array of its size: NaN makes the
    minimum NaN, +/-inf shows as the maximum or minimum."""
    if arr.size == 0:
        return True
    return bool(np.isfinite(arr.min()) and np.isfinite(arr.max()))


def check_arrays(arrays: Mapping[str, Any], *, where: str = "update") -> dict[str, np.ndarray]:
    """Check every named array (see `check_array`) and return them in order."""
    if not arrays:
        raise UpdateError(f"The {where} holds no parameters. Received: 0 arrays", reason="empty")
    return {name: check_array(name, arr, where=where) for name, arr in arrays.items()}


def specs_of(arrays: Mapping[str, np.ndarray]) -> tuple[ArraySpec, ...]:
    """Return the `ArraySpec` of each array, in order."""
    return tuple(ArraySpec(n, tuple(int(d) for d in a.shape), a.dtype) for n, a in arrays.items())


def _describe_spec(spec: ArraySpec) -> str:
    return f"{spec.name!r} (shape {tuple(spec.shape)}, {np.dtype(spec.dtype).name})"


def layout_difference(
    expected: Sequence[ArraySpec],
    got: Sequence[ArraySpec],
    *,
    expected_label: str = "the expected model",
    got_label: str = "the update",
    ordered: bool = True,
) -> str | None:
    """Describe the first difference between two model layouts, or return None when equal.

    The answer is one sentence naming the first differing parameter with both shapes and
    dtypes: a parameter listed twice, missing (with the parameter ``got`` holds in its place
    when that one is unknown to ``expected``: a rename), of another shape or dtype, extra, or
    (when ``ordered``) the same parameters in another order. Callers add their own advice and
    ``Received:`` value; the labels name the two sides ("the round's model", "the upload").
    """
    for side, label in ((expected, expected_label), (got, got_label)):
        seen: set[str] = set()
        for spec in side:
            if spec.name in seen:
                return f"Parameter {spec.name!r} is listed twice in {label}."
            seen.add(spec.name)
    want = {s.name: s for s in expected}
    have = {s.name: s for s in got}
    for position, spec in enumerate(expected):
        other = have.get(spec.name)
        if other is None:
            sentence = (
                f"Parameter {_describe_spec(spec)} of {expected_label} is missing from "
                f"{got_label}"
            )
            if position < len(got) and got[position].name not in want:
                stand_in = got[position]
                sentence += (
                    f", which holds {_describe_spec(stand_in)} in its place (renamed?)"
                )
            return sentence + "."
        if tuple(other.shape) != tuple(spec.shape):
            return (
                f"Parameter {spec.name!r} has shape {tuple(spec.shape)} "
                f"({np.dtype(spec.dtype).name}) in {expected_label} but {tuple(other.shape)} "
                f"({np.dtype(other.dtype).name}) in {got_label}."
            )
        if np.dtype(other.dtype) != np.dtype(spec.dtype):
            return (
                f"Parameter {spec.name!r} (shape {tuple(spec.shape)}) is "
                f"{np.dtype(spec.dtype).name} in {expected_label} but "
                f"{np.dtype(other.dtype).name} in {got_label}; export the same precision."
            )
    for spec in got:
        if spec.name not in want:
            return f"Parameter {_describe_spec(spec)} of {got_label} is not in {expected_label}."
    if ordered:
        for position, (a, b) in enumerate(zip(expected, got, strict=True)):
            if a.name != b.name:
                return (
                    f"{got_label[:1].upper()}{got_label[1:]} holds the parameters of "
                    f"{expected_label} in another order: position {position} is {a.name!r} in "
                    f"{expected_label} but {b.name!r} in {got_label}."
                )
    return None

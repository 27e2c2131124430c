"""Compare an upload's parameters with the round's expected model; name the first difference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from protocol.arrays import ArraySpec

_HINT = (
    "Every site must train the round's model from its start model "
    "(GET /api/v1/rounds/{id}/start-model)."
)


def specs_to_json(specs: Sequence[ArraySpec]) -> list[dict[str, Any]]:
    """Return specs as [{name, shape, dtype}]."""
    return [s.to_dict() for s in specs]


def first_difference(expected: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> str | None:
    """Return a message naming the first parameter where ``got`` differs from ``expected``."""
    want = {s["name"]: s for s in expected}
    have = {s["name"]: s for s in got}
    for name, spec in want.items():
        if name not in have:
            return (
                f"Parameter {name!r} (shape {tuple(spec['shape'])}) of the round's model is missing "
                f"from the upload. {_HINT} Received: parameters {list(have)[:20]}"
            )
        other = have[name]
        if list(other["shape"]) != list(spec["shape"]):
            return (
                f"Parameter {name!r} has shape {tuple(spec['shape'])} in the round's model but "
                f"{tuple(other['shape'])} in the upload. {_HINT} Received: {tuple(other['shape'])}"
            )
        if other["dtype"] != spec["dtype"]:
            return (
                f"Parameter {name!r} is {spec['dtype']} in the round's model but {other['dtype']} in "
                f"the upload; export the same precision. Received: {other['dtype']}"
            )
    extra = [n for n in have if n not in want]
    if extra:
        return (
            f"Parameter {extra[0]!r} of the upload is not in the round's model. {_HINT} "
            f"Received: {extra[0]!r}"
        )
    return None


def total_elements(specs: Sequence[dict[str, Any]]) -> int:
    """Number of values in a model."""
    total = 0
    for s in specs:
        n = 1
        for d in s["shape"]:
            n *= int(d)
        total += n
    return total

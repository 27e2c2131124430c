"""Checks that updates can be combined parameter by parameter."""

from __future__ import annotations

from collections.abc import Sequence

from aggregation.errors import IncompatibleUpdatesError, NotEnoughUpdatesError
from protocol.update import UpdateHeader

_VERTICAL_HINT = (
    "Averaging needs every site to train the same model (identical names and shapes). Sites "
    "that hold different columns of the same patients need vertical fusion instead "
    "(`fedsplit vertical simulate`, strategy 'vertical-fusion'), not averaging."
)


def check_compatible(headers: Sequence[UpdateHeader]) -> None:
    """Raise `IncompatibleUpdatesError` naming the first parameter where updates differ."""
    if not headers:
        raise NotEnoughUpdatesError("No updates to aggregate. Received: 0 updates")
    ref = headers[0]
    ref_specs = {s.name: s for s in ref.specs}
    for other in headers[1:]:
        specs = {s.name: s for s in other.specs}
        for name, spec in ref_specs.items():
            if name not in specs:
                raise IncompatibleUpdatesError(
                    f"Parameter {name!r} (shape {spec.shape}) of {ref.label} is missing from "
                    f"{other.label}. {_VERTICAL_HINT} Received: {other.label} parameters "
                    f"{list(specs)}"
                )
            got = specs[name]
            if got.shape != spec.shape:
                raise IncompatibleUpdatesError(
                    f"Parameter {name!r} has shape {spec.shape} in {ref.label} but {got.shape} in "
                    f"{other.label}. {_VERTICAL_HINT} Received: {spec.shape} vs {got.shape}"
                )
            if got.dtype != spec.dtype:
                raise IncompatibleUpdatesError(
                    f"Parameter {name!r} is {spec.dtype} in {ref.label} but {got.dtype} in "
                    f"{other.label}; sites must export the same precision. Received: "
                    f"{spec.dtype} vs {got.dtype}"
                )
        extra = [n for n in specs if n not in ref_specs]
        if extra:
            raise IncompatibleUpdatesError(
                f"Parameter {extra[0]!r} (shape {specs[extra[0]].shape}) of {other.label} is not "
                f"in {ref.label}. {_VERTICAL_HINT} Received: {ref.label} parameters "
                f"{list(ref_specs)}"
            )

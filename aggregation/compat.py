"""Checks that updates can be combined parameter by parameter."""

from __future__ import annotations

from collections.abc import Sequence

from fedsplit.aggregation.errors import IncompatibleUpdatesError, NotEnoughUpdatesError
from fedsplit.protocol.arrays import ArraySpec, layout_difference
from fedsplit.protocol.update import UpdateHeader

VERTICAL_HINT = (
    "Averaging needs every site to train the same model (identical names and shapes). Sites "
    "that hold different columns of the same patients need vertical fusion instead "
    "(`fedsplit vertical simulate`), not averaging."
)


def same_names_and_shapes(a: Sequence[ArraySpec], b: Sequence[ArraySpec]) -> bool:
    """Whether two layouts differ at most in dtypes (so the vertical-fusion hint does not apply)."""
    return {(s.name, tuple(s.shape)) for s in a} == {(s.name, tuple(s.shape)) for s in b}


def check_compatible(headers: Sequence[UpdateHeader]) -> None:
    """Raise `IncompatibleUpdatesError` naming the first parameter where updates differ.

    Parameter order does not matter (updates are combined by name). The sentence comes from
    `protocol.arrays.layout_difference`, the one description of layout differences.
    """
    if not headers:
        raise NotEnoughUpdatesError("No updates to aggregate. Received: 0 updates")
    ref = headers[0]
    for other in headers[1:]:
        problem = layout_difference(
            ref.specs, other.specs, expected_label=ref.label, got_label=other.label, ordered=False
        )
        if problem is None:
            continue
        hint = "" if same_names_and_shapes(ref.specs, other.specs) else f" {VERTICAL_HINT}"
        raise IncompatibleUpdatesError(
            f"{problem}{hint} Received: {ref.label} with {len(ref.specs)} parameters, "
            f"{other.label} with {len(other.specs)}"
        )

"""ArraySpec's dict form and the one layout comparison every path uses."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.protocol.arrays import ArraySpec, layout_difference
from fedsplit.protocol.errors import UpdateError


def spec(name: str, shape: tuple[int, ...], dtype: str = "float32") -> ArraySpec:
    return ArraySpec(name, shape, np.dtype(dtype))


MODEL = (spec("fc.weight", (4, 3)), spec("fc.bias", (4,)), spec("scale", ()))


def test_from_dict_inverts_to_dict() -> None:
    """Every spec survives the round trip through its JSON-friendly form."""
    for s in (*MODEL, spec("h", (0, 2), "float16"), spec("d", (2,), "float64")):
        assert ArraySpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"name": "w", "shape": [2]}, r"exactly the keys.*Received: \['name', 'shape'\]"),
        ({"name": "w", "shape": [2], "dtype": "float32", "x": 1}, r"exactly the keys"),
        ("w", r"Received: 'str'"),
        ({"name": "", "shape": [2], "dtype": "float32"}, r"non-empty string.*Received: ''"),
        ({"name": 3, "shape": [2], "dtype": "float32"}, r"Received: 3"),
        ({"name": "w", "shape": [2, -1], "dtype": "float32"}, r"non-negative.*Received: \[2, -1\]"),
        ({"name": "w", "shape": [True], "dtype": "float32"}, r"Received: \[True\]"),
        ({"name": "w", "shape": "2", "dtype": "float32"}, r"Received: '2'"),
        ({"name": "w", "shape": [2], "dtype": "int64"}, r"dtype.*Received: 'int64'"),
        ({"name": "w", "shape": [2], "dtype": None}, r"Received: None"),
    ],
)
def test_from_dict_refuses_anything_else(d, match) -> None:
    """A malformed description is an UpdateError that says what is wrong."""
    with pytest.raises(UpdateError, match=match) as caught:
        ArraySpec.from_dict(d)
    assert caught.value.reason == "spec"


def test_equal_layouts_have_no_difference() -> None:
    assert layout_difference(MODEL, list(MODEL)) is None


def test_missing_parameter_is_named_with_its_shape_and_dtype() -> None:
    got = (MODEL[0], MODEL[2])
    msg = layout_difference(MODEL, got, expected_label="the round's model", got_label="the upload")
    assert msg == ("Parameter 'fc.bias' (shape (4,), float32) of the round's model is missing "
                   "from the upload.")


def test_renamed_parameter_names_both() -> None:
    got = (MODEL[0], spec("fc.b", (4,)), MODEL[2])
    msg = layout_difference(MODEL, got)
    assert "'fc.bias' (shape (4,), float32) of the expected model is missing" in msg
    assert "holds 'fc.b' (shape (4,), float32) in its place (renamed?)" in msg


def test_shape_and_dtype_differences_name_both_sides() -> None:
    shape = layout_difference(MODEL, (spec("fc.weight", (3, 4)), MODEL[1], MODEL[2]))
    assert shape == ("Parameter 'fc.weight' has shape (4, 3) (float32) in the expected model but "
                     "(3, 4) (float32) in the update.")
    dtype = layout_difference(MODEL, (MODEL[0], spec("fc.bias", (4,), "float16"), MODEL[2]))
    assert "'fc.bias' (shape (4,)) is float32 in the expected model but float16 in the update" in dtype


def test_extra_parameter_is_named() -> None:
    msg = layout_difference(MODEL, (*MODEL, spec("extra", (2,), "float64")))
    assert msg == ("Parameter 'extra' (shape (2,), float64) of the update is not in the expected "
                   "model.")


def test_reordered_parameters_unless_order_is_ignored() -> None:
    got = (MODEL[1], MODEL[0], MODEL[2])
    msg = layout_difference(MODEL, got)
    assert msg == ("The update holds the parameters of the expected model in another order: "
                   "position 0 is 'fc.weight' in the expected model but 'fc.bias' in the update.")
    assert layout_difference(MODEL, got, ordered=False) is None


def test_duplicate_names_are_a_difference() -> None:
    assert layout_difference(MODEL, (*MODEL, MODEL[0])) == (
        "Parameter 'fc.weight' is listed twice in the update.")

"""Arrays keep their shapes through Flower records: 0-d stays 0-d, non-contiguous becomes C order."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.client.vertical.app import _load, _save
from fedsplit.client.vertical.site import SiteState
from fedsplit.protocol.vertical.wire import Payload, c_order, from_record, to_record
from flwr.app import Context, RecordDict

SHAPES = {
    "scalar": np.array(7.5, dtype=np.float64),  # 0-d: np.ascontiguousarray would make it (1,)
    "one": np.array([7.5], dtype=np.float64),
    "empty": np.zeros((0, 33), dtype=np.uint8),
    "transposed": np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not C-contiguous
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_c_order_keeps_shape_and_values(name: str) -> None:
    array = SHAPES[name]
    out = c_order(array)
    assert out.shape == array.shape and out.flags.c_contiguous
    np.testing.assert_array_equal(out, array)


def test_payload_round_trip_keeps_every_shape() -> None:
    back = from_record(to_record(Payload(config={"tag": "x"}, arrays=dict(SHAPES))))
    assert back.config == {"tag": "x"}
    for name, array in SHAPES.items():
        assert back.arrays[name].shape == array.shape, name
        np.testing.assert_array_equal(back.arrays[name], array)


def test_site_state_round_trips_through_context_state() -> None:
    context = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={})
    _save(context, SiteState(config={"branch": "{}"}, arrays=dict(SHAPES)))
    state = _load(context)
    assert state.config == {"branch": "{}"}
    assert {k: v.shape for k, v in state.arrays.items()} == {k: v.shape for k, v in SHAPES.items()}

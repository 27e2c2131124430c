"""`Update`: validation and conversions to Flower records and torch state_dicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedsplit.protocol import RunConfig, Update, UpdateError
from fedsplit.protocol.errors import ConfigError


def test_array_record_round_trip_keeps_order_and_values() -> None:
    """Update -> ArrayRecord -> Update is lossless and ordered."""
    update = Update({"b": np.ones((2, 2), np.float32), "a": np.zeros(3, np.float64)}, num_examples=4)
    back = Update.from_array_record(update.to_array_record(), num_examples=4)
    assert list(back.arrays) == ["b", "a"]
    np.testing.assert_array_equal(back.arrays["b"], update.arrays["b"])
    assert back.arrays["a"].dtype == np.float64


def test_state_dict_round_trip_loads_into_torch_module() -> None:
    """A torch module's state_dict survives the trip through an Update."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    update = Update.from_state_dict(net.state_dict(), num_examples=10)
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    other.load_state_dict(update.to_state_dict())
    for p, q in zip(net.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)
    assert list(update.arrays) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize(
    ("count", "match"),
    [(0, ">= 1"), (-3, ">= 1"), (2.5, "integer"), ("7", "integer"), (True, "integer"), (None, "integer")],
)
def test_bad_counts_are_refused(count, match) -> None:
    """The sample count must be an integer >= 1."""
    with pytest.raises(UpdateError, match=match):
        Update({"w": np.ones(2, np.float32)}, num_examples=count)


def test_integral_float_count_is_accepted() -> None:
    """Flower carries counts as numbers; 120.0 means 120."""
    assert Update({"w": np.ones(2, np.float32)}, num_examples=120.0).num_examples == 120


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({}, "no parameters"),
        ({"w": np.array([1, 2])}, "dtype int64"),
        ({"w": np.array([np.nan], np.float32)}, "NaN/Inf"),
        ({"": np.ones(1, np.float32)}, "non-empty string name"),
    ],
)
def test_bad_arrays_are_refused(arrays, match) -> None:
    """Empty updates, integer arrays, NaN and unnamed arrays are refused."""
    with pytest.raises(UpdateError, match=match):
        Update(arrays, num_examples=1)


def test_metrics_must_be_scalars() -> None:
    """Metrics are numbers only: nothing else can leave a site as a metric."""
    with pytest.raises(UpdateError, match="scalar numbers"):
        Update({"w": np.ones(1, np.float32)}, num_examples=1, metrics={"ids": [1, 2, 3]})


def test_run_config_rejects_unknown_keys_and_bad_values() -> None:
    """A typo or an out-of-range value names the key."""
    assert RunConfig.from_flower({"num-server-rounds": 4}).num_server_rounds == 4
    with pytest.raises(ConfigError, match="num-rounds"):
        RunConfig.from_flower({"num-rounds": 4})
    with pytest.raises(ConfigError, match="lr"):
        RunConfig.from_flower({"lr": 0})
    with pytest.raises(ConfigError, match="JSON object"):
        RunConfig.from_flower({"strategy-params": "beta=0.2"})


def test_zero_d_arrays_keep_their_shape_through_array_record() -> None:
    """A scalar parameter stays 0-d through Update -> ArrayRecord -> Update (not shape (1,))."""
    update = Update({"scale": np.array(0.5, np.float32), "w": np.ones((2, 3), np.float64)},
                    num_examples=3)
    record = update.to_array_record()
    assert record["scale"].shape == () and record["w"].shape == (2, 3)
    back = Update.from_array_record(record, num_examples=3)
    assert back.arrays["scale"].shape == () and back.arrays["scale"].dtype == np.float32
    assert float(back.arrays["scale"]) == 0.5
    # a non-contiguous view is made contiguous, its shape kept
    view = Update({"t": np.ones((3, 4), np.float32).T}, num_examples=1).to_array_record()
    assert view["t"].shape == (4, 3)


def test_integer_buffers_travel_as_float64_and_load_back_rounded() -> None:
    """BatchNorm's 0-d int64 num_batches_tracked: float64 in the Update, int64 again in the model;
    an averaged counter (3.5) rounds to the nearest integer."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net.train()
    for _ in range(3):
        net(torch.randn(8, 3))
    update = Update.from_state_dict(net.state_dict(), num_examples=8)
    counter = update.arrays["1.num_batches_tracked"]
    assert counter.dtype == np.float64 and counter.shape == () and float(counter) == 3.0
    assert update.arrays["1.running_mean"].dtype == np.float32
    averaged = Update({**update.arrays, "1.num_batches_tracked": np.array(3.5)}, num_examples=8)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    other.load_state_dict(averaged.to_state_dict(like=other.state_dict()))
    assert other[1].num_batches_tracked.dtype == torch.int64
    assert int(other[1].num_batches_tracked) == 4
    assert torch.equal(other[1].running_var, net[1].running_var)


def test_integer_buffer_beyond_float64_precision_is_refused() -> None:
    """An integer that float64 cannot carry exactly is refused, not silently rounded."""
    with pytest.raises(UpdateError, match="2\\*\\*53"):
        Update.from_state_dict({"n": torch.tensor(2**53 + 1)}, num_examples=1)


@pytest.mark.parametrize("values", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.array(3.5), np.zeros((0, 5)),
    np.array([1, 2], dtype=">i4"), np.ones((2, 2), dtype=np.float16),
    np.arange(6, dtype=np.float64).reshape(2, 3).T,  # Fortran order: loaded as Flower does
])
def test_array_view_equals_flowers_numpy_and_shares_the_bytes_when_it_can(values) -> None:
    from fedsplit.protocol.update import array_view
    from flwr.app import Array

    array = Array(values)
    view, loaded = array_view(array), array.numpy()
    assert view.dtype == loaded.dtype and view.shape == loaded.shape
    np.testing.assert_array_equal(view, loaded)
    viewed = bool(values.flags.c_contiguous)  # np.save writes the rest in Fortran order
    assert view.flags.writeable == (not viewed)  # a view over Flower's bytes is read-only
    assert np.shares_memory(view, np.frombuffer(array.data, dtype=np.uint8)) == (
        viewed and values.size > 0)


@pytest.mark.parametrize(("shape", "dtype"), [((3, 4), np.float32), ((), np.float64),
                                              ((0, 5), np.float16), ((7,), np.float32),
                                              ((2, 3, 4), np.float64)])
def test_an_array_over_its_own_npy_image_becomes_flowers_array_without_a_copy(shape, dtype
                                                                              ) -> None:
    from fedsplit.protocol.update import npy_empty, npy_image, to_array_record
    from flwr.app import Array

    values = npy_empty(shape, dtype)
    values[...] = np.arange(values.size, dtype=dtype).reshape(shape)
    record = to_array_record({"w": values})
    image = npy_image(values)
    assert image is not None and record["w"].data is image  # the aggregate's own memory
    flowers = Array(np.array(values))  # what Flower writes for the same values
    assert bytes(record["w"].data) == flowers.data
    assert record["w"].object_id == flowers.object_id
    assert (record["w"].dtype, record["w"].shape) == (flowers.dtype, flowers.shape)
    np.testing.assert_array_equal(record["w"].numpy(), values)


def test_views_that_are_not_the_whole_image_are_copied_as_flower_writes_them() -> None:
    from fedsplit.protocol.update import npy_empty, npy_image, to_array_record
    from flwr.app import Array

    values = npy_empty((4, 4), np.float32)
    values[...] = np.arange(16, dtype=np.float32).reshape(4, 4)
    for view in (values[1:], values.T, values.reshape(16), values.view(np.int32)[:0],
                 np.ones((4, 4), np.float32)):
        assert npy_image(view) is None
    record = to_array_record({"tail": values[1:], "t": values.T})
    assert isinstance(record["tail"].data, bytes)
    assert record["t"].data == Array(np.ascontiguousarray(values.T)).data


def test_a_record_over_npy_images_pickles_as_flowers_own() -> None:
    import pickle

    from fedsplit.protocol.update import npy_empty, to_array_record
    from flwr.app import Array

    values = npy_empty((5, 3), np.float32)
    values[...] = 2.5
    again = pickle.loads(pickle.dumps(to_array_record({"w": values})))  # Ray's simulation
    assert again["w"].object_id == Array(np.full((5, 3), 2.5, np.float32)).object_id


def test_an_image_handed_to_flower_is_read_only_on_both_sides() -> None:
    from fedsplit.protocol.update import array_view, npy_empty, to_array_record

    values = npy_empty((3,), np.float32)
    values[...] = 1.0
    record = to_array_record({"w": values})
    with pytest.raises(ValueError, match="read-only"):
        values[0] = 2.0  # the record's bytes: the aggregate is not changed behind it
    with pytest.raises(ValueError, match="read-only"):
        array_view(record["w"])[0] = 2.0
    assert bytes(record["w"].data)[-12:] == np.ones(3, np.float32).tobytes()

"""`server.reply_pull`: a reply pulled object by object and each array built in one buffer
is the message Flower's own inflation builds (issue 43)."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.protocol.update import array_view
from fedsplit.server import reply_pull
from fedsplit.server.exchange import send_and_collect
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    ObjectUnavailableError,
    inflate_object_from_contents,
)


def _message(arrays: dict[str, Array]) -> Message:
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": 12, "loss": 0.5}),
                          "config": ConfigRecord({"site": "a", "stage": "train"})})
    return Message(content=content, dst_node_id=7, message_type="train")


def _served(msg: Message) -> tuple[dict[str, bytes], list[str]]:
    """Every object of ``msg`` as the SuperLink stores it, and a log of the pulls."""
    return {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}, []


def _puller(store: dict[str, bytes], log: list[str]):
    def pull(object_id: str) -> bytes:
        log.append(object_id)
        if object_id not in store:
            raise ObjectPullError(object_id, "the object could not be found.")
        return store[object_id]
    return pull


def _arrays(msg: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in msg.content.array_records["arrays"].items()
            if v.stype == "numpy.ndarray"}


def _same(got: Message, want: Message) -> None:
    assert list(got.content.array_records) == list(want.content.array_records)
    for name, record in want.content.array_records.items():
        mine = got.content.array_records[name]
        assert list(mine) == list(record)
        for key, arr in record.items():
            assert (mine[key].dtype, mine[key].shape, mine[key].stype) == (
                arr.dtype, arr.shape, arr.stype)
            assert bytes(mine[key].data) == bytes(arr.data)
    assert dict(got.content.metric_records["metrics"]) == dict(want.content.metric_records["metrics"])
    assert dict(got.content.config_records["config"]) == dict(want.content.config_records["config"])
    assert got.metadata.message_type == want.metadata.message_type


@pytest.fixture(autouse=True)
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reply_pull, "CHUNKS_AT_ONCE", 2)  # several batches per large array


def test_a_reply_is_the_message_flower_would_inflate() -> None:
    rng = np.random.default_rng(0)
    zeros = np.zeros(4_000_000, np.float32)  # 16 MB: its 2nd and 3rd 5 MB chunks are one object
    arrays = {
        "big": Array(rng.standard_normal((1_700, 2_000)).astype(np.float32)),  # 13.6 MB
        "zeros": Array(zeros),
        "zeros-again": Array(zeros.copy()),  # the same object twice in one record
        "bias": Array(rng.standard_normal(2).astype(np.float64)),
        "count": Array(np.array(3, np.int64)),
        "empty": Array(np.zeros((0, 4), np.float32)),
        "custom": Array(dtype="float32", shape=(2,), stype="my.format", data=b"\x01" * 8),
    }
    msg = _message(arrays)
    store, log = _served(msg)
    tree = get_object_tree(msg)
    got = reply_pull.inflate_message(msg.object_id, tree, _puller(store, log))
    want = inflate_object_from_contents(msg.object_id, dict(store))
    _same(got, want)
    for name, arr in _arrays(want).items():
        np.testing.assert_array_equal(array_view(got.content.array_records["arrays"][name]), arr)
    np.testing.assert_array_equal(_arrays(got)["big"], _arrays(want)["big"])  # Flower's load
    # every object pulled, a chunk that repeats (zeros) or an array held twice only once
    chunks = [oid for oid in log if store[oid].startswith(ArrayChunk.__qualname__.encode())]
    assert set(log) == set(store)
    stored = [oid for oid in store if store[oid].startswith(ArrayChunk.__qualname__.encode())]
    assert sorted(chunks) == sorted(stored)  # zeros: 4 chunks, 3 objects


def test_the_arrays_are_read_only_views_of_one_buffer() -> None:
    msg = _message({"w": Array(np.arange(2_000_000, dtype=np.float32))})
    store, log = _served(msg)
    got = reply_pull.inflate_message(msg.object_id, get_object_tree(msg), _puller(store, log))
    view = array_view(got.content.array_records["arrays"]["w"])
    assert not view.flags.writeable
    np.testing.assert_array_equal(view, np.arange(2_000_000, dtype=np.float32))


def test_a_missing_chunk_is_flowers_pull_error() -> None:
    msg = _message({"w": Array(np.ones(2_000_000, np.float32))})
    store, log = _served(msg)
    chunk = next(oid for oid in store if store[oid].startswith(ArrayChunk.__qualname__.encode()))
    del store[chunk]
    with pytest.raises(ObjectPullError, match="could not be found"):
        reply_pull.inflate_message(msg.object_id, get_object_tree(msg), _puller(store, log))


def test_chunks_that_disagree_with_the_npy_header_are_refused() -> None:
    good = Array(np.ones(10, np.float32))
    bad = Array(dtype=good.dtype, shape=good.shape, stype=good.stype,
                data=bytes(good.data) + b"\0" * 8)
    msg = _message({"w": bad})
    store, log = _served(msg)
    with pytest.raises(ValueError, match=r"more bytes than its \.npy header declares"):
        reply_pull.inflate_message(msg.object_id, get_object_tree(msg), _puller(store, log))


def test_other_grids_keep_their_own_pull() -> None:
    assert not reply_pull.lean_pull_supported(object())

    class Grid:  # a grid with Flower's two calls, not Flower's HttpGrid
        def __init__(self) -> None:
            self.pulled: list[list[str]] = []

        def push_messages(self, messages):
            return [f"id{k}" for k, _ in enumerate(messages)]

        def pull_messages(self, ids):
            self.pulled.append(list(ids))
            out = []
            for i in ids:
                reply = Message(RecordDict(), dst_node_id=0, message_type="train")
                reply.metadata.__dict__["_reply_to_message_id"] = i
                out.append(reply)
            return out

    grid = Grid()
    msgs = [Message(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2)]
    assert len(send_and_collect(grid, msgs, timeout=5)) == 2
    assert grid.pulled == [["id0", "id1"]]


def test_an_object_still_arriving_is_tried_again_until_it_lands() -> None:
    """A SuperNode registers its reply before pushing its objects (the message's own last):
    the pull tries again shortly, not after Flower's 1-10 s waits."""
    msg = _message({"w": Array(np.ones(3, np.float32))})
    store, log = _served(msg)
    misses = {msg.object_id: 3}

    def pull(object_id: str) -> bytes:
        log.append(object_id)
        if misses.get(object_id, 0) > 0:
            misses[object_id] -= 1
            raise ObjectUnavailableError(object_id)
        return store[object_id]

    got = reply_pull.inflate_message(msg.object_id, get_object_tree(msg), pull, max_time=30)
    _same(got, inflate_object_from_contents(msg.object_id, dict(store)))
    assert log.count(msg.object_id) == 4
    assert reply_pull.RETRY_CAP_S <= 0.25


def test_an_object_that_never_lands_ends_the_pull_at_its_deadline() -> None:
    msg = _message({"w": Array(np.ones(3, np.float32))})

    def pull(object_id: str) -> bytes:
        raise ObjectUnavailableError(object_id)

    with pytest.raises(ObjectPullError, match="timeout or retry limit"):
        reply_pull.inflate_message(msg.object_id, get_object_tree(msg), pull, max_time=0.3)


def test_an_error_reply_is_the_error_flower_would_inflate() -> None:
    """A hospital whose training failed answers with an error and no content."""
    sent = Message(RecordDict(), dst_node_id=3, message_type="train")
    sent.metadata.__dict__["_message_id"] = sent.object_id
    error = Message(Error(code=0, reason="hospital h3, training: ValueError: bad rows"),
                    reply_to=sent)
    store, log = _served(error)
    got = reply_pull.inflate_message(error.object_id, get_object_tree(error), _puller(store, log))
    want = inflate_object_from_contents(error.object_id, dict(store))
    assert got.has_error() and not got.has_content()
    assert got.error.reason == want.error.reason
    assert got.metadata.reply_to_message_id == sent.object_id

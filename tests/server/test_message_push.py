"""`server.message_push`: instructions pushed to the SuperLink with Flower's requests, a few
objects at a time, store at the SuperLink what Flower's own push stores, without every chunk of
the model serialized at once (issue 43)."""

from __future__ import annotations

import hashlib
import tracemalloc
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fedsplit.server import message_push
from fedsplit.server.message_push import push_messages
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.proto.message_pb2 import PushObjectResponse
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import PushAppMessagesResponse
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    iterate_object_tree,
)
from flwr.superlink.grid.http_grid import HttpGrid


class SuperLink:
    """Flower's runtime API as the SuperLink answers it: ``PushMessages`` registers each
    message with its object tree and asks for the objects it does not hold yet; ``PushObject``
    stores one (kept as a digest, so the store holds no copy of the model)."""

    def __init__(self, holds: set[str] | None = None, refuse: int | None = None) -> None:
        self.holds = set(holds or ())
        self.stored: dict[str, str] = {}
        self.registered: list[str] = []
        self.refuse = refuse

    def PushMessages(self, request):
        if self.refuse is not None:
            raise httpx.HTTPStatusError("refused", request=httpx.Request("POST", "http://x"),
                                        response=httpx.Response(self.refuse))
        ids = [m.metadata.message_id for m in request.messages_list]
        self.registered.extend(ids)
        wanted = []
        for tree in request.message_object_trees:
            for node in iterate_object_tree(tree):
                if node.object_id not in self.holds and node.object_id not in wanted:
                    wanted.append(node.object_id)
        return PushAppMessagesResponse(message_ids=ids, objects_to_push=wanted, session_id="s1")

    def PushObject(self, request):
        assert request.session_id == "s1" and request.run_id == 7
        self.stored[request.object_id] = hashlib.sha256(request.object_content).hexdigest()
        return PushObjectResponse(stored=True)


def _grid(link: SuperLink) -> SimpleNamespace:
    """What `push_messages` and Flower's own push read of an ``HttpGrid``."""
    return SimpleNamespace(_runtime_client=link, node=Node(node_id=0), run=SimpleNamespace(run_id=7))


def _instructions(mib: int, nodes=(1, 2, 3)) -> list[Message]:
    """One instruction per node sharing one content, as the round loop builds them."""
    rng = np.random.default_rng(0)
    model = ArrayRecord({"big": Array(rng.standard_normal(mib * 2**18).astype(np.float32)),
                         "zeros": Array(np.zeros(3 * 2**20, np.float32)),
                         "bias": Array(np.ones(2, np.float64))})
    content = RecordDict({"arrays": model, "config": ConfigRecord({"server-round": 1})})
    msgs = [Message(content, dst_node_id=n, message_type="train") for n in nodes]
    for m in msgs:
        m.metadata.__dict__["_run_id"] = 7
    return msgs


def _deflated(messages: list[Message]) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in messages:
        out.update({oid: hashlib.sha256(obj.deflate()).hexdigest()
                    for oid, obj in get_all_nested_objects(m).items()})
    return out


def test_the_superlink_stores_what_flowers_own_push_stores() -> None:
    mine, flowers = SuperLink(), SuperLink()
    msgs = _instructions(12)
    ids = push_messages(_grid(mine), msgs)
    assert ids == mine.registered == [m.metadata.message_id for m in msgs] and len(ids) == 3
    assert mine.stored == _deflated(msgs)  # every object, in Flower's wire form
    theirs_msgs = _instructions(12)  # made apart: their messages' ids (times) differ
    for m in theirs_msgs:  # Flower's push_messages sets each id before it pushes
        m.metadata.__dict__["_message_id"] = m.object_id
    HttpGrid._try_push_messages(_grid(flowers), 7, theirs_msgs)

    def contents(link: SuperLink, sent: list[Message]) -> dict[str, str]:
        own = {m.metadata.message_id for m in sent}
        return {k: v for k, v in link.stored.items() if k not in own}

    assert contents(mine, msgs) == contents(flowers, theirs_msgs)  # records, arrays, chunks
    assert len(mine.stored) == len(contents(mine, msgs)) + 3  # the shared model went once


def test_objects_the_superlink_holds_are_not_pushed_again() -> None:
    msgs = _instructions(6, nodes=(1,))
    everything = _deflated(msgs)
    chunk_ids = [oid for oid in everything if oid not in
                 {m.metadata.message_id or m.object_id for m in msgs}][:3]
    link = SuperLink(holds=set(chunk_ids))
    push_messages(_grid(link), msgs)
    assert set(link.stored) == set(everything) - set(chunk_ids)


@pytest.mark.parametrize("at_once", [1, 2, 8])
def test_a_push_holds_a_few_chunks_not_a_second_model(monkeypatch: pytest.MonkeyPatch,
                                                      at_once: int) -> None:
    """Flower's push serializes every chunk of the model before it sends the first (the same
    model measured with its own push, so this test can tell them apart); `push_messages`
    holds a batch at a time."""
    monkeypatch.setattr(message_push, "OBJECTS_AT_ONCE", at_once)
    model_bytes = 48 * 2**20
    peaks = {}
    for who in ("fedsplit", "flower"):
        msgs = _instructions(48)
        for m in msgs:  # message and object ids computed first, as both pushes do
            m.metadata.__dict__["_message_id"] = m.object_id
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        if who == "fedsplit":
            push_messages(_grid(SuperLink()), msgs)
        else:
            HttpGrid._try_push_messages(_grid(SuperLink()), 7, msgs)
        peaks[who] = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    assert peaks["flower"] > model_bytes  # every chunk deflated at once
    assert peaks["fedsplit"] < (at_once + 3) * 5 * 2**20 + 2**20  # a batch of 5 MiB chunks


def test_an_instruction_the_superlink_refuses_as_too_large_is_named_not_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    assert push_messages(_grid(SuperLink(refuse=413)), _instructions(1)) == []
    assert "too large (HTTP 413)" in caplog.text
    with pytest.raises(httpx.HTTPStatusError):
        push_messages(_grid(SuperLink(refuse=500)), _instructions(1))


def test_nothing_to_push_asks_nothing() -> None:
    link = SuperLink()
    assert push_messages(_grid(link), []) == [] and link.registered == []

"""Pushing instructions to the SuperLink a few objects at a time (the deployment runtime).

Flower 1.42's ``HttpGrid.push_messages`` registers the messages with the SuperLink
(``PushMessages``, with each message's object tree), then pushes the objects the SuperLink
asks for with ``push_objects``. That function hands every object to its thread pool at once,
and each is deflated as it is handed over: every 5 MiB ``ArrayChunk`` of the model is copied
into its wire form before the first is sent. For the length of the push the coordinator held
the model twice (1.8x above idle at round 1's push of a 100M model, the peak of a run with the
SuperLink on SQLite: docs/scale.md).

`push_messages` makes the same requests with Flower's own code (``PushMessages``, then
``push_objects`` with Flower's push function and its retries), over batches of
`OBJECTS_AT_ONCE` objects in Flower's order, each batch deflated only when it goes: the model
once, and a few chunks in flight. Used for every push on Flower's ``HttpGrid``
(`server.exchange.send_and_collect`); other grids keep their own ``push_messages``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
from flwr.app import Message
from flwr.app.message import remove_content_from_message
from flwr.common.serde import message_to_proto
from flwr.proto.runtime_pb2 import PushAppMessagesRequest
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import push_objects

log = logging.getLogger(__name__)

#: objects (a model's 5 MiB ``ArrayChunk`` objects, mostly) deflated and pushed at once
OBJECTS_AT_ONCE = 8


def push_messages(grid: Any, messages: Sequence[Message]) -> list[str]:
    """Flower's ``HttpGrid.push_messages`` for ``messages``, their objects deflated and pushed
    `OBJECTS_AT_ONCE` at a time (module docstring). Returns the SuperLink's message ids in the
    order of ``messages``; an empty list when the SuperLink refuses the request as too large,
    as Flower's push does."""
    if not messages:
        return []
    client = grid._runtime_client  # the grid's connection to the SuperLink (Flower 1.42)
    try:
        with no_object_id_recompute():
            for msg in messages:
                msg.metadata.__dict__["_message_id"] = msg.object_id  # as Flower's push sets it
                if not (msg.metadata.message_id and msg.metadata.ttl > 0):
                    raise ValueError(f"Invalid message (no id or no time to live): {msg}")
            objects: dict[str, Any] = {}
            for msg in messages:
                objects.update(get_all_nested_objects(msg))
            res = client.PushMessages(PushAppMessagesRequest(
                messages_list=[message_to_proto(remove_content_from_message(m)) for m in messages],
                message_object_trees=[get_object_tree(m) for m in messages]))
            push = make_push_object_fn_protobuf(push_object_protobuf=client.PushObject,
                                                node=grid.node, run_id=grid.run.run_id,
                                                session_id=res.session_id)
            wanted = set(res.objects_to_push)
            order = [oid for oid in objects if oid in wanted]  # Flower's order: children first
            for start in range(0, len(order), OBJECTS_AT_ONCE):
                batch = {oid: objects.pop(oid) for oid in order[start:start + OBJECTS_AT_ONCE]}
                push_objects(batch, push_object_fn=push)
    except httpx.HTTPStatusError as e:
        if e.response.status_code == httpx.codes.REQUEST_ENTITY_TOO_LARGE:
            log.error("The SuperLink refused the instructions as too large (HTTP 413): raise "
                      "its request size limit, or send a smaller model. Received: %s", e)
            return []
        raise
    ids = list(res.message_ids)
    if any(not mid for mid in ids):
        log.warning("Not all instructions could be pushed to the SuperLink (an empty id stands "
                    "for each that was not, in the order sent); a malformed message?")
    return ids

"""Pulling replies from the SuperLink with one copy of each array (the deployment runtime).

Flower 1.42's ``HttpGrid.pull_messages`` pulls every object of a reply at once (a model is
5 MiB ``ArrayChunk`` objects), then inflates it: each ``Array`` joins its chunks into a
``bytearray`` and copies that into ``bytes``, while the pulled chunks stay alive until the
whole message is built. A 382 MiB reply held the coordinator at three copies of the model for
the length of that pull (docs/scale.md).

`pull_replies` does the same exchange with the SuperLink (Flower's ``PullMessages``, its
``PullObject`` per object with Flower's retries, ``ConfirmMessageReceived``) and builds the same
`Message`, but each ``Array``'s chunks are pulled `CHUNKS_AT_ONCE` at a time and copied into
one buffer of the array's final size, each batch dropped before the next: one copy of the
model and a few chunks. Every object other than the chunks (the message, its records, each
array's header, metrics and configs) is inflated by Flower's own code. Used for every pull on
Flower's ``HttpGrid``; other grids (the simulation engine's in-memory one, test doubles) keep
their ``pull_messages``, which copies nothing to begin with there.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
from fedsplit.protocol.update import npy_header
from flwr.app import Array, Message, Metadata
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.app.message.arraychunk import ArrayChunk
from flwr.common.constant import ErrorCode
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, ObjectTree
from flwr.proto.runtime_pb2 import PullAppMessagesRequest
from flwr.supercore.constant import PULL_MAX_TIME, SYSTEM_MESSAGE_TYPE
from flwr.supercore.date import now
from flwr.supercore.inflatable.inflatable_object import (
    InflatableObject,
    get_object_body,
    get_object_head_values_from_object_content,
)
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    inflate_object_from_contents,
    pull_objects,
)

#: chunks (Flower's 5 MiB ``ArrayChunk`` objects) pulled at once into an array's buffer
CHUNKS_AT_ONCE = 8
#: first wait and longest wait (s) between two tries of an object not there yet. A hospital's
#: SuperNode registers its reply before pushing its objects, the message's own object last, so
#: a reply found by a check is often still arriving; Flower's pull waits 1, 2, 4, 8, then 10 s
#: between tries, which left a finished reply up to 10 s at the SuperLink while the next ones
#: landed beside it (docs/scale.md)
RETRY_S, RETRY_CAP_S = 0.05, 0.25

PullObject = Callable[[str], bytes]


def lean_pull_supported(grid: Any) -> bool:
    """Whether ``grid`` is Flower's deployment ``HttpGrid`` (`pull_replies` speaks its API)."""
    from flwr.superlink.grid.http_grid import HttpGrid

    return isinstance(grid, HttpGrid)


def pull_replies(grid: Any, message_ids: Iterable[str], *, max_time: float | None = None
                 ) -> list[Message]:
    """Flower's ``HttpGrid.pull_messages`` for ``message_ids``, each reply's arrays built with
    one copy (module docstring). A reply whose objects cannot be pulled within ``max_time``
    seconds (None: Flower's limit, 2 hours) becomes an error reply, as Flower's own pull makes
    it."""
    run_id = grid.run.run_id
    client = grid._runtime_client  # the grid's connection to the SuperLink (Flower 1.42)
    res = client.PullMessages(PullAppMessagesRequest(message_ids=list(message_ids)))
    pull = make_pull_object_fn_protobuf(pull_object_protobuf=client.PullObject,
                                        node=grid.node, run_id=run_id)
    replies: list[Message] = []
    for msg_proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
        msg_id = msg_proto.metadata.message_id
        try:
            message = inflate_message(msg_id, tree, pull, max_time=max_time)
        except ObjectPullError as e:
            replies.append(_unavailable(msg_proto.metadata.src_node_id, grid.node.node_id, run_id,
                                        msg_proto.metadata.reply_to_message_id,
                                        "Reply message objects are unavailable. The sender "
                                        "may not have completed the upload before the "
                                        f"object-push session expired. {e}"))
            continue
        except ValueError as e:  # objects that do not make the message their tree says
            replies.append(_unavailable(msg_proto.metadata.src_node_id, grid.node.node_id, run_id,
                                        msg_proto.metadata.reply_to_message_id,
                                        f"Reply message objects are malformed: {e}"))
            continue
        client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(
            node=grid.node, run_id=run_id, message_object_id=msg_id))
        message.metadata.__dict__["_message_id"] = msg_id
        replies.append(message)
    return replies


def inflate_message(msg_id: str, tree: ObjectTree, pull: PullObject, *,
                    max_time: float | None = None) -> Message:
    """The message ``msg_id`` (its object ``tree``), every object pulled through ``pull``
    (an object not there yet tried again after `RETRY_S`, then at most every `RETRY_CAP_S`,
    for at most ``max_time`` s): the chunks of each ``Array`` `CHUNKS_AT_ONCE` at a time into
    its buffer, the rest inflated by Flower."""
    deadline = time.monotonic() + (PULL_MAX_TIME if max_time is None else max(0.0, max_time))
    pulls = functools.partial(_pull, pull=pull, deadline=deadline)
    contents: dict[str, bytes] = {}
    arrays: dict[str, InflatableObject] = {}
    level = [tree]
    while level:
        # each object once (the same record or array may sit twice in a message)
        unique = [node for oid, node in {n.object_id: n for n in level}.items()
                  if oid not in contents and oid not in arrays]
        pulled = pulls([node.object_id for node in unique])
        below: list[ObjectTree] = []
        for node in unique:
            content = pulled[node.object_id]
            if get_object_head_values_from_object_content(content)[0] == Array.__qualname__:
                arrays[node.object_id] = _array(content, pulls)
            else:
                contents[node.object_id] = content
                below.extend(node.children)
        level = below
    message = cast(Message, inflate_object_from_contents(msg_id, contents, objects=arrays))
    records = message.content.array_records.values() if message.has_content() else ()
    for record in records:  # an error reply has no content
        for array in record.values():  # Flower's records re-make each Array from its fields
            if isinstance(array.data, _Filled):
                array.data = array.data.buffer
    return message


def _pull(ids: list[str], *, pull: PullObject, deadline: float) -> dict[str, bytes]:
    if not ids:
        return {}
    return pull_objects(ids, pull, initial_backoff=RETRY_S, backoff_cap=RETRY_CAP_S,
                        max_time=max(0.0, deadline - time.monotonic()),
                        max_tries_per_object=None)


def _array(content: bytes, pulls: Callable[[list[str]], dict[str, bytes]]) -> Array:
    """One ``Array`` from its header ``content``, its chunks copied into one buffer."""
    children = get_object_head_values_from_object_content(content)[1]
    meta: dict[str, Any] = json.loads(get_object_body(content, Array).decode("utf-8"))
    order = [children[i] for i in meta["arraychunk_ids"]]
    array = Array(dtype=meta["dtype"], shape=tuple(meta["shape"]), stype=meta["stype"],
                  data=b"")
    parts = _Parts(array.stype)
    still_used = {chunk_id: order.count(chunk_id) for chunk_id in set(order)}
    kept: dict[str, memoryview] = {}  # chunks that come again later in this array
    for start in range(0, len(order), CHUNKS_AT_ONCE):
        batch = order[start:start + CHUNKS_AT_ONCE]
        pulled = pulls([c for c in dict.fromkeys(batch) if c not in kept])
        for chunk_id in batch:
            view = kept.get(chunk_id)
            if view is None:
                view = ArrayChunk.inflate(pulled[chunk_id]).data
            parts.add(view)
            still_used[chunk_id] -= 1
            if still_used[chunk_id]:
                kept[chunk_id] = view
            else:
                kept.pop(chunk_id, None)
        del pulled
    array.data = parts.joined()
    return array


class _Filled(bytes):
    """An empty ``bytes`` that stands for an array's buffer while Flower inflates the records
    around it (its ``Array`` takes only ``bytes``); `inflate_message` swaps the buffer in."""

    buffer: memoryview


class _Parts:
    """An array's bytes as its chunks arrive: a ``.npy`` array's go into one buffer of its
    final size (its header, in the first chunk, gives that size); any other ``stype``'s are
    joined at the end."""

    def __init__(self, stype: str) -> None:
        self.npy = stype == "numpy.ndarray"
        self.buffer: bytearray | None = None
        self.at = 0
        self.pieces: list[bytes] = []

    def add(self, view: memoryview) -> None:
        if self.npy and self.buffer is None and not self.pieces:
            size = _npy_size(view)
            if size is not None:
                self.buffer = bytearray(size)
        if self.buffer is None:
            self.pieces.append(bytes(view))
            return
        end = self.at + len(view)
        if end > len(self.buffer):
            raise ValueError(f"an array's chunks carry more bytes than its .npy header "
                             f"declares ({len(self.buffer)})")
        self.buffer[self.at:end] = view
        self.at = end

    def joined(self) -> bytes:
        """The array's bytes: joined, or a `_Filled` standing for the buffer."""
        if self.buffer is None:
            return b"".join(self.pieces)
        if self.at != len(self.buffer):
            raise ValueError(f"an array's chunks carry {self.at} bytes; its .npy header "
                             f"declares {len(self.buffer)}")
        filled = _Filled()
        filled.buffer = memoryview(self.buffer).toreadonly()
        return filled


def _npy_size(first: memoryview) -> int | None:
    """The whole ``.npy`` file's bytes (header and data), read from its first chunk; None when
    the header does not parse (the chunks are then joined as they come)."""
    header = npy_header(first)
    if header is None or header[2].hasobject:
        return None
    shape, _, dtype, offset = header
    return offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _unavailable(sender: int, node_id: int, run_id: int, reply_to: str, reason: str
                 ) -> Message:
    """The error reply Flower's pull makes for a reply whose objects cannot be pulled (here
    also for objects that do not inflate), with ``reason``; from the hospital that sent it
    (Flower's names the SuperLink), so the round names that hospital with the reason."""
    return make_message(
        metadata=Metadata(run_id=run_id, message_id="", src_node_id=sender,
                          dst_node_id=node_id, message_type=SYSTEM_MESSAGE_TYPE, group_id="",
                          ttl=0, reply_to_message_id=reply_to, created_at=now().timestamp()),
        error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=reason))


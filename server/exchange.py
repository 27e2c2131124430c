"""The one send-and-collect helper: push the instructions, collect the replies.

Every exchange of the coordinators goes through here: the round loop (`server.rounds`), the
set-up exchanges (`server.setup`), secure aggregation's stages (`server.secure.merge`), the
survival sums (`server.survival.app`) and the vertical coordinator's messages
(`server.vertical.app`).

Flower's ``Grid.send_and_receive`` checks for replies every 3 s in the deployment runtime
(``HttpGrid``), so an exchange whose last reply lands just after a check waits up to 3 s more.
`send_and_collect` does the same with Flower's public ``push_messages`` / ``pull_messages``
and checks every `POLL_S` seconds (one small request to the SuperLink each time; the
simulation engine's in-memory grid keeps its own shorter interval): measured in
docs/deployment.md. A grid without those two methods (a test double) gets its own
``send_and_receive``.

On Flower's simulation engine (its in-memory grid) at most `SIMULATION_WINDOW_PER_CPU`
instructions per CPU (at least 16) are in flight at once; the next go out as replies come in.
Its engine checks every 0.1 s, for every simulated hospital, every instruction it holds
(``InMemoryLinkState.get_message_ins``), so an exchange that pushes all N at once costs N x N
checks per 0.1 s: at 1,000 hospitals that scanning took most of a core and slowed every round
(docs/scale.md). Its Ray actors run one hospital per CPU anyway, so a window of them loses no
parallelism. Deployment pushes everything at once: there each hospital is its own machine.

Flower's ``pull_messages`` inflates every reply it finds before it returns: in the deployment
runtime each one is pulled from the SuperLink, joined from its chunks and held whole. When the
replies carry a large model, several landing between two checks would all be held at once; the
round loop therefore passes ``pull_at_once`` (`replies_at_once`: as many replies as fit in
`PULL_BUDGET` bytes, at least one), so at most that many are inflated before ``on_reply`` has
folded them and dropped their arrays (docs/scale.md). On Flower's deployment grid each
reply is pulled by `server.reply_pull.pull_replies`: the same exchange with the SuperLink, but
each array built in one buffer as its chunks arrive, not three copies at once; and the
instructions are pushed by `server.message_push.push_messages`: Flower's requests, a few
objects at a time, not every chunk of the model serialized before the first is sent.

`send_and_collect` returns whatever arrived, errors included (the loop records each hospital's
reason); `collect_all` is for the exchanges that need every answer (survival, vertical): an
error reply or a missing one is a `FederationError` naming them.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence

from fedsplit.protocol.errors import FederationError
from fedsplit.server.message_push import push_messages
from fedsplit.server.reply_pull import lean_pull_supported, pull_replies
from flwr.app import Message
from flwr.serverapp import Grid

POLL_S = 0.5  # seconds between two checks for replies (Flower's HttpGrid: 3 s)
#: instructions in flight at once on Flower's simulation engine, per CPU of this machine (its
#: Ray actors run one hospital per CPU; the engine's checks grow with the instructions it holds:
#: module docstring)
SIMULATION_WINDOW_PER_CPU = 8
#: bytes of replies one pull inflates at most (`replies_at_once`)
PULL_BUDGET = 256 * 2**20


def replies_at_once(reply_bytes: int) -> int:
    """How many replies of ``reply_bytes`` each one pull may inflate: as many as fit in
    `PULL_BUDGET`, at least one."""
    return max(1, PULL_BUDGET // max(1, int(reply_bytes)))


def _window(grid: Grid) -> int | None:
    """On Flower's simulation engine (its in-memory grid) `SIMULATION_WINDOW_PER_CPU` per CPU,
    at least 16; else None (all at once)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return None
    return max(16, SIMULATION_WINDOW_PER_CPU * (os.cpu_count() or 1))


def send_and_collect(grid: Grid, messages: Iterable[Message], *, timeout: float | None,
                     window: int | None = None,
                     on_reply: Callable[[Message], None] | None = None,
                     pull_at_once: int | None = None,
                     on_pushed: Callable[[], None] | None = None) -> list[Message]:
    """Push ``messages`` and return the replies that arrive within ``timeout`` seconds (None:
    wait for all), checking every `POLL_S` s. ``window``: at most that many instructions in
    flight, the rest pushed as replies come in (default: `_window`: 8 per CPU on the simulation
    engine, all at once elsewhere); an instruction still unsent at the deadline counts as
    unanswered. ``on_reply`` gets each reply as it is pulled, before the next check (the round
    loop folds a training reply in there: `server.merge.PlainMerge.receive`). ``pull_at_once``:
    at most that many replies pulled (so inflated) by one of Flower's ``pull_messages`` calls,
    each handed to ``on_reply`` before the next call (default: all that arrived).
    ``on_pushed`` runs once the first instructions are pushed, before any reply is pulled (the
    round loop moves the model it sent out of memory there: `server.bookkeeping.Round.park`).
    On Flower's deployment grid a reply still arriving is waited for at most until ``timeout``."""
    if pull_at_once is not None and pull_at_once < 1:  # before anything is pushed
        raise ValueError(f"pull_at_once is at least 1. Received: {pull_at_once}")
    messages = list(messages)
    if not messages:
        return []
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        for reply in replies if on_reply is not None else ():
            on_reply(reply)
        return replies
    poll = min(POLL_S, float(getattr(grid, "pull_interval", POLL_S)))  # simulation's: 0.1 s
    size = window or _window(grid) or len(messages)
    if size < 1:
        raise ValueError(f"window is at least 1. Received: {window}")
    lean = lean_pull_supported(grid)  # Flower's deployment grid: push and pull lean
    push = functools.partial(push_messages, grid) if lean else grid.push_messages
    unsent = messages[size:]
    waiting = {mid for mid in push(messages[:size]) if mid}  # none for a message not taken
    if on_pushed is not None:
        on_pushed()
    end = time.monotonic() + timeout if timeout is not None else None
    if lean:
        def pull(ids: list[str]) -> list[Message]:
            return pull_replies(grid, ids, max_time=None if end is None else end - time.monotonic())
    else:
        def pull(ids: list[str]) -> list[Message]:
            return list(grid.pull_messages(ids))
    replies: list[Message] = []
    while waiting:
        ids = sorted(waiting)
        step = pull_at_once or len(ids)
        for start in range(0, len(ids), step):
            got = pull(ids[start:start + step])
            for reply in got if on_reply is not None else ():
                on_reply(reply)
            replies.extend(got)
            waiting.difference_update(m.metadata.reply_to_message_id for m in got)
        if unsent and len(waiting) < size:
            room = size - len(waiting)
            waiting.update(mid for mid in push(unsent[:room]) if mid)
            unsent = unsent[room:]
        if not waiting or (end is not None and time.monotonic() >= end):
            break
        time.sleep(poll)
    return replies


def collect_all(grid: Grid, messages: Sequence[Message], *, timeout: float, what: str,
                who: str = "hospital") -> list[Message]:
    """`send_and_collect`, then refuse an exchange (``what``: its message type and stage) that
    any agent failed or did not answer within ``timeout`` s (``who``: "hospital" or "site")."""
    replies = send_and_collect(grid, messages, timeout=timeout)
    errors = [r for r in replies if r.has_error()]
    if errors:
        reasons = "; ".join(f"node {r.metadata.src_node_id}: {r.error.reason}" for r in errors)
        raise FederationError(f"{who.capitalize()} agent(s) failed during {what}: {reasons}")
    if len(replies) < len(messages):
        raise FederationError(f"Only {len(replies)} of {len(messages)} {who}s answered {what} "
                              f"within {timeout:.0f} s. Received: {len(replies)} replies")
    return replies

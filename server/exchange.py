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

`send_and_collect` returns whatever arrived, errors included (the loop records each hospital's
reason); `collect_all` is for the exchanges that need every answer (survival, vertical): an
error reply or a missing one is a `FederationError` naming them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from fedsplit.protocol.errors import FederationError
from flwr.app import Message
from flwr.serverapp import Grid

POLL_S = 0.5  # seconds between two checks for replies (Flower's HttpGrid: 3 s)


def send_and_collect(grid: Grid, messages: Iterable[Message], *, timeout: float | None
                     ) -> list[Message]:
    """Push ``messages`` and return the replies that arrive within ``timeout`` seconds (None:
    wait for all), checking every `POLL_S` s."""
    messages = list(messages)
    if not messages:
        return []
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        return list(grid.send_and_receive(messages, timeout=timeout))
    poll = min(POLL_S, float(getattr(grid, "pull_interval", POLL_S)))  # simulation's: 0.1 s
    waiting = set(grid.push_messages(messages))
    end = time.monotonic() + timeout if timeout is not None else None
    replies: list[Message] = []
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies.extend(got)
        waiting.difference_update(m.metadata.reply_to_message_id for m in got)
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

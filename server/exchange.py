"""One exchange with the hospitals: push the instructions, collect the replies.

Flower's ``Grid.send_and_receive`` checks for replies every 3 s in the deployment runtime
(``HttpGrid``), so an exchange whose last reply lands just after a check waits up to 3 s more.
`send_and_receive` does the same with Flower's public ``push_messages`` / ``pull_messages``
and checks every `POLL_S` seconds (one small request to the SuperLink each time; the
simulation engine's in-memory grid keeps its own shorter interval): measured in
docs/deployment.md. A grid without those two methods (a test double) gets its own
``send_and_receive``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

POLL_S = 0.5  # seconds between two checks for replies (Flower's HttpGrid: 3 s)


def send_and_receive(grid: Grid, messages: Iterable[Message], *, timeout: float | None
                     ) -> list[Message]:
    """Push ``messages`` and return the replies that arrive within ``timeout`` seconds (None:
    wait for all), checking every `POLL_S` s."""
    messages = list(messages)
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

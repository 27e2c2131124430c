"""The round loop's public hooks: its round bookkeeping (`RoundBook`) and its merge step.

`server.strategy.RegistryStrategy` (the loop) keeps one `RoundBook`, ``loop.book``, for every
(phase, round) it runs, ``phase`` being ``"train"`` or ``"evaluate"`` and the round the one
recorded (after the resume offset):

- which instructions were sent (`RoundBook.expect`): the hospitals whose replies the phase
  awaits, and how a reply is matched to the hospital it came from;
- which phases were skipped, and why (`RoundBook.skip`, read once by `RoundBook.take_skip`);
- who is missing once the replies are in (`RoundBook.missing`: one history entry per hospital
  that was sent an instruction and did not answer before the deadline);
- the site name of a reply (`RoundBook.site`: the name the hospital gave, else the one the
  setup exchange learnt, never a node id where a name is known).

A short round (the global model stays as it was, with the reason in the history) is recorded by
the loop itself (`RegistryStrategy.record_short`), the one writer of the run's history.

The merge step turns a round's training replies (`RoundReplies`) into a `Merge`: the history
entries of those replies, and either the aggregate (an `AggregateResult` over the tensors that
travel) with the averaged training metrics, or the reason the round is short. The loop's own
step is `RegistryStrategy.merge` (check each reply, merge with the registry rule); a wrapper
that changes how a round is merged supplies its own with `RegistryStrategy.use_merge` (secure
aggregation: `server.secure.strategy.SecureStrategy.merge`). Either way the loop then does what
every round shares: the server optimizer's step, the tensors that do not travel put back, and
the history write (`RegistryStrategy.aggregate_train`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedsplit.aggregation.base import AggregateResult
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.history import SiteEntry
from fedsplit.protocol.horizontal_wire import reply_site
from flwr.app import Message

log = logging.getLogger(__name__)

#: a (phase, round) key: ``("train", 3)``
PhaseKey = tuple[str, int]


class RoundBook:
    """What the loop knows about each phase of each round: instructions sent, phases skipped,
    and the hospitals' names (module docstring).

    Parameters
    ----------
    site_names : Mapping[int, str] | None (default: None)
        Node id -> hospital name, as the setup exchange learnt them; replies add to it.
    deadline : float | None (default: None)
        The per-phase reply deadline in seconds (``round-timeout``), named in the history entry
        of a hospital that did not answer.
    """

    def __init__(self, *, site_names: Mapping[int, str] | None = None,
                 deadline: float | None = None) -> None:
        #: node id -> hospital name
        self.site_names: dict[int, str] = dict(site_names or {})
        self.deadline = deadline
        #: (phase, round) -> the instructions sent, whose replies the phase awaits
        self.sent: dict[PhaseKey, list[Message]] = {}
        #: (phase, round) -> why the phase was skipped (nothing sent, model unchanged)
        self.skipped: dict[PhaseKey, str] = {}

    def expect(self, phase: str, server_round: int, msgs: Iterable[Message]) -> None:
        """Record the instructions sent in a phase (replacing any recorded before): the replies
        awaited are theirs, and a hospital among them that does not answer is missing."""
        self.sent[(phase, server_round)] = list(msgs)

    def skip(self, phase: str, server_round: int, reason: str) -> None:
        """Record that a phase was skipped, and why; no reply is awaited for it."""
        self.skipped[(phase, server_round)] = reason
        self.sent.pop((phase, server_round), None)

    def take_skip(self, phase: str, server_round: int) -> str | None:
        """Why the phase was skipped (and forget it), or None when it ran."""
        return self.skipped.pop((phase, server_round), None)

    def site(self, msg: Message, senders: Mapping[str, int]) -> str:
        """Site name of a reply, also of an error: the name the hospital gave (in its reply or
        in its error's one line), else the one the setup exchange learnt, else ``node-<id>``.

        ``senders`` (message id -> node, from `missing`) names the hospital a reply answers.
        A name the reply gives is remembered for the node."""
        node = senders.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
        if msg.has_content() and wire.SITE in msg.content.config_records:
            self.site_names[node] = reply_site(msg)
        elif msg.has_error() and (named := wire.failure_site(msg.error.reason)) is not None:
            self.site_names.setdefault(node, named)
        return self.site_names.get(node, f"node-{node}")

    def missing(self, phase: str, server_round: int, replies: list[Message]
                ) -> tuple[dict[str, int], list[SiteEntry]]:
        """Close the phase's awaited instructions against its ``replies``: (message id -> node,
        one history entry per hospital sent an instruction that did not answer in time)."""
        sent = self.sent.pop((phase, server_round), [])
        senders = {m.metadata.message_id: m.metadata.dst_node_id for m in sent
                   if m.metadata.message_id}
        answered = {senders.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)
                    for r in replies}
        limit = f"{self.deadline:.0f} s" if self.deadline is not None else "the deadline"
        missing = [
            SiteEntry(site=self.site_names.get(m.metadata.dst_node_id,
                                               f"node-{m.metadata.dst_node_id}"),
                      excluded=True, late=True,
                      reason=f"no {phase} reply within round-timeout ({limit})")
            for m in sent if m.metadata.dst_node_id not in answered
        ]
        for entry in missing:
            log.warning("Round %s: %s: %s", server_round, entry.site, entry.reason)
        return senders, missing


@dataclass
class RoundReplies:
    """A training round's replies, as the loop hands them to its merge step."""

    #: the round, after the resume offset (as recorded and as the hospitals were told)
    server_round: int
    #: the training replies, errors included, in the order they arrived
    replies: list[Message]
    #: message id -> node, for `RoundBook.site`
    senders: dict[str, int]
    #: the layout every reply must have (the travelling tensors of the model sent out)
    expected: list[ArraySpec] | None = None


@dataclass
class Merge:
    """What a merge step makes of a round's training replies.

    ``sites`` holds one history entry (`SiteEntry`) per reply (the loop adds the missing hospitals after
    them). Either ``result`` is the aggregate (over the tensors that travel; the server
    optimizer steps on it) and ``metrics`` the averaged training metrics, or ``error`` says
    why the global model stays as it was (a short round; ``result`` is None)."""

    sites: list[SiteEntry]
    result: AggregateResult | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


#: A merge step: a round's training replies -> what the loop records and sends on.
MergeStep = Callable[[RoundReplies], Merge]

"""What the round loop (`server.rounds.RoundLoop`) knows about a round, and the shapes of its
merge steps and hooks.

- `Round`: one round, owned by the loop from the moment it opens to its record in the history:
  its number as recorded and as the hospitals are told (the resume offset is applied once, by
  the loop, when it opens the round), the global model sent out and the tensors of it that
  travel back, the train and evaluate instructions sent, why nothing was sent (``skipped``), the
  merge step's own state for the round (``state``: secure aggregation's `SecureSum`) and the
  seconds each stage took (``stages``: secure aggregation's setup, share-keys, unmask).
- `RoundBook`: what outlives a round: the hospitals' names (the name a hospital gave, else the
  one the setup exchange learnt, never a node id where a name is known) and the reply deadline;
  it names the hospitals that were sent an instruction and did not answer (`RoundBook.missing`).
- `MergeStep`: how a round's training replies become the next global model. Its ``prepare``
  runs the stages the step needs before the training exchange (nothing for the plain step;
  secure aggregation's setup and share-keys), its ``merge`` turns the replies (`RoundReplies`)
  into a `Merge`: the history entries of the replies and either the aggregate (an
  `AggregateResult` over the tensors that travel) with the averaged training metrics, or the
  reason the round is short. The loop then does what every round shares: the server
  optimizer's step, the tensors that do not travel put back, the history write.
- `RoundHook`: called before a round's instructions are built and after it is recorded
  (differential privacy: `server.privacy.PrivacyHook`).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from fedsplit.aggregation.base import AggregateResult
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.horizontal_wire import reply_site
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.protocol.update import to_array_record
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

#: tensors `Round.park` writes to a file and maps back; smaller ones are copied in memory
PARK_MIN_BYTES = 1 << 20


@dataclass
class Round:
    """One round of the loop (module docstring)."""

    #: the round as recorded and as the hospitals are told (after the resume offset)
    number: int
    #: the global model sent out (every tensor); None when the round was not configured here
    #: (a Flower user calling the adapter's ``aggregate_train`` alone)
    model: dict[str, np.ndarray] | None = None
    #: the tensors of ``model`` that travel back from the hospitals (``federated``)
    shared: dict[str, np.ndarray] | None = None
    #: ``model`` as Flower's record, sent in the instructions (None once parked: `park`)
    record: ArrayRecord | None = None
    #: the train instructions sent (the replies awaited and merged)
    train: list[Message] = field(default_factory=list)
    #: the evaluate instructions sent in the same exchange (hospitals not training score the
    #: previous model)
    evaluate: list[Message] = field(default_factory=list)
    #: why nothing was sent for training (no quorum, secure aggregation could not start)
    skipped: str | None = None
    #: the merge step's own state for this round (secure aggregation: its `SecureSum`)
    state: Any = None
    #: stage -> seconds it took (secure aggregation's setup, share-keys, unmask)
    stages: dict[str, float] = field(default_factory=dict)
    #: when the round opened (``time.monotonic``)
    started: float = field(default_factory=time.monotonic)
    #: seconds from the opening to the round recorded (its ``train_seconds``), once closed
    seconds: float | None = None

    @property
    def layout(self) -> list[ArraySpec] | None:
        """The layout every training reply must have: the travelling tensors sent out (names,
        shapes, dtypes); None when unknown."""
        if self.shared is None:
            return None
        return [ArraySpec(name, tuple(int(d) for d in a.shape), np.dtype(a.dtype))
                for name, a in self.shared.items()]

    @property
    def shared_bytes(self) -> int:
        """The bytes of the travelling tensors sent out (a training reply's size); 0 when
        unknown."""
        return sum(int(a.nbytes) for a in (self.shared or {}).values())

    def elapsed(self) -> float:
        """Seconds since the round opened (rounded to the millisecond, as recorded)."""
        return round(time.monotonic() - self.started, 3)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time one stage of the round into ``stages``."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.stages[name] = time.monotonic() - start

    def completed(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new global model: the model sent out with its travelling tensors replaced by
        ``arrays`` (``arrays`` itself when every tensor travels or the model is unknown)."""
        if self.model is None or self.shared is None or set(self.shared) == set(self.model):
            return arrays
        return {**self.model, **arrays}

    def sent(self) -> ArrayRecord | None:
        """The model this round sent, as Flower's record (made again from the parked files
        when it was parked); None when the round was not configured here."""
        if self.record is not None or self.model is None:
            return self.record
        return to_array_record(self.model)

    def park(self, folder: str | Path | None = None) -> None:
        """Move the model this round sent out of memory, once its instructions are pushed (on
        Flower's deployment runtime the SuperLink then holds the copy the hospitals pull): each
        tensor of `PARK_MIN_BYTES` or more is written to a temporary ``.npy`` file in ``folder``
        (default: the system's temporary directory) and mapped back read-only, the file
        unlinked at once (the mapping keeps it readable, and nothing is left behind); smaller
        ones are copied. ``model`` and ``shared`` become those arrays, and the record and the
        instructions' arrays are dropped, so during the exchange the coordinator holds the
        replies it is pulling, not the model too (docs/scale.md). What reads the model later
        (a server optimizer, the tensors that do not travel, secure aggregation's decode)
        reads the mapped files."""
        if self.model is None:
            return
        parked: dict[str, np.ndarray] = {}
        try:
            where = Path(tempfile.mkdtemp(prefix="fedsplit-global-", dir=folder))
        except OSError as e:
            log.warning("Round %s: the model sent stays in memory: no temporary folder to park "
                        "it in (%s). Set TMPDIR to a folder with room for one model.",
                        self.number, e)
            return
        try:
            for k, (name, array) in enumerate(self.model.items()):
                if array.nbytes < max(PARK_MIN_BYTES, 1):  # an empty one cannot be mapped
                    parked[name] = np.array(array)
                    continue
                path = where / f"{k}.npy"
                np.save(path, array, allow_pickle=False)
                parked[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except OSError as e:  # a full disk: the round goes on with the model in memory
            log.warning("Round %s: the model sent stays in memory: parking it in %s failed "
                        "(%s). Free room there or set TMPDIR.", self.number, where, e)
            return
        finally:
            shutil.rmtree(where, ignore_errors=True)
        self.model = parked
        if self.shared is not None:
            self.shared = {name: parked[name] for name in self.shared}
        self.record = None
        self._drop_instruction_arrays()

    def let_go(self) -> None:
        """Drop the model this round sent, once it is closed: its views (or parked files), its
        record and the instructions' arrays (their content is shared, so each record goes
        once). The loop then holds one global model between rounds, not the one sent and the
        new one (docs/scale.md)."""
        self.model = self.shared = self.record = None
        self._drop_instruction_arrays()

    def _drop_instruction_arrays(self) -> None:
        for msg in (*self.train, *self.evaluate):
            if msg.has_content() and wire.ARRAYS in msg.content.array_records:
                del msg.content.array_records[wire.ARRAYS]


class RoundBook:
    """The hospitals' names and the reply deadline, across rounds (module docstring).

    Parameters
    ----------
    site_names : Mapping[int, str] | None (default: None)
        Node id -> hospital name, as the setup exchange learnt them; replies add to it.
    deadline : float | None (default: None)
        The per-exchange reply deadline in seconds (``round-timeout``), named in the history
        entry of a hospital that did not answer.
    """

    def __init__(self, *, site_names: Mapping[int, str] | None = None,
                 deadline: float | None = None) -> None:
        #: node id -> hospital name
        self.site_names: dict[int, str] = dict(site_names or {})
        self.deadline = deadline

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

    def missing(self, phase: str, number: int, sent: Sequence[Message], replies: list[Message]
                ) -> tuple[dict[str, int], list[SiteEntry]]:
        """Close the instructions ``sent`` in a phase (``"train"`` or ``"evaluate"``) of round
        ``number`` against their ``replies``: (message id -> node, one history entry per
        hospital sent an instruction that did not answer in time)."""
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
            log.warning("Round %s: %s: %s", number, entry.site, entry.reason)
        return senders, missing


@dataclass
class RoundReplies:
    """A round's training replies, as the loop hands them to its merge step."""

    #: the training replies, errors included, in the order they arrived
    replies: list[Message]
    #: message id -> node (`RoundBook.site`)
    senders: dict[str, int]
    #: the loop's book, which names each reply's hospital
    book: RoundBook

    def site(self, msg: Message) -> str:
        """The hospital a reply came from, by name (`RoundBook.site`)."""
        return self.book.site(msg, self.senders)


@dataclass
class Merge:
    """What a merge step makes of a round's training replies.

    ``sites`` holds one history entry (`SiteEntry`) per reply (the loop adds the missing
    hospitals after them). Either ``result`` is the aggregate (over the tensors that travel; the
    server optimizer steps on it) and ``metrics`` the averaged training metrics, or ``error``
    says why the global model stays as it was (a short round; ``result`` is None)."""

    sites: list[SiteEntry]
    result: AggregateResult | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class MergeStep(Protocol):
    """How a round's training replies become the next global model (module docstring):
    `server.merge.PlainMerge`, `server.secure.merge.SecureMerge`."""

    def prepare(self, rnd: Round, grid: Grid, timeout: float | None) -> None:
        """Run the stages this step needs before the training exchange: they may replace
        ``rnd.train`` (instructions with the step's own records) or set ``rnd.skipped``."""

    def receive(self, rnd: Round, msg: Message) -> None:
        """One reply of the round's exchange, as it is pulled (before `merge`): a step may
        take what it needs from it now (`PlainMerge` folds a training reply's arrays in and
        drops them from the message)."""

    def merge(self, rnd: Round, replies: RoundReplies) -> Merge:
        """The round's training replies -> what the loop records and sends on."""


class RoundHook(Protocol):
    """Called by the loop around every round (`server.privacy.PrivacyHook`)."""

    def before(self, rnd: Round) -> None:
        """The round is open (its model known), its instructions not yet built."""

    def after(self, rnd: Round) -> None:
        """The round's training is recorded in the history."""

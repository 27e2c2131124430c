"""The egress log's format: what left a hospital, one keyed, chained JSON line per reply.

A hospital's agent (`fedsplit.client.policy.egress`) appends one record to ``egress.jsonl`` in
its state folder (`fedsplit.client.policy.paths.state_dir`) for every reply it sends, refusals
included; ``fedsplit site egress`` reads and verifies it. This module is the contract both
follow: the files, the fields, the hash and MAC, and `verify`.

Files in the state folder:

- ``egress.jsonl``: one JSON object per line (`FIELDS`, then ``hash`` and ``mac``), appended
  whole and fsync'd under ``egress.lock`` (an ``fcntl.flock`` every writer takes), so several
  ClientApp processes of one hospital never interleave and no reader sees half a line;
- ``egress.key``: the HMAC key (64 hex digits), mode 0600, created with the first record;
- ``egress.head``: the id and hash of the last record written, with their MAC, replaced
  atomically after every append (records deleted from the end, all of them included, leave the
  log shorter than the head says).

A record holds its ``id`` (1, 2, ... = its line number), ``at`` (ISO-8601 UTC), the Flower
``run`` id, the ``coordinator`` (node config ``coordinator``: as the hospital configured it,
may be empty), the ``site``, the ``run_kind`` and ``message`` type, Flower's ``group`` id and
the instruction's server ``round`` (None when it has none), the ``outcome`` (`OUTCOMES`:
``sent``; ``refused`` by the hospital's policy; ``failed``: the agent's own error reply) and
its one-line ``reason``; what left: ``tensors`` (each ``record``, ``name``, ``kinds`` (of
`protocol.site_policy.SEND_KINDS`, or ``column-report``/``psi``, which ``send`` does not
govern), ``shape``, ``dtype``, ``bytes``), ``counts`` (``num-examples``, a report's ``rows``),
scalar ``metrics``, the class ``labels`` and the ``categories`` per column a column report
named, what it ``withheld`` per column, the ``epsilon`` a DP reply reports and the total
``bytes``; and ``prev_hash`` (the previous record's hash; `GENESIS` for the first).

``hash`` is the SHA-256 of the canonical JSON of every other field (`record_hash`); ``mac`` is
HMAC-SHA256(key, ``"record:" + hash``). Editing a line breaks its hash, recomputing the hash
needs the key for the MAC, deleting a line leaves a gap in the ids, moving one breaks the
chain, and deleting from the end leaves the log behind its head: `verify` names the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.keyfile import LogKey, read_key
from pydantic import BaseModel, ConfigDict

LOG_NAME = "egress.jsonl"
KEY_NAME = "egress.key"
HEAD_NAME = "egress.head"
LOCK_NAME = "egress.lock"
GENESIS = "0" * 64
#: What a reply's record says happened to it.
OUTCOMES = ("sent", "refused", "failed")
#: Kinds a record names besides `protocol.site_policy.SEND_KINDS`: the column report (governed
#: by the policy's label rules) and vertical PSI's blinded ID points (governed by run_kinds).
UNGOVERNED_KINDS = ("column-report", "psi")
#: Every field of a record but ``hash`` and ``mac``, in the order it is written.
FIELDS = ("id", "at", "run", "coordinator", "site", "run_kind", "message", "group", "round",
          "outcome", "reason", "tensors", "counts", "metrics", "labels", "categories",
          "withheld", "epsilon", "bytes", "prev_hash")
_KEY_BYTES = 32


def canonical(fields: dict[str, Any]) -> str:
    """The canonical JSON of a record's fields (sorted keys, no spaces, ASCII)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def record_hash(record: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a record's `FIELDS` (everything but hash and mac)."""
    return hashlib.sha256(canonical({k: record.get(k) for k in FIELDS}).encode("ascii")).hexdigest()


def record_line(record: dict[str, Any]) -> str:
    """A sealed record as its line (no newline): `FIELDS`, ``hash`` and ``mac``."""
    return json.dumps({**{k: record.get(k) for k in FIELDS}, "hash": record["hash"],
                       "mac": record["mac"]}, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


class EgressKey(LogKey):
    """The log's HMAC key: MACs records and its head file (`HEAD_NAME`, beside the key)."""

    head_name = "The egress log's head file"

    @classmethod
    def open(cls, folder: Path, *, create: bool) -> EgressKey:
        """The key in state folder ``folder`` (created there, mode 0600, when ``create`` and it
        is missing); a key others may read, or a damaged one, is refused (`ConfigError`)."""
        path = Path(folder) / KEY_NAME
        return cls(path, read_key(
            path, create=create, nbytes=_KEY_BYTES, name="The egress log's key file",
            records="egress records",
            made_by="the hospital's agent creates it with the first record; point --state-dir at "
                    "the hospital's state folder",
            restore="restore it from the hospital's backup"), path.with_name(HEAD_NAME))

    def seal(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` with their ``hash`` and ``mac``."""
        hash_ = record_hash(fields)
        return {**{k: fields.get(k) for k in FIELDS}, "hash": hash_, "mac": self.mac(hash_)}


@contextlib.contextmanager
def locked(folder: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the log's lock (``egress.lock``): exclusive for a writer, ``shared`` for a reader,
    so a reader never sees a record whose head is not yet written."""
    path = Path(folder) / LOCK_NAME
    if shared:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # no writer has run here yet
            yield
            return
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_lines(folder: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of the log in ``folder`` (none when it has no log);
    a last line without its newline is yielded as it is (`verify` reports it)."""
    path = Path(folder) / LOG_NAME
    if not path.exists():
        return
    with open(path, encoding="ascii", errors="replace", newline="\n") as fh:
        yield from enumerate(fh, start=1)


class EgressRecord(BaseModel):
    """One record as readers use it (``fedsplit site egress``): every field of `FIELDS`, its
    ``hash`` and ``mac`` (read as written; `verify` checks them)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: int
    at: str = ""
    run: int | None = None
    coordinator: str | None = None
    site: str | None = None
    run_kind: str | None = None
    message: str | None = None
    group: str | None = None
    round: int | None = None
    outcome: str | None = None
    reason: str | None = None
    tensors: list[dict[str, Any]] = []
    counts: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    labels: list[str] = []
    categories: dict[str, list[str]] = {}
    withheld: dict[str, int] = {}
    epsilon: float | None = None
    bytes: int = 0
    prev_hash: str = ""
    hash: str = ""
    mac: str = ""


def read_records(folder: Path) -> list[EgressRecord]:
    """Every complete record of the log in ``folder`` as written, oldest first (checked by
    `verify`, not here; a line that is not a record is skipped)."""
    out = []
    with locked(folder, shared=True):
        for _, line in read_lines(folder):
            if not line.endswith("\n"):
                continue
            try:
                out.append(EgressRecord.model_validate_json(line))
            except ValueError:
                continue
    return out


@dataclass(frozen=True)
class Verdict:
    """What `verify` found: ``ok``, how many records it checked, the last good hash, and the
    first problem with its line (None: the log as a whole)."""

    ok: bool
    records: int
    head: str
    problem: str | None = None
    line: int | None = None


def _locate(folder: Path, wanted: int, after: int) -> int | None:
    """The line (past ``after``) holding record ``wanted``, if any."""
    for number, line in read_lines(folder):
        if number <= after:
            continue
        try:
            if json.loads(line).get("id") == wanted:
                return number
        except (ValueError, AttributeError):
            continue
    return None


def verify(folder: Path) -> Verdict:
    """Walk the log in state folder ``folder`` from its first line; name the first changed,
    removed, reordered, forged, half-written or truncated line.

    Every record must carry its id (= its line number), the previous record's hash, its own
    hash and the key's MAC of it; the head file must name the last record.
    """
    folder = Path(folder)
    log, key_file = folder / LOG_NAME, folder / KEY_NAME
    if not log.exists() and not key_file.exists():
        raise ConfigError(f"There is no egress log in {folder}: point --state-dir at the "
                          f"hospital's state folder (node config state-dir, `fedsplit site run "
                          f"--state-dir`). Received: {folder}")
    key = EgressKey.open(folder, create=False)
    with locked(folder, shared=True):
        return _walk(folder, key)


def _walk(folder: Path, key: EgressKey) -> Verdict:
    try:
        signed = key.read_head()
    except ConfigError as e:
        return Verdict(False, 0, GENESIS, str(e), None)
    previous, count = GENESIS, 0
    for number, line in read_lines(folder):
        if not line.endswith("\n"):
            return Verdict(False, count, previous, f"line {number} is incomplete (no newline): "
                           f"half-written or cut", number)
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            return Verdict(False, count, previous, f"line {number} is not a JSON record: edited",
                           number)
        if set(record) != {*FIELDS, "hash", "mac"}:
            return Verdict(False, count, previous, f"line {number} has other fields than a "
                           f"record's: edited", number)
        rid = record["id"]
        if rid != number:
            at = _locate(folder, number, number) if isinstance(rid, int) else None
            if isinstance(rid, int) and rid > number and at is None:
                gap = f"record {number}" if rid == number + 1 else f"records {number}-{rid - 1}"
                return Verdict(False, count, previous, f"{gap} missing before line {number} "
                               f"(ids jump from {number - 1} to {rid}): deleted", number)
            where = f"; record {number} is at line {at}" if at is not None else ""
            return Verdict(False, count, previous, f"line {number} holds record {rid}{where}: "
                           f"reordered or edited", number)
        if record["prev_hash"] != previous:
            return Verdict(False, count, previous, f"line {number} does not follow line "
                           f"{number - 1} (its prev_hash is not that record's hash): reordered, "
                           f"replaced, or the line before edited", number)
        if record_hash(record) != record["hash"]:
            return Verdict(False, count, previous, f"line {number} was changed: its hash does "
                           f"not match its content", number)
        if not key.valid(record["hash"], record["mac"]):
            return Verdict(False, count, previous, f"line {number} carries a MAC this key did "
                           f"not make: written or rewritten without the hospital's key "
                           f"(forged)", number)
        previous, count = record["hash"], count + 1
    if signed is None:
        if count:
            return Verdict(False, count, previous, f"the head file {HEAD_NAME} is missing: it "
                           f"was deleted (records at the end may be gone)", None)
        return Verdict(True, 0, previous)
    if signed.id > count:
        return Verdict(False, count, previous, f"the head names record {signed.id} but the log "
                       f"ends at record {count}: line(s) {count + 1}-{signed.id} were removed "
                       f"from the end (truncated)", count + 1)
    if signed.id < count:
        return Verdict(False, count, previous, f"the log has {count - signed.id} record(s) "
                       f"past its head (record {signed.id}): the agent stopped between writing a "
                       f"record and its head, or the head file was replaced with an older one",
                       signed.id + 1)
    if signed.hash != previous:
        return Verdict(False, count, previous, f"record {signed.id} is not the one the head "
                       f"names: the log was rewritten", signed.id)
    return Verdict(True, count, previous)

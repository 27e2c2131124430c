"""The audit log: every security-relevant event, append-only, each record chained to the last and
MAC'd with a key the database does not hold.

A record holds its sequence number (``id``, never reused), time (ISO-8601 UTC), event, actor
(``admin``, a site name, or ``unauthenticated``), site id, client address and a JSON detail, plus
``prev_hash`` (the previous record's hash; 64 zeros for the first), ``hash`` (the SHA-256 of the
canonical JSON of every other field) and ``mac``: HMAC-SHA256 of the hash under the audit key
(`server.admin.auditkey`: a file outside the database, mode 0600). Editing a record breaks its
hash; deleting one leaves a gap in the ids; moving one breaks the chain; appending one, or
rewriting the chain with recomputed hashes, needs the key; deleting records from the end (all of
them included) leaves the log shorter than the key's head file says: `verify` names the first
such problem. Records written before the log had a key (``mac`` empty) are accepted only before
the first keyed one, checked by their hashes. The id is the head's plus one and ``prev_hash`` is
unique, so two writers can never fork the chain (the second retries on the new head).

Events (`EVENTS`): sign-in, sign-in failure, sign-out; upload, upload refused, aggregation, model
download (and refused download); round created, template; site added, site removed, token
rotated. Requests refused before any identity was known (no token, unknown token while rate
limited, wrong Host, oversized headers or bodies) are not written one by one: they are counted
and written as one ``unauthenticated`` summary record at most every `NOISE_INTERVAL_S` seconds,
so noise can neither flood the log nor push anything out (nothing is ever deleted or evicted).
The same event repeated by the same caller with the same detail (a hospital downloading one model
500 times) is written once, then counted, and the count written as one record with
``repeated: N`` once `COALESCE_S` seconds have passed since the first (`AuditLog.record`).
Retention: the server never deletes records; see docs/admin-api.md, "Audit log".
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fedsplit.server.admin.auditkey import AuditKey, Head
from fedsplit.server.admin.tables import AuditRecord
from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

GENESIS = "0" * 64
NOISE_INTERVAL_S = 60.0
#: Identical events within this many seconds of the first are counted, not written one by one.
COALESCE_S = 60.0
#: Distinct events counted at once (past it the oldest count is written).
MAX_COALESCED = 1000
_APPEND_TRIES = 50
EVENTS = (
    "signin", "signin_failed", "signout", "upload", "upload_refused", "aggregate",
    "model_download", "model_download_refused", "round_created", "template", "site_added",
    "site_removed", "token_rotated", "unauthenticated",
)


def record_hash(fields: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a record's fields (everything but ``hash``)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _fields(record: AuditRecord) -> dict[str, Any]:
    return {"id": record.id, "at": record.at, "event": record.event, "actor": record.actor,
            "site_id": record.site_id, "address": record.address, "detail": record.detail,
            "prev_hash": record.prev_hash}


_process_lock = threading.Lock()


def append(engine: Engine, key: AuditKey, event: str, *, actor: str, site_id: int | None = None,
           address: str | None = None, **detail: Any) -> AuditRecord:
    """Append one record, MAC'd with ``key``, in its own transaction (retried if another writer
    took the head); the key's head file then names it."""
    detail_json = json.dumps(detail, sort_keys=True, separators=(",", ":"), default=str)
    last_error: Exception | None = None
    with _process_lock:
        for attempt in range(_APPEND_TRIES):
            try:
                with Session(engine) as session, session.begin():
                    head = session.scalar(select(AuditRecord).order_by(AuditRecord.id.desc()).limit(1))
                    record = AuditRecord(
                        id=head.id + 1 if head is not None else 1,
                        at=datetime.now(UTC).isoformat(timespec="microseconds"), event=event,
                        actor=actor[:160], site_id=site_id,
                        address=address[:64] if address else None, detail=detail_json,
                        prev_hash=head.hash if head is not None else GENESIS, hash="",
                    )
                    session.add(record)
                    record.hash = record_hash(_fields(record))
                    record.mac = key.mac(record.hash)
                    signed = Head(record.id, record.hash)
                key.advance(signed)
                return record
            except (IntegrityError, OperationalError) as e:  # another process appended first
                last_error = e
                time.sleep(min(0.5, 0.01 * (attempt + 1)))
    raise RuntimeError(f"could not append to the audit log after {_APPEND_TRIES} tries: {last_error}")


@dataclass(frozen=True)
class Verdict:
    """What `verify` found: ``ok``, how many records, the head hash, the first problem, and how
    many records came before the log had a key (checked by their hashes only)."""

    ok: bool
    records: int
    head: str
    problem: str | None = None
    first_bad_id: int | None = None
    unkeyed: int = 0


def verify(engine: Engine, key: AuditKey, *, head: str | None = None) -> Verdict:
    """Walk the chain from the first record; report the first missing, edited, moved, forged or
    truncated record.

    Every record from the first keyed one on must carry ``key``'s MAC; the last record the key
    signed (its head file) must still be in the log. ``head``: a hash noted earlier (``audit
    verify`` prints it); it must be in the chain as well.
    """
    previous = GENESIS
    expected_id = 1
    count = unkeyed = 0
    keyed = False
    seen_head = head is None
    signed = key.read_head()
    signed_hash: str | None = None
    with Session(engine) as session:
        for record in session.scalars(select(AuditRecord).order_by(AuditRecord.id)).yield_per(1000):
            if record.id != expected_id:
                missing = (f"record {expected_id} is missing" if record.id == expected_id + 1
                           else f"records {expected_id}-{record.id - 1} are missing")
                return Verdict(False, count, previous, f"{missing} (the ids jump from "
                               f"{expected_id - 1} to {record.id}): deleted", expected_id, unkeyed)
            if record.prev_hash != previous:
                return Verdict(False, count, previous, f"record {record.id} does not follow record "
                               f"{record.id - 1}: its prev_hash is not that record's hash (records "
                               f"reordered, replaced or the earlier one edited)", record.id, unkeyed)
            if record_hash(_fields(record)) != record.hash:
                return Verdict(False, count, previous, f"record {record.id} was altered: its hash "
                               f"does not match its content", record.id, unkeyed)
            if record.mac is None and not keyed:
                unkeyed += 1  # written before the log had a key
            elif not key.valid(record.hash, record.mac):
                what = "carries no MAC" if record.mac is None else "carries a MAC this key did not make"
                return Verdict(False, count, previous, f"record {record.id} {what}: it was written "
                               f"or rewritten without the audit key (forged)", record.id, unkeyed)
            else:
                keyed = True
            if signed is not None and record.id == signed.id:
                signed_hash = record.hash
            previous = record.hash
            expected_id += 1
            count += 1
            if not seen_head and record.hash == head:
                seen_head = True
    if signed is not None and signed_hash is None:
        return Verdict(False, count, previous, f"the audit key signed records up to {signed.id}, but "
                       f"the log ends at record {count}: records after it were deleted", count + 1,
                       unkeyed)
    if signed is not None and signed_hash != signed.hash:
        return Verdict(False, count, previous, f"record {signed.id} is not the record the audit key "
                       f"signed as its last: the log was rewritten", signed.id, unkeyed)
    if not seen_head:
        return Verdict(False, count, previous, f"the noted head {head} is not in the chain: records "
                       f"after it were deleted, or the log was rewritten", None, unkeyed)
    return Verdict(True, count, previous, unkeyed=unkeyed)


def _iso(moment: datetime) -> str:
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.astimezone(UTC).isoformat(timespec="microseconds")


def parse_detail(record: AuditRecord) -> dict[str, Any]:
    """A record's detail as a dict."""
    try:
        value = json.loads(record.detail or "{}")
    except ValueError:
        return {"(unparsed)": record.detail}
    return value if isinstance(value, dict) else {"(unparsed)": value}


def query(engine: Engine, *, site_ids: list[int] | None = None, since: datetime | None = None,
          until: datetime | None = None, events: list[str] | None = None,
          limit: int = 100) -> list[AuditRecord]:
    """Records matching the filters, oldest first (the newest ``limit`` of them)."""
    statement = select(AuditRecord)
    if site_ids is not None:
        statement = statement.where(AuditRecord.site_id.in_(site_ids))
    if since is not None:
        statement = statement.where(AuditRecord.at >= _iso(since))
    if until is not None:
        statement = statement.where(AuditRecord.at <= _iso(until))
    if events:
        statement = statement.where(AuditRecord.event.in_(events))
    with Session(engine) as session:
        rows = list(session.scalars(statement.order_by(AuditRecord.id.desc()).limit(limit)))
    return rows[::-1]


class AuditLog:
    """The process's writer: `record` for events, `noise` for unauthenticated refusals."""

    def __init__(self, engine: Engine, key: AuditKey, *,
                 noise_interval_s: float = NOISE_INTERVAL_S, coalesce_s: float = COALESCE_S) -> None:
        self.engine = engine
        self.key = key
        self.coalesce_s = coalesce_s
        # identical events being counted: key -> [repeats since the first record, its time]
        self._repeats: dict[tuple[Any, ...], list[Any]] = {}
        self.noise_interval_s = noise_interval_s
        self._lock = threading.Lock()
        self._noise: Counter[str] = Counter()
        self._addresses: Counter[str] = Counter()
        self._since = time.monotonic()

    def record(self, event: str, *, actor: str, site_id: int | None = None,
               address: str | None = None, **detail: Any) -> None:
        """Append an event (after any noise counted so far is summarised).

        The same event from the same caller with the same detail, again within `COALESCE_S` of
        its first record, is counted instead (a hospital can make hundreds of identical
        downloads a second); the count is written as one record with ``repeated: N`` when that
        window has passed (at the next record or summary) or at shutdown.
        """
        self.flush_noise(force=False)
        detail_key = json.dumps(detail, sort_keys=True, separators=(",", ":"), default=str)
        key = (event, actor, site_id, address, detail_key)
        now = time.monotonic()
        with self._lock:
            due = self._due_repeats(now)
            entry = self._repeats.get(key)
            counted = entry is not None and now - entry[1] < self.coalesce_s
            if counted:
                entry[0] += 1  # type: ignore[index]
            else:
                self._repeats[key] = [0, now]
                while len(self._repeats) > MAX_COALESCED:
                    oldest = next(iter(self._repeats))
                    count, _ = self._repeats.pop(oldest)
                    if count:
                        due.append((oldest, count))
        self._write_repeats(due)
        if not counted:
            append(self.engine, self.key, event, actor=actor, site_id=site_id, address=address,
                   **detail)

    def _due_repeats(self, now: float, *, every: bool = False) -> list[tuple[tuple[Any, ...], int]]:
        """Take the repeat counts whose window has passed (``every``: all); under the lock."""
        due = []
        for key, (count, since) in list(self._repeats.items()):
            if every or now - since >= self.coalesce_s:
                del self._repeats[key]
                if count:
                    due.append((key, count))
        return due

    def _write_repeats(self, due: list[tuple[tuple[Any, ...], int]]) -> None:
        for (event, actor, site_id, address, detail_key), count in due:
            detail = json.loads(detail_key)
            append(self.engine, self.key, event, actor=actor, site_id=site_id, address=address,
                   **{**detail, "repeated": count, "coalesced_s": self.coalesce_s})

    def noise(self, kind: str, address: str | None) -> bool:
        """Count one unauthenticated refusal; True when a summary is due (`flush_noise`)."""
        with self._lock:
            self._noise[kind] += 1
            if len(self._addresses) < 10_000 or address in self._addresses:
                self._addresses[address or "unknown"] += 1
            return time.monotonic() - self._since >= self.noise_interval_s

    def flush_noise(self, *, force: bool = True) -> None:
        """Write the counted noise as one ``unauthenticated`` record (if any, and if due), and
        the repeat counts that are due (``force``, at shutdown: all)."""
        with self._lock:
            due = self._due_repeats(time.monotonic(), every=force)
        self._write_repeats(due)
        with self._lock:
            if not self._noise or (not force and time.monotonic() - self._since < self.noise_interval_s):
                return
            counts, addresses = dict(self._noise), self._addresses
            self._noise, self._addresses = Counter(), Counter()
            self._since = time.monotonic()
        append(self.engine, self.key, "unauthenticated", actor="unauthenticated",
               requests=sum(counts.values()), by_kind=counts, addresses=len(addresses),
               top_addresses=dict(addresses.most_common(5)))

"""The activity feed: one line per event, newest first, from the database and the run folders.

Events: a REST round created / aggregated, an upload accepted / replaced / refused; a Flower
run started / resumed / finished or failed, and each of its rounds aggregated ("round 7
aggregated: 4 of 5 hospitals returned, hospital-3 late"). A Flower round's time is the
modification time of its saved model or report (the history records durations, not times).
A site principal sees its own uploads and refusals, and rounds only as far as they concern it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from fedsplit.server.admin.auth import ADMIN, Principal
from fedsplit.server.admin.ui.rest import RestRound, UploadItem
from fedsplit.server.admin.ui.runs import FlowerRound, FlowerRun
from fedsplit.server.admin.ui.siterows import SiteRow

MAX_EVENTS = 60


@dataclass(frozen=True)
class Event:
    """One line of the feed; ``href`` links to the round or run."""

    at: datetime | None
    text: str
    href: str | None = None
    level: str = "info"  # info | warn | error


def _ts(seconds: float | None) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if isinstance(seconds, int | float) else None


def _left_out(rows: list[SiteRow], tags: tuple[str, ...] = ("late", "failed", "excluded",
                                                             "not selected")) -> str:
    parts = []
    for row in rows:
        for tag in tags:
            if tag in row.tags:
                parts.append(f"{row.site} {tag}")
                break
    return ", ".join(parts)


def summary_line(kind: str, number: int, rows: list[SiteRow], error: str | None = None) -> str:
    """'round 7 aggregated: 4 of 5 hospitals returned, hospital-3 late' (+ Krum's choice)."""
    returned = [r for r in rows if r.returned]
    text = f"{kind} {number} aggregated: {len(returned)} of {len(rows)} hospitals returned"
    if left := _left_out(rows, ("late", "failed", "excluded")):
        text += f", {left}"
    dropped = [r for r in returned if not r.used]
    if dropped:
        text += f"; {len(returned) - len(dropped)} used, {len(dropped)} not selected"
    if error:
        text = f"{kind} {number} not aggregated: {error}"
    return text


def rest_events(rounds: list[RestRound], uploads: list[UploadItem], principal: Principal) -> list[Event]:
    """Events of the REST rounds and uploads ``principal`` may see."""
    events: list[Event] = []
    admin = principal.role == ADMIN
    for rnd in rounds:
        href = f"/ui/rounds/{rnd.id}"
        events.append(Event(rnd.created_at, f"REST round {rnd.id} opened ({rnd.strategy}, needs "
                                            f"{rnd.min_uploads} upload(s))", href))
        if rnd.status == "aggregated":
            if admin:
                events.append(Event(rnd.aggregated_at, summary_line("REST round", rnd.id, rnd.rows), href))
            else:
                mine = rnd.rows[0] if rnd.rows else None
                part = ("your upload was used" if mine is not None and mine.used
                        else f"your upload was {_left_out([mine])}" if mine is not None
                        else "you sent no upload")
                events.append(Event(rnd.aggregated_at, f"REST round {rnd.id} aggregated: {part}", href))
    for item in uploads:
        href = f"/ui/rounds/{item.round_id}" if item.round_id is not None else None
        if item.refused:
            events.append(Event(item.at, f"{item.site}: upload to round {item.round_id} refused "
                                         f"({item.reason or item.status_code})", href, "error"))
        else:
            size = f"{item.size:,} bytes" if item.size is not None else "size unknown"
            events.append(Event(item.at, f"{item.site} uploaded to round {item.round_id} "
                                         f"({item.num_examples} examples, {size})", href))
            if item.replaced_at is not None:
                events.append(Event(item.replaced_at, f"{item.site} replaced its upload to round "
                                                      f"{item.round_id}", href))
    return events


def _round_time(run: FlowerRun, rnd: FlowerRound) -> datetime | None:
    for suffix in (".h5", ".report.json"):
        path = run.path / "models" / f"round-{rnd.number:03d}{suffix}"
        try:
            return _ts(path.stat().st_mtime)
        except OSError:
            continue
    return None


def run_events(runs: list[FlowerRun], principal: Principal) -> list[Event]:
    """Events of the Flower runs (a site sees runs it took part in, and only its own line)."""
    events: list[Event] = []
    admin = principal.role == ADMIN
    for run in runs:
        if not admin and principal.site_name not in run.participants:
            continue
        href = f"/ui/runs/{run.run_id}"
        if run.analysis_label is not None:
            level = "error" if run.status == "failed" else "info"
            events.append(Event(_ts(run.mtime), f"{run.analysis_label} {run.name}: {run.status}",
                                href, level))
            continue
        events.append(Event(_ts(run.started_at), f"run {run.name} started ({run.strategy}, "
                                                 f"{run.total_rounds or '?'} rounds)", href))
        for resume in run.resumed:
            events.append(Event(_ts(resume.at), f"run {run.name}: coordinator resumed after "
                                                 f"round {resume.after_round}", href, "warn"))
        for rnd in run.rounds:
            rhref = f"{href}/rounds/{rnd.number}"
            if admin:
                line = summary_line(f"{run.name}: round", rnd.number, rnd.rows, rnd.error)
                level = "error" if rnd.error else (
                    "warn" if _left_out(rnd.rows, ("late", "failed", "excluded")) else "info")
            else:
                mine = [r for r in rnd.rows if r.site == principal.site_name]
                part = ("your update was used" if mine and mine[0].used
                        else f"your update: {_left_out(mine)}" if mine else "you did not take part")
                line, level = f"{run.name}: round {rnd.number} done: {part}", "info"
            events.append(Event(_round_time(run, rnd), line, rhref, level))
        if run.status != "running" and run.finished_at is not None:
            level = "info" if run.status == "finished" else "error"
            text = f"run {run.name} {run.status}" + (f": {run.error}" if run.error and admin else "")
            events.append(Event(_ts(run.finished_at), text, href, level))
    return events


def feed(events: list[Event]) -> list[Event]:
    """The newest `MAX_EVENTS` events, newest first."""
    epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(events, key=lambda e: e.at or epoch, reverse=True)[:MAX_EVENTS]

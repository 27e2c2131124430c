"""``fedsplit admin audit show``: print audit records, filtered by hospital, time and event."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated

import typer
from fedsplit.cli.admin_options import DatabaseUrl, DataDir


def show(
    data_dir: DataDir,
    site: Annotated[str | None, typer.Option(help="Only this hospital's records.")] = None,
    since: Annotated[
        str | None, typer.Option(help="Only records at or after this time (ISO-8601; UTC if no zone).")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Only records at or before this time (ISO-8601; UTC if no zone).")
    ] = None,
    event: Annotated[
        list[str] | None, typer.Option("--event", help="Only this event (repeat), e.g. signin_failed.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most the newest N matching records.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Print matching records, oldest first: id, time, event, actor, address, detail."""
    from fedsplit.protocol.errors import ConfigError
    from fedsplit.server.admin import audit
    from fedsplit.server.admin.store import open_engine, site_ids_named

    if event:
        unknown = sorted(set(event) - set(audit.EVENTS))
        if unknown:
            raise ConfigError(f"--event takes one of {', '.join(audit.EVENTS)}. Received: {unknown}")
    bounds = {option: _moment(option, value) for option, value in (("--since", since), ("--until", until))}
    engine = open_engine(data_dir=data_dir, database_url=database_url)
    try:
        ids = site_ids_named(engine, site) if site is not None else None
        records = audit.query(engine, site_ids=ids, since=bounds["--since"], until=bounds["--until"],
                              events=event, limit=limit)
    finally:
        engine.dispose()
    for record in records:
        detail = audit.parse_detail(record)
        if as_json:
            typer.echo(json.dumps({"id": record.id, "at": record.at, "event": record.event,
                                   "actor": record.actor, "site_id": record.site_id,
                                   "address": record.address, "detail": detail,
                                   "hash": record.hash}, sort_keys=True))
        else:
            details = " ".join(f"{k}={v}" for k, v in sorted(detail.items()))
            typer.echo(f"{record.id:>6} {record.at} {record.event:<22} {record.actor}"
                       f"{' from ' + record.address if record.address else ''}  {details}")
    if not as_json:
        typer.echo(f"({len(records)} record(s))", err=True)


def _moment(option: str, value: str | None) -> datetime | None:
    from fedsplit.protocol.errors import ConfigError

    if value is None:
        return None
    try:
        return datetime.fromisoformat(value.strip())
    except ValueError:
        raise ConfigError(f"{option} takes an ISO-8601 time such as 2026-12-03 or "
                          f"2026-12-03T21:00:00+00:00. Received: {value!r}") from None

"""``fedsplit admin audit verify``: check the audit log's hash chain and its records' MACs."""

from __future__ import annotations

from typing import Annotated

import typer
from fedsplit.cli.admin_options import AuditKeyFile, DatabaseUrl, DataDir


def verify(
    data_dir: DataDir,
    head: Annotated[
        str | None,
        typer.Option(help="A head hash printed by an earlier verify: it must still be in the chain "
                          "(catches records deleted from the end)."),
    ] = None,
    database_url: DatabaseUrl = None,
    audit_key_file: AuditKeyFile = None,
) -> None:
    """Walk the chain and check every record's MAC with the audit key; exit 0 and print the head
    hash if intact, else exit 1 naming the first missing, altered, moved, forged or truncated
    record."""
    from fedsplit.server.admin import audit
    from fedsplit.server.admin.auditkey import AuditKey, key_path
    from fedsplit.server.admin.store import open_engine

    key = AuditKey.open(key_path(data_dir, audit_key_file), create=False)
    engine = open_engine(data_dir=data_dir, database_url=database_url)
    try:
        verdict = audit.verify(engine, key, head=head)
    finally:
        engine.dispose()
    if verdict.ok:
        before = (f" ({verdict.unkeyed} written before the log had a key, checked by hash only)"
                  if verdict.unkeyed else "")
        typer.echo(f"audit log intact: {verdict.records} record(s){before}; head {verdict.head}")
        return
    typer.echo(f"audit log BROKEN: {verdict.problem}. {verdict.records} record(s) before it "
               f"verified; last good hash {verdict.head}", err=True)
    raise typer.Exit(1)

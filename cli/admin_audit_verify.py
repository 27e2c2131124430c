"""``fedsplit admin audit verify``: check the audit log's hash chain."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def verify(
    data_dir: Annotated[Path, typer.Option(help="The admin API's --data-dir.")],
    head: Annotated[
        str | None,
        typer.Option(help="A head hash printed by an earlier verify: it must still be in the chain "
                          "(catches records deleted from the end)."),
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL; default sqlite in --data-dir.")
    ] = None,
) -> None:
    """Walk the chain; exit 0 and print the head hash if intact, else exit 1 naming the first
    missing, altered or moved record."""
    from fedsplit.server.admin import audit
    from fedsplit.server.admin.store import open_engine

    engine = open_engine(data_dir=data_dir, database_url=database_url)
    try:
        verdict = audit.verify(engine, head=head)
    finally:
        engine.dispose()
    if verdict.ok:
        typer.echo(f"audit log intact: {verdict.records} record(s); head {verdict.head}")
        return
    typer.echo(f"audit log BROKEN: {verdict.problem}. {verdict.records} record(s) before it "
               f"verified; last good hash {verdict.head}", err=True)
    raise typer.Exit(1)

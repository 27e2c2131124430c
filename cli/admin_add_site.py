"""``fedsplit admin add-site``: register a hospital and print its token once."""

from __future__ import annotations

from typing import Annotated

import typer
from fedsplit.cli.admin_options import AuditKeyFile, DatabaseUrl, DataDir


def add_site(
    name: Annotated[str, typer.Argument(help="Site name, e.g. hospital-a.")],
    data_dir: DataDir,
    cohort_size: Annotated[
        int | None, typer.Option(help="Rows the site holds; larger upload counts are refused.")
    ] = None,
    database_url: DatabaseUrl = None,
    audit_key_file: AuditKeyFile = None,
) -> None:
    """Register a site; its bearer token is printed once, alone on the last line."""
    from fedsplit.server.admin.store import add_site as store_add_site

    token = store_add_site(
        data_dir=data_dir, name=name, cohort_size=cohort_size, database_url=database_url,
        audit_key_file=audit_key_file,
    )
    typer.echo(
        f"Added site {name!r}"
        + (f" (cohort size {cohort_size})" if cohort_size is not None else "")
        + ". Its token, shown only now (the store keeps a hash):"
    )
    typer.echo(token)

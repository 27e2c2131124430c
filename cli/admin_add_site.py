"""``fedsplit admin add-site``: register a hospital and print its token once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def add_site(
    name: Annotated[str, typer.Argument(help="Site name, e.g. hospital-a.")],
    data_dir: Annotated[Path, typer.Option(help="The admin API's --data-dir.")],
    cohort_size: Annotated[
        int | None, typer.Option(help="Rows the site holds; larger upload counts are refused.")
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL; default sqlite in --data-dir.")
    ] = None,
    audit_key_file: Annotated[
        Path | None,
        typer.Option(envvar="FEDSPLIT_AUDIT_KEY_FILE",
                     help="The audit log's HMAC key file (default: DATA_DIR/audit.key)."),
    ] = None,
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

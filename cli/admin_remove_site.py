"""``fedsplit admin remove-site``: end a hospital's access (API tokens and web-view sessions)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def remove_site(
    name: Annotated[str, typer.Argument(help="The site's name, as add-site registered it.")],
    data_dir: Annotated[Path, typer.Option(help="The admin API's --data-dir.")],
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL; default sqlite in --data-dir.")
    ] = None,
    audit_key_file: Annotated[
        Path | None,
        typer.Option(envvar="FEDSPLIT_AUDIT_KEY_FILE",
                     help="The audit log's HMAC key file (default: DATA_DIR/audit.key)."),
    ] = None,
) -> None:
    """Remove a site: its token stops at once (API and web view, even on a running server);
    its past uploads stay, attributed to it, and its name stays taken."""
    from fedsplit.server.admin.store import remove_site as store_remove_site

    store_remove_site(data_dir=data_dir, name=name, database_url=database_url,
                      audit_key_file=audit_key_file)
    typer.echo(f"Removed site {name!r}: its token and its web-view sessions no longer work.")

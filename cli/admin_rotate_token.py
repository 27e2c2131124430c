"""``fedsplit admin rotate-token``: give a hospital a new token; the old one stops at once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def rotate_token(
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
    """Issue a new token for a site; its old token and web-view sessions end at their next
    request. The new token is printed once, alone on the last line."""
    from fedsplit.server.admin.store import rotate_token as store_rotate_token

    token = store_rotate_token(data_dir=data_dir, name=name, database_url=database_url,
                               audit_key_file=audit_key_file)
    typer.echo(f"New token for site {name!r}; the old one and its sessions no longer work. "
               "Shown only now (the store keeps a hash):")
    typer.echo(token)

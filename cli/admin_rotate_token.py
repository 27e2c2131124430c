"""``fedsplit admin rotate-token``: give a hospital a new token; the old one stops at once."""

from __future__ import annotations

import typer
from fedsplit.cli.admin_options import AuditKeyFile, DatabaseUrl, DataDir, SiteName


def rotate_token(
    name: SiteName,
    data_dir: DataDir,
    database_url: DatabaseUrl = None,
    audit_key_file: AuditKeyFile = None,
) -> None:
    """Issue a new token for a site; its old token and web-view sessions end at their next
    request. The new token is printed once, alone on the last line."""
    from fedsplit.server.admin.store import rotate_token as store_rotate_token

    token = store_rotate_token(data_dir=data_dir, name=name, database_url=database_url,
                               audit_key_file=audit_key_file)
    typer.echo(f"New token for site {name!r}; the old one and its sessions no longer work. "
               "Shown only now (the store keeps a hash):")
    typer.echo(token)

"""``fedsplit admin remove-site``: end a hospital's access (API tokens and web-view sessions)."""

from __future__ import annotations

import typer
from fedsplit.cli.admin_options import AuditKeyFile, DatabaseUrl, DataDir, SiteName


def remove_site(
    name: SiteName,
    data_dir: DataDir,
    database_url: DatabaseUrl = None,
    audit_key_file: AuditKeyFile = None,
) -> None:
    """Remove a site: its token stops at once (API and web view, even on a running server);
    its past uploads stay, attributed to it, and its name stays taken."""
    from fedsplit.server.admin.store import remove_site as store_remove_site

    store_remove_site(data_dir=data_dir, name=name, database_url=database_url,
                      audit_key_file=audit_key_file)
    typer.echo(f"Removed site {name!r}: its token and its web-view sessions no longer work.")

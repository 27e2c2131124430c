"""``fedsplit admin``: the admin API's server-side commands (serve, add-site)."""

from __future__ import annotations

import typer
from fedsplit.cli import admin_add_site, admin_serve

admin_app = typer.Typer(
    name="admin",
    help="Run the admin REST API for weight-file uploads and register sites.",
    no_args_is_help=True,
)
admin_app.command("serve")(admin_serve.serve)
admin_app.command("add-site")(admin_add_site.add_site)

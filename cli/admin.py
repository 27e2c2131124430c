"""``fedsplit admin``: the admin API's server-side commands (serve, sites, tokens, audit log)."""

from __future__ import annotations

import typer
from fedsplit.cli import (
    admin_add_site,
    admin_audit_show,
    admin_audit_verify,
    admin_remove_site,
    admin_rotate_token,
    admin_serve,
)

admin_app = typer.Typer(
    name="admin",
    help="Run the admin REST API for weight-file uploads, manage sites and read the audit log.",
    no_args_is_help=True,
)
admin_app.command("serve")(admin_serve.serve)
admin_app.command("add-site")(admin_add_site.add_site)
admin_app.command("remove-site")(admin_remove_site.remove_site)
admin_app.command("rotate-token")(admin_rotate_token.rotate_token)

audit_app = typer.Typer(name="audit", help="The tamper-evident audit log: verify, show.",
                        no_args_is_help=True)
audit_app.command("verify")(admin_audit_verify.verify)
audit_app.command("show")(admin_audit_show.show)
admin_app.add_typer(audit_app, name="audit")

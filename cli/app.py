"""Registers every ``fedsplit`` command; each lives in its own module."""

from __future__ import annotations

import sys

import typer

from cli import (
    admin,
    aggregate,
    certs,
    compare_strategies,
    export,
    pipeline_schedule,
    predict,
    privacy_audit,
    simulate,
    site,
    strategies,
    up,
    upload,
    vertical,
)
from cli.errors import run_guarded

app = typer.Typer(
    name="fedsplit",
    help="Federated learning for hospitals: train one model without pooling data.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("simulate")(simulate.simulate)
app.command("compare-strategies")(compare_strategies.compare_strategies)
app.command("predict")(predict.predict)
app.command("aggregate")(aggregate.aggregate)
app.command("strategies")(strategies.strategies)
app.command("privacy-audit")(privacy_audit.privacy_audit)
app.command("pipeline-schedule")(pipeline_schedule.pipeline_schedule)
app.add_typer(admin.admin_app, name="admin")
app.command("upload")(upload.upload)
app.command("export")(export.export)
app.command("up")(up.up)
app.add_typer(site.app, name="site")
app.command("certs")(certs.certs)
app.add_typer(vertical.app, name="vertical")


def main() -> None:
    """Console-script entry point."""
    sys.exit(run_guarded(app))  # thread limits: see cli/__init__.py

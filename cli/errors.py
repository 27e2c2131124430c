"""Turns fedsplit errors into one clear line and an exit code instead of a traceback."""

from __future__ import annotations

import click
import typer
from fedsplit.protocol.errors import FedsplitError
from rich.console import Console

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def run_guarded(app: typer.Typer, args: list[str] | None = None) -> int:
    """Run the typer app; print ``TypeName: message`` for fedsplit errors and return the exit code."""
    try:
        result = app(args=args, standalone_mode=False)
    except FedsplitError as e:
        err_console.print(f"[bold red]{type(e).__name__}[/]: {e}")
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        err_console.print("Aborted.")
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    return result if isinstance(result, int) else 0

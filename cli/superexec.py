"""``fedsplit superexec``: the coordinator's Flower SuperExec, running only fedsplit's own app.

It is ``flower-superexec`` (every argument passes through) started with the checking launchers
of `orchestration.app_trust` first on its PATH: the ServerApp of a run whose FAB is not the app
this installation builds is refused before any of it is installed or imported (one line in this
log). ``fedsplit up`` and the compose coordinator start it; run it the same way by hand.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(stderr=True, highlight=False, soft_wrap=True)


def superexec(
    ctx: typer.Context,
    flwr_home: Annotated[Path | None, typer.Option(help="The coordinator's Flower state folder "
                                                        "(default: $FLWR_HOME, else ~/.flwr).")] = None,
) -> None:
    """Run flower-superexec (its arguments after these) that runs only fedsplit's own app."""
    from fedsplit.orchestration.app_trust import prepare_home, trusted_env
    from fedsplit.orchestration.flower_runtime import flower_env, tool

    home = (flwr_home or Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")).resolve()
    trust = prepare_home(home, "coordinator")
    env = trusted_env(flower_env(home), home)
    console.print(f"coordinator SuperExec: runs only {', '.join(sorted(trust.apps.values()))} "
                  f"({home})")
    command = tool("flower-superexec")
    os.execve(command, [command, *ctx.args], env)


#: every argument it does not know goes to flower-superexec as it is
superexec.context_settings = {"allow_extra_args": True, "ignore_unknown_options": True}  # type: ignore[attr-defined]

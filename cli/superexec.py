"""``fedsplit superexec``: a Flower SuperExec that runs only the apps this installation trusts.

It is ``flower-superexec`` (every other argument passes through) started with the checking
launchers of `orchestration.app_trust` first on its PATH: a run whose FAB is not an app this
installation of fedsplit builds (or one the hospital's policy lists in ``trusted_apps``) is
refused before any of it is installed or imported, in one line of this process's log.

- The coordinator's (``fedsplit up``, the compose ``coordinator``): runs the ServerApp.
- A hospital's ClientApp runner when its agent uses ``--isolation process`` (the compose
  ``hospital-N-clientapp``): ``--name`` is the hospital, ``--policy`` its policy file.
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
    flwr_home: Annotated[Path | None, typer.Option(help="Its Flower state folder (default: "
                                                        "$FLWR_HOME, else ~/.flwr).")] = None,
    name: Annotated[str, typer.Option(help="Whose it is: coordinator, or the hospital's name "
                                           "(named in every refusal).")] = "coordinator",
    policy: Annotated[Path | None, typer.Option(help="A hospital's policy file: its "
                                                     "trusted_apps are trusted too.")] = None,
) -> None:
    """Run flower-superexec (its own arguments follow) that runs only trusted apps."""
    from fedsplit.orchestration.app_trust import prepare_home, trusted_env
    from fedsplit.orchestration.flower_runtime import flower_env, tool
    from fedsplit.protocol.site_policy import SitePolicy

    extra = {d: "trusted by this hospital's policy" for d in SitePolicy.load(policy).trusted_apps}
    home = (flwr_home or Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")).resolve()
    trust = prepare_home(home, name, extra)
    env = trusted_env(flower_env(home), home)
    console.print(f"{name} SuperExec: runs only {', '.join(sorted(set(trust.apps.values())))} "
                  f"({home})")
    command = tool("flower-superexec")
    os.execve(command, [command, *ctx.args], env)


#: every argument it does not know goes to flower-superexec as it is
superexec.context_settings = {"allow_extra_args": True,  # type: ignore[attr-defined]
                              "ignore_unknown_options": True}

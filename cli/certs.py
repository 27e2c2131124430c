"""``fedsplit certs``: write a test CA, a SuperLink certificate and SuperNode keys."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console()


def certs(
    out: Annotated[Path, typer.Option(help="Directory to write the CA, server cert and keys to.")],
    sites: Annotated[int, typer.Option(min=0, help="SuperNode key pairs to make (hospital-1..N).")] = 3,
    san: Annotated[
        list[str] | None,
        typer.Option("--san", help="Extra host names or IPs the SuperLink is reached at (repeatable or "
                                   "comma-separated); "
                                   "127.0.0.1 and localhost are always included."),
    ] = None,
) -> None:
    """Make a CA, a SuperLink certificate and SuperNode keys for a test deployment."""
    from fedsplit.orchestration.certs import DEFAULT_SANS, make_certs, site_names

    san = [name.strip() for entry in san or [] for name in entry.split(",") if name.strip()]
    paths = make_certs(out, site_names(sites), san)
    console.print(f"CA            {paths.ca}")
    console.print(f"SuperLink     {paths.server_cert} + {paths.server_key} "
                  f"(SAN: {', '.join([*DEFAULT_SANS, *san])})")
    for site, key in paths.supernode_keys.items():
        console.print(f"{site:<13} {key} + {key.name}.pub  (register: flwr supernode register "
                      f"{key}.pub <connection>)")

"""``fedsplit front-proxy``: the coordinator's public port, served by Debian's nginx.

Writes the nginx configuration of `orchestration.front_proxy` under ``--work`` and becomes
nginx (in the foreground, as the invoking user): TLS with the SuperLink's certificate on
``--listen``, the Fleet API and /health forwarded to the SuperLink on its loopback port,
everything else refused with 403. ``fedsplit up --tls`` starts the same proxy itself; the
compose TLS overlay and a coordinator set up by hand (docs/deployment.md) run this command.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(stderr=True, highlight=False, soft_wrap=True)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def front_proxy(
    listen: Annotated[str, typer.Option(help="Public HOST:PORT hospitals connect to, e.g. "
                                             "0.0.0.0:8000 (every interface) or the address "
                                             "of the coordinator's hospital-facing interface.")],
    superlink: Annotated[str, typer.Option(help="The SuperLink's own HOST:PORT, on loopback "
                                                "(flower-superlink --host 127.0.0.1).")],
    cert: Annotated[Path, typer.Option(help="The SuperLink's certificate (fedsplit certs: "
                                            "server.pem), presented to hospitals.")],
    key: Annotated[Path, typer.Option(help="Its private key (server.key).")],
    ca: Annotated[Path, typer.Option(help="The CA that signed it (ca.crt): the proxy checks the "
                                          "SuperLink against it.")],
    work: Annotated[Path, typer.Option(help="Folder for nginx's config, pid and temp files "
                                            "(written at every start).")],
) -> None:
    """Serve the public port with nginx: the Fleet API to the SuperLink, all else refused."""
    from fedsplit.orchestration.flower_runtime import split_address
    from fedsplit.orchestration.front_proxy import FrontProxy
    from fedsplit.protocol.errors import ConfigError

    split_address(listen)
    host, _ = split_address(superlink)
    if not _loopback(host):
        raise ConfigError("The SuperLink's own port serves the Control and Runtime APIs without "
                          "authentication: run it on loopback (flower-superlink --host 127.0.0.1) "
                          "and give that address here. Received: --superlink " + superlink)
    command = FrontProxy(listen, superlink, cert.resolve(), key.resolve(), ca.resolve()).command(work)
    console.print(f"front proxy: {listen} (TLS) -> Fleet API and /health only -> SuperLink "
                  f"{superlink}; Control and Runtime API refused (403); config {command[-1]}")
    os.execv(command[0], command)

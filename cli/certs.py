"""``fedsplit certs``: TLS material and SuperNode keys, each made where it is used.

``fedsplit certs --out DIR --san HOST`` (at the coordinator) writes the CA and the SuperLink's
certificate; ``fedsplit certs hospital-key --out DIR --name NAME`` (at a hospital) writes that
hospital's own key pair and prints the public key, the only part that travels (to the operator,
who registers it). ``--sites N`` also makes N hospital keys at the coordinator: for a rehearsal
on one machine only (``fedsplit up --tls`` and the compose test deployment do this).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)

certs = typer.Typer(
    name="certs",
    help="Make TLS material and SuperNode keys: the coordinator's CA and SuperLink certificate "
         "(fedsplit certs --out DIR), or a hospital's own key pair (fedsplit certs hospital-key).",
)


@certs.callback(invoke_without_command=True)
def coordinator(
    ctx: typer.Context,
    out: Annotated[Path | None, typer.Option(help="Directory to write the CA and the SuperLink's "
                                                  "certificate to (at the coordinator).")] = None,
    sites: Annotated[int, typer.Option(min=0, help="Also make N hospital key pairs here "
                                                   "(hospital-1..N): a one-machine rehearsal only; "
                                                   "real hospitals make their own "
                                                   "(fedsplit certs hospital-key).")] = 0,
    san: Annotated[
        list[str] | None,
        typer.Option("--san", help="Extra host names or IPs the SuperLink is reached at (repeatable or "
                                   "comma-separated); "
                                   "127.0.0.1 and localhost are always included."),
    ] = None,
) -> None:
    """Make the coordinator's CA and SuperLink certificate (and, with --sites, test keys)."""
    from fedsplit.orchestration.certs import DEFAULT_SANS, make_certs, site_names
    from fedsplit.protocol.errors import ConfigError

    if ctx.invoked_subcommand is not None:
        if out is not None or sites or san:
            raise ConfigError(f"--out, --sites and --san before `{ctx.invoked_subcommand}` belong "
                              f"to the coordinator's certificates; give the subcommand's own "
                              f"options after its name. Received: fedsplit certs ... "
                              f"{ctx.invoked_subcommand}")
        return
    if out is None:
        raise ConfigError("fedsplit certs needs --out DIR (at the coordinator), or the subcommand "
                          "hospital-key (at a hospital). Received: no --out")
    san = [name.strip() for entry in san or [] for name in entry.split(",") if name.strip()]
    paths = make_certs(out, site_names(sites), san)
    console.print(f"CA            {paths.ca} (send to every hospital) + {paths.ca_key} (keep here)")
    console.print(f"SuperLink     {paths.server_cert} + {paths.server_key} "
                  f"(SAN: {', '.join(dict.fromkeys([*DEFAULT_SANS, *san]))})")
    for site, key in paths.supernode_keys.items():
        console.print(f"{site:<13} {key} + {key.name}.pub  (rehearsal key, made here; register: "
                      f"flwr supernode register {key}.pub <connection>)")


@certs.command("hospital-key")
def hospital_key(
    out: Annotated[Path, typer.Option(help="Directory for this hospital's key pair (the private "
                                           "key stays here, 0600).")],
    name: Annotated[str, typer.Option(help="The hospital's name: the key files are NAME and "
                                           "NAME.pub.")],
    force: Annotated[bool, typer.Option(help="Replace an existing key (the operator must then "
                                             "register the new .pub).")] = False,
) -> None:
    """At a hospital: make its own NIST-EC key pair; print the public key to send to the operator."""
    from fedsplit.orchestration.certs import make_site_key

    key = make_site_key(out, name, overwrite=force)
    public = key.with_name(key.name + ".pub")
    console.print(f"private key   {key} (stays here: fedsplit site run --key {key})")
    console.print(f"public key    {public} (send it to the operator, who registers it: "
                  f"flwr supernode register {public.name} <connection> --name {name})")
    console.print(public.read_text().strip())

"""``fedsplit site``: what a hospital runs, and test partitions for simulated hospitals.

``fedsplit site run`` is the hospital agent: a Flower SuperNode whose ClientApp is fedsplit's
(``client/app.py``; Flower ships the code to it, the data never leaves), supervised by
`orchestration.site_agent`. Training uses the GPU when torch sees one (run config ``device=auto``).

``fedsplit site prepare`` cuts a bundled dataset into one folder per simulated hospital, which is
how ``fedsplit up`` and the compose init service give every hospital only its own rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from rich.console import Console

console = Console(stderr=True, highlight=False)
app = typer.Typer(help="Run a hospital agent, or prepare simulated hospitals' data.",
                  no_args_is_help=True)


@app.command("run")
def run(
    superlink: Annotated[str, typer.Option(help="The coordinator's SuperLink, HOST:PORT.")],
    data: Annotated[Path, typer.Option(help="This hospital's data: a CSV/Parquet/NPZ file, or a "
                                            "folder holding exactly one.")],
    root_cert: Annotated[Path | None, typer.Option(help="CA certificate that signed the "
                                                        "SuperLink's certificate (TLS).")] = None,
    key: Annotated[Path | None, typer.Option(help="This hospital's NIST-EC OpenSSH private key, "
                                                  "registered with the SuperLink (node auth).")] = None,
    insecure: Annotated[bool, typer.Option(help="Connect without TLS (tests on one machine only).")] = False,
    name: Annotated[str | None, typer.Option(help="Site name in reports (default: data folder).")] = None,
    port: Annotated[int, typer.Option(help="Port of this SuperNode's local Runtime API.")] = 9094,
    host: Annotated[str, typer.Option(help="Address of this SuperNode's local Runtime API.")] = "127.0.0.1",
    isolation: Annotated[str, typer.Option(help="subprocess: the agent runs the ClientApp itself; "
                                                "process: a separate flower-superexec does.")] = "subprocess",
    flwr_home: Annotated[Path | None, typer.Option(help="Flower state directory of this agent "
                                                        "(default ~/.fedsplit/<name>).")] = None,
    max_restarts: Annotated[int, typer.Option(min=0, help="Consecutive SuperNode restarts before "
                                                          "giving up.")] = 10,
) -> None:
    """Run this hospital's agent: a Flower SuperNode with fedsplit's ClientApp."""
    from fedsplit.client.site import resolve_data_path
    from fedsplit.orchestration.flower_runtime import flower_env, supernode_command
    from fedsplit.orchestration.site_agent import check_key, describe_device, supervise

    if root_cert is None and not insecure:
        raise ConfigError("Give --root-cert CA.crt to reach the SuperLink over TLS, or --insecure for "
                          "a plaintext test set-up. Received: neither")
    if root_cert is not None and insecure:
        raise ConfigError(f"--root-cert and --insecure exclude each other. Received: both ({root_cert})")
    if key is not None and root_cert is None:
        raise ConfigError("Node authentication (--key) needs TLS: add --root-cert. Received: --key "
                          f"{key} with --insecure")
    if isolation not in ("subprocess", "process"):
        raise ConfigError(f"--isolation must be subprocess or process. Received: {isolation!r}")
    if root_cert is not None and not root_cert.is_file():
        raise ConfigError(f"--root-cert must be a readable CA certificate file. Received: {root_cert}")
    if key is not None:
        check_key(key)
    data_file = resolve_data_path({"data-path": str(data.resolve())}, RunConfig())
    if not data_file.is_file():
        raise ConfigError(f"--data must be this hospital's data file or a folder holding it. "
                          f"Received: {data}")
    site_name = name or (data.name if data.is_dir() else data.stem)
    home = flwr_home or Path.home() / ".fedsplit" / site_name
    env = flower_env(home)
    home.mkdir(parents=True, exist_ok=True)
    cmd = supernode_command(superlink, data_path=data_file.resolve(), site_name=site_name, port=port,
                            host=host, root_cert=root_cert.resolve() if root_cert else None,
                            key=key.resolve() if key else None, isolation=isolation)
    console.print(f"{site_name}: SuperNode -> {superlink} ({'TLS' if root_cert else 'insecure'}"
                  f"{', node auth' if key else ''}); data {data_file}; trains on {describe_device()}")
    supervise(cmd, env, max_restarts=max_restarts, name=site_name)


@app.command("prepare")
def prepare(
    out: Annotated[Path, typer.Option(help="Writes OUT/hospital-1/, OUT/hospital-2/, ...")],
    dataset: Annotated[str, typer.Option(help="Bundled dataset to split.")] = "breast-cancer",
    sites: Annotated[int, typer.Option(min=1, help="Simulated hospitals.")] = 3,
    partition: Annotated[str, typer.Option(help="iid, dirichlet:ALPHA or sizes:n1,n2,...")] = "iid",
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
) -> None:
    """Split a bundled dataset into one data folder per simulated hospital."""
    from fedsplit.orchestration.experiment import prepare_partitions

    for path in prepare_partitions(out, dataset, sites, partition, seed).values():
        console.print(f"wrote {path.parent}")

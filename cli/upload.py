"""``fedsplit upload``: send a weight file to a round of the admin API, with a progress bar
(the client: `orchestration.upload_client`).

The site token is a secret, so it is never a command-line argument (arguments show in ``ps``
and in shell history): it is read from ``--token-file PATH`` or, without that option, from
the environment variable ``FEDSPLIT_SITE_TOKEN``. Surrounding whitespace is stripped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from fedsplit.orchestration.upload_client import TOKEN_ENV, read_token, upload_file

__all__ = ["TOKEN_ENV", "read_token", "upload"]


def upload(
    file: Annotated[Path, typer.Argument(help="Weight file (.h5), fedsplit or Keras layout.")],
    server: Annotated[str, typer.Option(help="Admin API base URL, e.g. https://coord:8080.")],
    round_id: Annotated[int, typer.Option("--round", help="Round id to upload to.")],
    num_examples: Annotated[
        int | None, typer.Option(help="Training rows; required if the file carries none.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server's answer.")] = 600.0,
    token_file: Annotated[
        Path | None,
        typer.Option(help=f"File holding this site's token (from `fedsplit admin add-site`). "
                          f"Default: the {TOKEN_ENV} environment variable."),
    ] = None,
    root_cert: Annotated[
        Path | None,
        typer.Option(help="CA certificate (PEM) to verify an HTTPS server with, e.g. the ca.crt of "
                          "`fedsplit certs`. Default: the system's CAs."),
    ] = None,
) -> None:
    """Upload FILE to round --round; prints the server's receipt (sha256 checked).

    The site token comes from --token-file or $FEDSPLIT_SITE_TOKEN, never from an argument.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    token = read_token(token_file, os.environ)
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn()
    ) as progress:
        task = progress.add_task(f"upload {file.name}",
                                 total=file.stat().st_size if file.is_file() else None)
        receipt = upload_file(file, server, round_id, token=token, num_examples=num_examples,
                              timeout=timeout, root_cert=root_cert,
                              on_bytes=lambda n: progress.update(task, advance=n))
    replaced = f", replaced upload {receipt['replaced']}" if receipt.get("replaced") else ""
    typer.echo(
        f"uploaded {file.name} to round {round_id}: upload {receipt['id']}, "
        f"{len(receipt['parameters'])} parameters, num_examples={receipt['num_examples']}, "
        f"{receipt['size']} bytes{replaced}"
    )
    typer.echo(f"sha256 {receipt['sha256']}")

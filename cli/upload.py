"""``fedsplit upload``: send a weight file to a round of the admin API, with a progress bar.

The site token is a secret, so it is never a command-line argument (arguments show in ``ps``
and in shell history): it is read from ``--token-file PATH`` or, without that option, from
the environment variable ``FEDSPLIT_SITE_TOKEN``. Surrounding whitespace is stripped.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from fedsplit.protocol.errors import ConfigError, UploadFailedError

CHUNK = 1024 * 1024
TOKEN_ENV = "FEDSPLIT_SITE_TOKEN"


def read_token(token_file: Path | None, environ: dict[str, str] | None = None) -> str:
    """Return the site token from ``token_file`` (when given) or ``$FEDSPLIT_SITE_TOKEN``."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        try:
            text = token_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f"--token-file {token_file} does not exist. Save the site's token (from `fedsplit "
                f"admin add-site`) there, readable only by you (chmod 600). Received: {token_file}"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"--token-file {token_file} cannot be read ({type(e).__name__}: {e}); it must be a "
                f"readable text file holding the site's token. Received: {token_file}"
            ) from None
        token = text.strip()
        if not token:
            raise ConfigError(
                f"--token-file {token_file} is empty; it must hold the site's token (from "
                f"`fedsplit admin add-site`). Received: {len(text)} byte(s) of whitespace"
            )
        return token
    if TOKEN_ENV in env:
        token = env[TOKEN_ENV].strip()
        if not token:
            raise ConfigError(
                f"{TOKEN_ENV} is set but empty; set it to the site's token (from `fedsplit admin "
                f"add-site`) or pass --token-file PATH. Received: {TOKEN_ENV}={env[TOKEN_ENV]!r}"
            )
        return token
    raise ConfigError(
        f"No site token: set {TOKEN_ENV} to the site's token (from `fedsplit admin add-site`) or "
        f"pass --token-file PATH (a file holding it). A token is never a command-line argument: "
        f"arguments show in `ps` and in shell history. Received: neither"
    )


def multipart_parts(filename: str, num_examples: int | None) -> tuple[str, bytes, bytes]:
    """Return (boundary, bytes before the file, bytes after it) of the multipart body."""
    boundary = secrets.token_hex(16)
    safe = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
    head = b""
    if num_examples is not None:
        head += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="num_examples"\r\n\r\n'
            f"{num_examples}\r\n"
        ).encode()
    head += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{safe}"\r\n'
        f"Content-Type: application/x-hdf5\r\n\r\n"
    ).encode()
    return boundary, head, f"\r\n--{boundary}--\r\n".encode()


def tls_verify(root_cert: Path | None) -> ssl.SSLContext | bool:
    """The TLS verification httpx uses: the system's CAs, or only ``root_cert``."""
    if root_cert is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(root_cert))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"--root-cert must be a readable PEM CA certificate, e.g. the ca.crt written by "
            f"`fedsplit certs` ({e}). Received: {root_cert}"
        ) from e


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
    import httpx
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    token = read_token(token_file)
    verify = tls_verify(root_cert)

    if not file.is_file():
        raise UploadFailedError(f"{file} does not exist or is not a file. Received: {file}")
    size = file.stat().st_size
    boundary, head, tail = multipart_parts(file.name, num_examples)
    digest = hashlib.sha256()
    url = f"{server.rstrip('/')}/api/v1/rounds/{round_id}/uploads"
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn()
    ) as progress:
        task = progress.add_task(f"upload {file.name}", total=size)

        def body() -> Iterator[bytes]:
            yield head
            with open(file, "rb") as fh:
                while chunk := fh.read(CHUNK):
                    digest.update(chunk)
                    progress.update(task, advance=len(chunk))
                    yield chunk
            yield tail

        try:
            response = httpx.post(
                url,
                content=body(),
                headers={
                    "Authorization": f"Bearer {token}",
                    "Content-Type": f"multipart/form-data; boundary={boundary}",
                    "Content-Length": str(len(head) + size + len(tail)),
                },
                timeout=httpx.Timeout(timeout, connect=30.0),
                verify=verify,
            )
        except httpx.HTTPError as e:
            raise UploadFailedError(
                f"Could not upload to {url} ({type(e).__name__}: {e}). Check --server and that the "
                f"admin API is running. Received: {server}"
            ) from e
    if response.status_code != 201:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise UploadFailedError(f"The server refused the upload (HTTP {response.status_code}): {detail}")
    receipt = response.json()
    if receipt["sha256"] != digest.hexdigest():
        raise UploadFailedError(
            "The server stored different bytes than were sent (sha256 mismatch); upload again. "
            f"Received: server {receipt['sha256']} vs local {digest.hexdigest()}"
        )
    replaced = f", replaced upload {receipt['replaced']}" if receipt.get("replaced") else ""
    typer.echo(
        f"uploaded {file.name} to round {round_id}: upload {receipt['id']}, "
        f"{len(receipt['parameters'])} parameters, num_examples={receipt['num_examples']}, "
        f"{receipt['size']} bytes{replaced}"
    )
    typer.echo(f"sha256 {receipt['sha256']}")

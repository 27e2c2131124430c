"""The upload client: send a weight file to a round of the admin API (``fedsplit upload``).

`read_token` finds the site's token (a secret, so never a command-line argument: arguments
show in ``ps`` and in shell history): ``--token-file PATH`` or, without it, the environment
variable ``FEDSPLIT_SITE_TOKEN``; surrounding whitespace is stripped. `upload_file` streams the
file as one multipart POST (1 MiB chunks, never the whole file in memory), hashing it on the
way, and checks the server's receipt: HTTP 201 and the same sha256. Every failure is an
`UploadFailedError` (or a `ConfigError` for a bad token or CA file) saying what to do.
"""

from __future__ import annotations

import hashlib
import secrets
import ssl
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fedsplit.protocol.errors import ConfigError, UploadFailedError

CHUNK = 1024 * 1024
TOKEN_ENV = "FEDSPLIT_SITE_TOKEN"


def read_token(token_file: Path | None, environ: Mapping[str, str]) -> str:
    """Return the site token from ``token_file`` (when given) or ``FEDSPLIT_SITE_TOKEN`` in
    ``environ`` (the command's environment, read where it starts)."""
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
    if TOKEN_ENV in environ:
        token = environ[TOKEN_ENV].strip()
        if not token:
            raise ConfigError(
                f"{TOKEN_ENV} is set but empty; set it to the site's token (from `fedsplit admin "
                f"add-site`) or pass --token-file PATH. Received: {TOKEN_ENV}={environ[TOKEN_ENV]!r}"
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


def upload_file(file: Path, server: str, round_id: int, *, token: str,
                num_examples: int | None = None, timeout: float = 600.0,
                root_cert: Path | None = None,
                on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
    """POST ``file`` to round ``round_id`` of the admin API at ``server``; return the receipt.

    ``on_bytes(n)`` is called as each chunk of ``n`` bytes is sent (a progress bar). The
    receipt (``id``, ``sha256``, ``parameters``, ``num_examples``, ``size``, ``replaced``) is
    the server's, its sha256 checked against the bytes sent.
    """
    import httpx

    verify = tls_verify(root_cert)
    if not file.is_file():
        raise UploadFailedError(f"{file} does not exist or is not a file. Received: {file}")
    size = file.stat().st_size
    boundary, head, tail = multipart_parts(file.name, num_examples)
    digest = hashlib.sha256()
    url = f"{server.rstrip('/')}/api/v1/rounds/{round_id}/uploads"

    def body() -> Iterator[bytes]:
        yield head
        with open(file, "rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
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
    return receipt

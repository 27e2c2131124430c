"""TLS material and SuperNode keys for a test deployment (``fedsplit certs``, ``fedsplit up --tls``).

Writes, with the ``cryptography`` library (no openssl binary needed):

- ``ca.crt`` / ``ca.key``: a private certificate authority (EC P-384, 1 year);
- ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the CA, whose subject
  alternative names cover 127.0.0.1, localhost and every ``--san`` (e.g. the compose service name);
- ``supernodes/<name>`` / ``supernodes/<name>.pub``: one NIST-EC (P-384) key pair per hospital in
  OpenSSH format, which is what ``flower-supernode --auth-supernode-private-key`` and
  ``flwr supernode register`` read.

Private keys are written 0600. For production, use certificates from the hospital network's own CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from fedsplit.protocol.errors import ConfigError

VALID_DAYS = 365
DEFAULT_SANS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertPaths:
    """Where `make_certs` wrote everything."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    supernode_keys: dict[str, Path]

    def public_key(self, site: str) -> Path:
        """The OpenSSH public key of ``site``."""
        key = self.supernode_keys[site]
        return key.with_name(key.name + ".pub")


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedsplit test deployment"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _san_entry(value: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        return x509.DNSName(value)


def write_supernode_key(path: Path) -> Path:
    """Write a P-384 key pair as OpenSSH files ``path`` (private, 0600) and ``path.pub``."""
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    path.with_name(path.name + ".pub").write_bytes(public + f" {path.name}\n".encode())
    return path


def site_names(count: int) -> list[str]:
    """Names of ``count`` simulated hospitals: hospital-1, hospital-2, ..."""
    return [f"hospital-{i}" for i in range(1, count + 1)]


def make_certs(out: Path, sites: list[str], sans: list[str] | None = None) -> CertPaths:
    """Create the CA, the server certificate and one key pair per site under ``out``."""
    now = dt.datetime.now(dt.UTC)
    names = list(dict.fromkeys([*DEFAULT_SANS, *(sans or [])]))
    for site in sites:
        if not site or "/" in site or site.startswith("."):
            raise ConfigError(f"A site name must be a plain file name such as hospital-1. "
                              f"Received: {site!r}")
    out.mkdir(parents=True, exist_ok=True)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedsplit test CA"))
        .issuer_name(_name("fedsplit test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san_entry(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    paths = CertPaths(out / "ca.crt", out / "ca.key", out / "server.pem", out / "server.key", {})
    paths.ca.write_bytes(ca_cert.public_bytes(pem))
    _write_private(paths.ca_key, ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    paths.server_cert.write_bytes(server_cert.public_bytes(pem))
    _write_private(paths.server_key, server_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    for site in sites:
        paths.supernode_keys[site] = write_supernode_key(out / "supernodes" / site)
    return paths

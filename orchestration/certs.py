"""TLS material and SuperNode keys (``fedsplit certs``, ``fedsplit up --tls``), each made where
it is used, so that only public parts travel:

- at the coordinator (`make_coordinator_certs`): ``ca.crt`` / ``ca.key``, a private certificate
  authority (EC P-384, 1 year), and ``server.pem`` / ``server.key``, the SuperLink's certificate
  (also presented by its front proxy), signed by the CA, whose subject alternative names cover
  127.0.0.1, localhost and every ``--san`` (e.g. the coordinator's public DNS name). Only
  ``ca.crt`` leaves the coordinator;
- at each hospital (`make_site_key`, ``fedsplit certs hospital-key``): its own NIST-EC (P-384)
  key pair in OpenSSH format, which is what ``flower-supernode --auth-supernode-private-key``
  reads. Only ``NAME.pub`` leaves the hospital, for the operator's ``flwr supernode register``.

`make_certs` makes both on one machine (``fedsplit up --tls``, the compose test deployment,
``fedsplit certs --sites N``): a rehearsal, whose hospital keys were made by the coordinator.
Private keys are written 0600 with the cryptography library (no openssl binary needed). For
production, the coordinator's certificate may come from the hospital network's own CA instead.
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
class CoordinatorCerts:
    """Where `make_coordinator_certs` wrote the coordinator's CA and SuperLink certificate."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class CertPaths:
    """Where `make_certs` wrote everything (a one-machine rehearsal)."""

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


def check_site_name(site: str) -> str:
    """``site`` when it can name a key file (hospital-1), else a `ConfigError`."""
    if not site or "/" in site or "\\" in site or site.startswith(".") or site.strip() != site:
        raise ConfigError(f"A site name must be a plain file name such as hospital-1. "
                          f"Received: {site!r}")
    return site


def make_site_key(out: Path, site: str, *, overwrite: bool = False) -> Path:
    """A hospital's own key pair, made where it runs: ``out/site`` (private, 0600, stays there)
    and ``out/site.pub`` (what the hospital sends to the operator to register). An existing
    key is kept unless ``overwrite``: replacing a registered key locks the hospital out."""
    path = out / check_site_name(site)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists: it may be the key the coordinator registered. Keep it, "
                          f"or give --force to replace it (then send the new .pub to the operator "
                          f"to register). Received: {path}")
    return write_supernode_key(path)


def site_names(count: int) -> list[str]:
    """Names of ``count`` simulated hospitals: hospital-1, hospital-2, ..."""
    return [f"hospital-{i}" for i in range(1, count + 1)]


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


def make_coordinator_certs(out: Path, sans: list[str] | None = None) -> CoordinatorCerts:
    """At the coordinator: the CA and the SuperLink's certificate under ``out``."""
    now = dt.datetime.now(dt.UTC)
    names = list(dict.fromkeys([*DEFAULT_SANS, *(sans or [])]))
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
    paths = CoordinatorCerts(out / "ca.crt", out / "ca.key", out / "server.pem", out / "server.key")
    _write_cert(paths.ca, ca_cert)
    _write_key(paths.ca_key, ca_key)
    _write_cert(paths.server_cert, server_cert)
    _write_key(paths.server_key, server_key)
    return paths


def make_certs(out: Path, sites: list[str], sans: list[str] | None = None) -> CertPaths:
    """A one-machine rehearsal: the coordinator's CA and SuperLink certificate under ``out``,
    and one hospital key pair per site under ``out/supernodes`` (`make_site_key`)."""
    for site in sites:
        check_site_name(site)
    made = make_coordinator_certs(out, sans)
    keys = {site: make_site_key(out / "supernodes", site, overwrite=True) for site in sites}
    return CertPaths(made.ca, made.ca_key, made.server_cert, made.server_key, keys)

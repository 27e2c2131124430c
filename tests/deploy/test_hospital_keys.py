"""Keys are made where they are used (issue 40): the coordinator's `fedsplit certs` makes the CA
and the SuperLink's certificate only; a hospital makes its own key pair with `fedsplit certs
hospital-key` and sends only the public key."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration.certs import make_certs, make_coordinator_certs, make_site_key
from fedsplit.protocol.errors import ConfigError


def test_coordinator_makes_no_hospital_keys(tmp_path: Path) -> None:
    """`fedsplit certs --out DIR` (default --sites 0): CA + SuperLink certificate, no private key
    of any hospital."""
    assert run_guarded(app, ["certs", "--out", str(tmp_path), "--san", "fl.example.org"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key", "server.key", "server.pem"]
    made = make_coordinator_certs(tmp_path / "again")
    server = x509.load_pem_x509_certificate(made.server_cert.read_bytes())
    server.verify_directly_issued_by(x509.load_pem_x509_certificate(made.ca.read_bytes()))
    assert made.ca_key.stat().st_mode & 0o777 == 0o600


def test_hospital_makes_its_own_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fedsplit certs hospital-key`: a P-384 OpenSSH pair, private 0600; the public key is
    printed to send; an existing key is kept unless --force."""
    args = ["certs", "hospital-key", "--out", str(tmp_path / "keys"), "--name", "hospital-7"]
    assert run_guarded(app, args) == 0
    private = tmp_path / "keys" / "hospital-7"
    public = (tmp_path / "keys" / "hospital-7.pub").read_text().strip()
    assert private.stat().st_mode & 0o777 == 0o600
    key = serialization.load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    printed = capsys.readouterr().out
    assert public in printed and "flwr supernode register hospital-7.pub" in printed
    before = private.read_bytes()
    assert run_guarded(app, args) == 2  # kept: it may be the registered one
    assert "--force" in capsys.readouterr().err and private.read_bytes() == before
    assert run_guarded(app, [*args, "--force"]) == 0 and private.read_bytes() != before
    with pytest.raises(ConfigError, match="plain file name"):
        make_site_key(tmp_path, "../elsewhere")


def test_rehearsal_makes_both_on_one_machine(tmp_path: Path) -> None:
    """`make_certs` (fedsplit up --tls, the compose test deployment, --sites N) = both parts."""
    paths = make_certs(tmp_path, ["hospital-1", "hospital-2"], ["superlink"])
    assert sorted(paths.supernode_keys) == ["hospital-1", "hospital-2"]
    assert paths.public_key("hospital-1").is_file()
    assert run_guarded(app, ["certs", "--out", str(tmp_path / "cli"), "--sites", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli" / "supernodes").iterdir()) == [
        "hospital-1", "hospital-1.pub", "hospital-2", "hospital-2.pub"]
    # the group's options belong before a subcommand only when they are its own
    assert run_guarded(app, ["certs", "--out", str(tmp_path / "x"), "hospital-key", "--out",
                             str(tmp_path / "k"), "--name", "h"]) == 2
    assert run_guarded(app, ["certs"]) == 2

"""`fedsplit certs` material, the site agent's refusals of bad arguments, and resume rules."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration.certs import make_certs
from fedsplit.protocol.errors import ConfigError, ResumeMismatchError
from fedsplit.server.history import RunHistory, data_changes, find_resume_point


def test_certs_chain_san_and_node_keys(tmp_path: Path) -> None:
    """The server cert is signed by the CA, names 127.0.0.1/localhost/extra SANs; node keys are P-384."""
    assert run_guarded(app, ["certs", "--out", str(tmp_path), "--sites", "2",
                             "--san", "superlink,linkhost"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert {"localhost", "superlink", "linkhost"} <= set(san.get_values_for_type(x509.DNSName))
    assert (tmp_path / "server.key").stat().st_mode & 0o777 == 0o600
    for site in ("hospital-1", "hospital-2"):
        key = serialization.load_ssh_private_key((tmp_path / "supernodes" / site).read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        public = serialization.load_ssh_public_key((tmp_path / "supernodes" / f"{site}.pub").read_bytes())
        assert public.public_numbers() == key.public_key().public_numbers()


def _site(tmp_path: Path, *extra: str) -> int:
    data = tmp_path / "hospital"
    data.mkdir(exist_ok=True)
    (data / "data.csv").write_text("a,target\n1,0\n2,1\n")
    return run_guarded(app, ["site", "run", "--superlink", "127.0.0.1:9", "--data", str(data), *extra])


def test_site_agent_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No TLS choice, a key without TLS, or a non-EC key: exit 2 before any process starts (a
    data folder with nothing to read: exit 13, HospitalFailure)."""
    assert _site(tmp_path) == 2
    assert "--root-cert CA.crt" in capsys.readouterr().err
    paths = make_certs(tmp_path / "certs", ["hospital-1"])
    assert _site(tmp_path, "--insecure", "--key", str(paths.supernode_keys["hospital-1"])) == 2
    assert "needs TLS" in capsys.readouterr().err
    ed = tmp_path / "ed25519"
    ed.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    assert _site(tmp_path, "--root-cert", str(paths.ca), "--key", str(ed)) == 2
    assert "NIST elliptic-curve" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    # an empty data folder: refused by the pre-flight read, naming the hospital and the stage
    assert run_guarded(app, ["site", "run", "--superlink", "h:1", "--insecure", "--data", str(empty)]) == 13
    assert "hospital empty, reading its data" in capsys.readouterr().err


def _history(out: Path, status: str, rounds: int, strategy: str = "fedavg",
             fingerprint: str = "{}") -> dict:
    data = {"status": status, "config": {"strategy": strategy, "num-server-rounds": 5,
                                         "data-fingerprint": fingerprint},
            "model_id": "mlp:x", "rounds": [{"round": r, "train": {}, "evaluate": {}}
                                            for r in range(1, rounds + 1)]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps(data))
    (out / "global.h5").write_bytes(b"")
    return data


def test_resume_point_rules(tmp_path: Path) -> None:
    """Unfinished runs resume after their last trained round; finished ones start over;
    a different configuration is refused instead of mixed in."""
    cfg = {"strategy": "fedavg", "num-server-rounds": 8, "data-fingerprint": "{}"}
    assert find_resume_point(tmp_path / "none", cfg) is None
    _history(tmp_path / "done", "finished", 3)
    assert find_resume_point(tmp_path / "done", cfg) is None
    _history(tmp_path / "empty", "running", 0)
    assert find_resume_point(tmp_path / "empty", cfg) is None
    previous = _history(tmp_path / "cut", "running", 2)
    previous["rounds"].append({"round": 3})  # started, never trained
    (tmp_path / "cut" / "history.json").write_text(json.dumps(previous))
    point = find_resume_point(tmp_path / "cut", cfg)
    assert point is not None and point.last_round == 2 and point.model_id == "mlp:x"
    history = RunHistory(tmp_path / "cut", cfg, previous=point.history)
    assert [r["round"] for r in history.data["rounds"]] == [1, 2]
    assert history.data["resumed"][-1]["after_round"] == 2 and history.data["status"] == "running"
    with pytest.raises(ResumeMismatchError, match=r"different configuration.*--no-resume.*\['strategy'\]"):
        find_resume_point(tmp_path / "cut", {**cfg, "strategy": "median"})


def test_a_failed_survival_summary_resumes_with_another_min_count(tmp_path: Path) -> None:
    """Every round trained, then the summary refused ("Lower min-count"): the rerun with a lower
    min-count resumes after the last round (nothing retrains); another change is still refused."""
    previous = _history(tmp_path / "run", "failed", 5)
    previous["config"]["min-count"] = 400
    (tmp_path / "run" / "history.json").write_text(json.dumps(previous))
    cfg = {**previous["config"], "min-count": 5}
    point = find_resume_point(tmp_path / "run", cfg)
    assert point is not None and point.last_round == 5
    with pytest.raises(ResumeMismatchError, match=r"\['penalizer'\]"):
        find_resume_point(tmp_path / "run", {**cfg, "penalizer": 0.1})


SITE = {"rows": 120, "columns": 31, "sha256": "a" * 64}


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ({"site-0": SITE}, {"site-0": SITE}, []),  # same data (GOOD)
        ({"site-0": SITE}, {"site-0": {**SITE, "rows": 118}}, ["site-0: rows 120 -> 118"]),
        ({"site-0": SITE}, {"site-0": {**SITE, "rows": 118, "columns": 30}},
         ["site-0: rows 120 -> 118, columns 31 -> 30"]),
        ({"site-0": SITE}, {"site-0": {**SITE, "sha256": "b" * 64}},
         ["site-0: content changed (sha256 aaaaaaaaaaaa -> bbbbbbbbbbbb)"]),
        ({"site-0": SITE, "site-1": SITE}, {"site-0": SITE},  # a site left
         ["site-1: no longer in the run (held 120 rows)"]),
        ({"site-0": SITE}, {"site-0": SITE, "site-1": {**SITE, "rows": 7}}, ["site-1: new site (7 rows)"]),
        ({}, {"site-0": SITE}, ["the saved run recorded no data fingerprint, so its site data cannot be "
                                "checked"]),  # written before fingerprints existed
    ],
)
def test_data_changes_name_the_site_and_how(before: dict, after: dict, expected: list[str]) -> None:
    assert data_changes(before, after) == expected


def test_resume_is_refused_when_a_site_holds_other_data(tmp_path: Path) -> None:
    """Same configuration, other site data: ResumeMismatchError naming the site and the fix."""
    saved = json.dumps({"site-0": SITE, "site-1": SITE})
    _history(tmp_path / "run", "running", 2, fingerprint=saved)
    cfg = {"strategy": "fedavg", "num-server-rounds": 8, "data-fingerprint": saved}
    assert find_resume_point(tmp_path / "run", cfg).last_round == 2  # same data: resumes
    # key order in the JSON string does not matter, only the data
    reordered = json.dumps({"site-1": SITE, "site-0": dict(reversed(SITE.items()))})
    assert find_resume_point(tmp_path / "run", {**cfg, "data-fingerprint": reordered}) is not None
    other = json.dumps({"site-0": SITE, "site-1": {**SITE, "rows": 118}})
    with pytest.raises(ResumeMismatchError) as err:
        find_resume_point(tmp_path / "run", {**cfg, "data-fingerprint": other})
    message = str(err.value)
    assert "trained on other site data" in message and "new out-dir (--out)" in message
    assert "resume=false" in message and message.endswith("Received: site-1: rows 120 -> 118")
    assert isinstance(err.value, ConfigError) and err.value.exit_code == 2
    # other data and another strategy: both are named
    with pytest.raises(ResumeMismatchError, match=r"differs too, in \['strategy'\].*site-1: rows"):
        find_resume_point(tmp_path / "run", {**cfg, "data-fingerprint": other, "strategy": "median"})

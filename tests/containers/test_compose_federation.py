"""The compose federation in real containers (marker `containers`, also `slow`: `make test-fast`
leaves it out; CI's `make test` runs it).

One module-scoped stack, docker/compose.yaml + docker/compose.tls.yaml, is built and started once:
the image is built offline (the wheelhouse of `make wheelhouse`, and a debootstrap base image where
python:3.11-slim is not in the engine), three hospitals each hold their own data volume, and the
same stack serves every check: rounds, a killed hospital, a restarted coordinator, and the admin
API on HTTPS. Containers and volumes are removed at the end whatever happens. The tests skip only
where no Docker engine can run (no client, no daemon answering `docker info`), and say why.
"""

from __future__ import annotations

import secrets
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import httpx
import pytest

from tests.containers.engine import (
    DOCKER,
    ROOT,
    Stack,
    base_image,
    compose_cli,
    engine_problem,
    free_port,
    run,
    wait_for,
)

pytestmark = [pytest.mark.containers, pytest.mark.slow]

IMAGE = "fedsplit:containers-test"
ROUNDS = 3
ROUND_TIMEOUT = 180  # seconds a phase waits for replies (a killed hospital is dropped sooner, on
#                     its missed heartbeats); generous for a loaded 2-core machine
FILES = ["compose.yaml", "compose.tls.yaml"]
TIMINGS: dict[str, float] = {}


def used_sites(entry: dict[str, Any]) -> list[str]:
    """Hospitals whose training reply went into a round's model."""
    return sorted(s["site"] for s in entry.get("train", {}).get("sites", []) if not s.get("excluded"))


def completed(history: dict[str, Any], round_no: int) -> dict[str, Any] | None:
    """History entry of ``round_no`` once it is trained and evaluated (or the run went past it)."""
    rounds = {r["round"]: r for r in history.get("rounds", [])}
    entry = rounds.get(round_no)
    later = any(r > round_no for r in rounds) or history.get("status") == "finished"
    return entry if entry and ("evaluate" in entry or later) else None


def trained(history: dict[str, Any], round_no: int) -> dict[str, Any] | None:
    """History entry of ``round_no`` once its model is aggregated. With one message per round, a
    round's evaluation arrives with the next round's training replies, so a test that acts between
    two rounds waits for this, not for :func:`completed`."""
    entry = {r["round"]: r for r in history.get("rounds", [])}.get(round_no)
    return entry if entry and "train" in entry else None


@pytest.fixture(scope="module")
def image() -> str:
    """The fedsplit image, built with no package index (wheelhouse) and no image registry."""
    problem = engine_problem()
    if problem:
        pytest.skip(f"no container engine can run here: {problem}")
    started = time.monotonic()
    run([str(DOCKER / "wheelhouse.sh"), str(ROOT / "wheelhouse")], timeout=900,
        env={"PYTHON": sys.executable})
    base = base_image()
    TIMINGS["base image + wheelhouse s"] = time.monotonic() - started
    started = time.monotonic()
    build = run([str(DOCKER / "build.sh"), "-t", IMAGE, "--base-image", base], timeout=1200)
    TIMINGS["image build s"] = time.monotonic() - started
    assert "--no-index" in build.stdout + build.stderr, "the build did not install from the wheelhouse"
    return IMAGE


@pytest.fixture(scope="module")
def stack(image: str) -> Iterator[Stack]:
    """docker/compose.yaml + the TLS overlay up with 3 hospitals; always torn down with its volumes."""
    cli = compose_cli()
    assert cli, "no compose CLI: apt-get install docker-compose (or the docker compose v2 plugin)"
    env = {
        "FEDSPLIT_IMAGE": image, "ROUNDS": str(ROUNDS), "QUORUM": "2", "ROUND_TIMEOUT": str(ROUND_TIMEOUT),
        "SUPERLINK_PORT": str(free_port()), "ADMIN_PORT": str(free_port()),
        "FEDSPLIT_ADMIN_TOKEN": secrets.token_urlsafe(32),
    }
    project = f"fedsplit-ct-{secrets.token_hex(3)}"
    deployed = Stack(cli, FILES, project, env)
    try:
        started = time.monotonic()
        deployed.compose("up", "--detach", "--no-build", timeout=600)
        deployed.started = started  # type: ignore[attr-defined]
        yield deployed
    finally:
        deployed.down()
        left = run(["docker", "volume", "ls", "-q", "--filter", f"name={project}"], timeout=60).stdout
        assert not left.strip(), f"volumes left behind: {left}"


def test_rounds_quorum_rejoin_and_coordinator_restart(stack: Stack) -> None:
    """Two rounds write global.h5/history.json; a killed hospital leaves the round to the quorum
    and rejoins when restarted; a restarted coordinator resumes the run after its last round."""
    history = lambda: stack.history()  # noqa: E731

    # Round 1: the federation runs in containers and writes to the coordinator's volume.
    first = wait_for("round 1 in history.json", lambda: trained(history(), 1), 900, on_timeout=stack.logs)
    TIMINGS["up -> round 1 s"] = time.monotonic() - stack.started  # type: ignore[attr-defined]
    assert len(used_sites(first)) >= 2, first

    # Kill hospital-3 while round 2 trains: round 2 goes on with the quorum of 2.
    run(["docker", "kill", stack.container("hospital-3")], timeout=60)
    second = wait_for("round 2 without hospital-3", lambda: trained(history(), 2),
                      4 * ROUND_TIMEOUT + 300, on_timeout=stack.logs)
    assert "hospital-3" not in used_sites(second), second
    assert len(used_sites(second)) >= 2 and "error" not in second, second
    assert stack.read_out("global.h5") and stack.read_out("models/round-002.h5") is not None

    # Restart hospital-3 and the coordinator: the run resumes after round 2, hospital-3 is back.
    run(["docker", "start", stack.container("hospital-3")], timeout=60)
    run(["docker", "restart", "--time", "5", stack.container("coordinator")], timeout=120)
    final = wait_for("the run to finish after the coordinator restart",
                     lambda: (h := history()).get("status") == "finished" and h, 900, on_timeout=stack.logs)
    assert any(r.get("after_round", 0) >= 2 for r in final.get("resumed", [])), final.get("resumed")
    last = completed(final, ROUNDS)
    assert last is not None and "hospital-3" in used_sites(last), last
    assert stack.read_out(f"models/round-{ROUNDS:03d}.h5") is not None
    print(f"\ncontainer timings: {TIMINGS}")


def test_admin_api_serves_https_and_takes_an_upload(stack: Stack, tmp_path: Path) -> None:
    """The TLS overlay's admin API speaks HTTPS only (certificate from `fedsplit certs`); a site's
    weight file is uploaded over it, verified against the CA."""
    admin = stack.container("admin")
    health = lambda: run(["docker", "inspect", "--format", "{{.State.Health.Status}}", admin],  # noqa: E731
                         timeout=60, check=False).stdout.strip()
    wait_for("the admin API (HTTPS) to be healthy", lambda: health() == "healthy", 180,
             on_timeout=lambda: run(["docker", "logs", "--tail", "30", admin], timeout=60,
                                    check=False).stderr)
    ca = tmp_path / "ca.crt"
    run(["docker", "cp", f"{stack.container('superlink')}:/certs/ca.crt", str(ca)], timeout=60)
    weights = tmp_path / "hospital-1.h5"  # the global model, as hospital-1's own weights
    weights.write_bytes(wait_for("global.h5", lambda: stack.read_out("global.h5"), 900))
    with h5py.File(weights, "r+") as f:
        f.attrs["site"] = "hospital-1"
    base = f"https://127.0.0.1:{stack.env['ADMIN_PORT']}"

    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
        httpx.get(f"http://127.0.0.1:{stack.env['ADMIN_PORT']}/healthz", timeout=10)
    with pytest.raises(httpx.ConnectError):  # and the certificate is not a public CA's
        httpx.get(f"{base}/healthz", timeout=10)

    added = stack.compose("exec", "-T", "admin", "fedsplit", "admin", "add-site", "hospital-1",
                          "--data-dir", "/var/lib/fedsplit/admin", timeout=120)
    site_token = added.stdout.strip().splitlines()[-1]
    with httpx.Client(base_url=base, verify=ssl.create_default_context(cafile=str(ca)), timeout=60) as client:
        assert client.get("/healthz").status_code == 200
        admin_auth = {"Authorization": f"Bearer {stack.env['FEDSPLIT_ADMIN_TOKEN']}"}
        created = client.post("/api/v1/rounds", json={"min_uploads": 1}, headers=admin_auth)
        assert created.status_code == 201, created.text
        round_id = created.json()["id"]
        with weights.open("rb") as fh:
            upload = client.post(f"/api/v1/rounds/{round_id}/uploads", files={"file": ("global.h5", fh)},
                                 data={"num_examples": "100"},
                                 headers={"Authorization": f"Bearer {site_token}"})
        assert upload.status_code == 201, upload.text
        assert upload.json()["round_id"] == round_id, upload.json()

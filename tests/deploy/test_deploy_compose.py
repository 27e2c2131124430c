"""docker/compose.yaml (+ compose.tls.yaml): services, volumes, ports, and commands that point at
real entry points with options those entry points accept; the files stay loadable by Compose v2
and by docker-compose 1.29 (no top-level `name`), which validates them where it is installed.
The real containers run in tests/containers."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml
from fedsplit.cli.app import app as fedsplit_app

DOCKER = Path(__file__).resolve().parents[2] / "docker"
HOSPITALS = ("hospital-1", "hospital-2", "hospital-3")
FLOWER_SCRIPTS = ("flower-superlink", "flower-superexec", "flower-supernode", "flwr")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DOCKER / name).read_text())


def env_file() -> dict[str, str]:
    pairs = [line.split("=", 1) for line in (DOCKER / ".env").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return {k: v for k, v in pairs}


def substitute(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)(?::?[-?][^}]*)?\}", lambda m: env.get(m.group(1), "X"), value)


def fedsplit_command(args: list[str]) -> click.Command:
    """Resolve `fedsplit a b ...` to its click command; fail on an unknown (sub)command."""
    command: click.Command = typer.main.get_command(fedsplit_app)
    rest = list(args)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = command.get_command(click.Context(command), name)
        assert sub is not None, f"`fedsplit {' '.join(args)}`: no command {name!r}"
        command = sub
    return command


def check_fedsplit_options(args: list[str]) -> None:
    command = fedsplit_command(args)
    known = {opt for p in command.params for opt in getattr(p, "opts", [])}
    known |= {opt for p in command.params for opt in getattr(p, "secondary_opts", [])}
    used = [a for a in args if a.startswith("--")]
    assert set(used) <= known, f"`fedsplit {' '.join(args)}`: unknown {sorted(set(used) - known)}"


def flower_help(script: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``SCRIPT --help`` as the installed console script prints it: its entry point, called here
    (the interpreter has Flower imported already; a process per script cost ~2 s each)."""
    (entry,) = entry_points(group="console_scripts", name=script)
    main = entry.load()
    out = io.StringIO()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [script, "--help"])
        patch.setenv("COLUMNS", "200")
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            main()
    assert done.value.code in (0, None), f"{script} --help exited {done.value.code}"
    return out.getvalue()


def check_command(command: list[str], helps: dict[str, str]) -> None:
    if command[:2] == ["fedsplit", "superexec"]:  # its own options, then flower-superexec's
        known = {opt for p in fedsplit_command(["superexec"]).params for opt in p.opts}
        for flag in (a for a in command if a.startswith("--")):
            assert flag in known or flag in helps["flower-superexec"], \
                f"fedsplit superexec has no flag {flag}, nor has flower-superexec"
    elif command[0] == "fedsplit":
        check_fedsplit_options(command[1:])
    elif command[0] in FLOWER_SCRIPTS:
        for flag in (a for a in command if a.startswith("--")):
            assert flag in helps[command[0]], f"{command[0]} has no flag {flag}"
    elif command[0] == "sh":
        segments = [seg.strip() for seg in re.split(r"&&|\|\||[();]", command[-1])]
        fedsplit_calls = [seg.replace('"', "").split()[1:] for seg in segments
                          if seg.startswith("fedsplit ")]
        for words in fedsplit_calls:
            check_fedsplit_options([w for w in words if not w.startswith("$")])
    else:
        pytest.fail(f"unknown entry point {command[0]}")


@pytest.fixture(scope="module")
def helps() -> Iterator[dict[str, str]]:
    with pytest.MonkeyPatch.context() as patch:
        yield {s: flower_help(s, patch)
               for s in ("flower-superlink", "flower-superexec", "flower-supernode")}


def test_compose_services_volumes_ports(helps: dict[str, str]) -> None:
    """The base file has the issue's topology, each hospital sees only its own data volume."""
    compose = load("compose.yaml")
    services = compose["services"]
    expected = {"init", "superlink", "coordinator", "federation", "admin", *HOSPITALS,
                *(f"{h}-clientapp" for h in HOSPITALS)}
    assert expected <= set(services)
    volumes = {f"{h}-data" for h in HOSPITALS} | {"coordinator-out", "superlink-state"}
    assert volumes <= set(compose["volumes"])

    # issue 40: every process that runs an app is fedsplit superexec (only trusted FABs run);
    # a hospital's runner is named for it and shares the agent's state volume (ledger, egress)
    assert services["coordinator"]["command"][:2] == ["fedsplit", "superexec"]
    for hospital in HOSPITALS:
        runner = services[f"{hospital}-clientapp"]["command"]
        assert runner[:2] == ["fedsplit", "superexec"]
        assert runner[runner.index("--name") + 1] == hospital
        agent = services[hospital]["command"]
        state = agent[agent.index("--state-dir") + 1]
        for name in (hospital, f"{hospital}-clientapp"):
            assert f"{hospital}-state:{state}" in services[name]["volumes"]

    link = services["superlink"]["command"]
    assert link[0] == "flower-superlink" and "--disable-runtime-dependency-installation" in link
    assert link[link.index("--port") + 1] == "8000" and "--isolation" in link
    assert not any(a in link for a in ("--fleet-api-address", "--control-api-address"))  # pre-1.42
    # the insecure demo's whole SuperLink is published on this host only unless told otherwise
    assert services["superlink"]["ports"] == ["${SUPERLINK_BIND:-127.0.0.1}:${SUPERLINK_PORT}:8000"]
    assert env_file()["SUPERLINK_BIND"] == "127.0.0.1"
    assert services["admin"]["command"][:3] == ["fedsplit", "admin", "serve"]

    for hospital in HOSPITALS:
        for name in (hospital, f"{hospital}-clientapp"):
            mounts = services[name]["volumes"]
            data = [m for m in mounts if m.split(":")[0].endswith("-data")]
            assert data == [f"{hospital}-data:/data/{hospital}:ro"], (name, mounts)
        cmd = services[hospital]["command"]
        assert cmd[:3] == ["fedsplit", "site", "run"]
        assert cmd[cmd.index("--superlink") + 1] == "superlink:8000"
        assert cmd[cmd.index("--data") + 1] == f"/data/{hospital}"
        runner = services[f"{hospital}-clientapp"]["command"]
        assert runner[runner.index("--runtime-api-address") + 1] == f"{hospital}:9094"
        assert services[hospital]["environment"]["FEDSPLIT_HEALTH_URL"].endswith(":9094/health")
    init_mounts = services["init"]["volumes"]
    assert sorted(init_mounts) == sorted(f"{h}-data:/data/{h}" for h in HOSPITALS)

    for name, service in services.items():
        check_command(service["command"], helps)
        assert service.get("image") == "${FEDSPLIT_IMAGE:-fedsplit:latest}", name


def test_tls_overlay_wires_certificates_and_registration(helps: dict[str, str]) -> None:
    """The TLS overlay turns on TLS + node auth everywhere and registers every hospital's key."""
    tls = load("compose.tls.yaml")["services"]
    link = tls["superlink"]["command"]
    assert "--enable-supernode-auth" in link and "--insecure" not in link
    assert {"--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile"} <= set(link)
    assert "fedsplit certs" in tls["init"]["command"][-1]
    admin = tls["admin"]
    assert {"--tls-cert", "--tls-key"} <= set(admin["command"]), admin["command"]
    assert admin["environment"]["FEDSPLIT_HEALTH_URL"].startswith("https://")
    assert "certs:/certs:ro" in admin["volumes"]
    assert "flwr supernode register" in tls["register"]["command"][-1]
    for hospital in HOSPITALS:
        cmd = tls[hospital]["command"]
        assert cmd[cmd.index("--key") + 1] == f"/certs/supernodes/{hospital}"
        assert cmd[cmd.index("--superlink") + 1] == "superlink:8000"  # the front proxy's port
        assert "--insecure" not in cmd
        assert tls[hospital]["depends_on"]["register"]["condition"] == "service_completed_successfully"
        assert tls[hospital]["depends_on"]["front-proxy"]["condition"] == "service_healthy"
    for service in tls.values():
        check_command(service["command"], helps)


def test_tls_overlay_keeps_control_and_runtime_api_on_loopback() -> None:
    """Issue 40: the SuperLink listens on its container's loopback (SuperExec auth on); only the
    services that need its Control or Runtime API share that namespace; the public port 8000 of
    the namespace is the front proxy, which forwards to the loopback SuperLink."""
    tls = load("compose.tls.yaml")["services"]
    link = tls["superlink"]["command"]
    assert link[link.index("--host") + 1] == "127.0.0.1" and link[link.index("--port") + 1] == "9000"
    secret = link[link.index("--superexec-auth-secret-file") + 1]
    assert "superexec-secret:/secrets:ro" in tls["superlink"]["volumes"]
    assert tls["superlink"]["environment"]["FEDSPLIT_HEALTH_URL"] == "https://localhost:9000/health"
    shared = {name for name, svc in tls.items() if svc.get("network_mode") == "service:superlink"}
    assert shared == {"front-proxy", "coordinator", "federation", "register"}, shared
    runner = tls["coordinator"]["command"]
    assert runner[runner.index("--runtime-api-address") + 1] == "127.0.0.1:9000"
    assert runner[runner.index("--superexec-auth-secret-file") + 1] == secret
    job = tls["federation"]["command"]
    assert job[job.index("--superlink") + 1] == "127.0.0.1:9000"
    assert 'address = "127.0.0.1:9000"' in tls["register"]["command"][-1]
    proxy = tls["front-proxy"]
    cmd = proxy["command"]
    assert cmd[:2] == ["fedsplit", "front-proxy"]
    assert cmd[cmd.index("--listen") + 1] == "0.0.0.0:8000"
    assert cmd[cmd.index("--superlink") + 1] == "127.0.0.1:9000"
    assert proxy["environment"]["FEDSPLIT_HEALTH_URL"] == "https://localhost:8000/health"
    assert "ports" not in proxy  # published by the namespace's owner (compose.yaml's superlink)
    # the secret reaches only the SuperLink and the coordinator (and init, which makes it)
    holders = {name for name, svc in tls.items()
               if any(str(v).startswith("superexec-secret:") for v in svc.get("volumes", []))}
    assert holders == {"init", "superlink", "coordinator"}, holders
    assert "/secrets/superexec" in tls["init"]["command"][-1]


def test_env_file_and_dockerfile() -> None:
    """.env defines every variable the compose files use; the image is non-root with a healthcheck."""
    env = env_file()
    used = set()
    for name in ("compose.yaml", "compose.tls.yaml"):
        used |= set(re.findall(r"\$\{(\w+)", (DOCKER / name).read_text()))
    assert used - {"FEDSPLIT_IMAGE"} <= set(env), sorted(used - set(env))
    assert env["SITES"] == "3"
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^USER fedsplit$", dockerfile, re.M)
    assert "HEALTHCHECK" in dockerfile
    assert 'ARG TORCH_PIP_ARGS=""' in dockerfile and "torch==${TORCH_VERSION}" in dockerfile
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile
    assert "--no-index --find-links /build/wheelhouse" in dockerfile  # the wheelhouse build
    assert "--mount=type=secret,id=extra_ca" in dockerfile  # the optional extra CA
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        if "--from=" in line:
            continue  # from another stage, not the build context
        words = line.split()
        for copied in words[:-1]:
            assert "[" in copied or (DOCKER.parent / copied).exists(), copied  # [x]: optional


def test_compose_files_load_in_compose_v1_and_v2() -> None:
    """No top-level `name` (docker-compose 1.29 refuses it): the project name is in docker/.env."""
    for name in ("compose.yaml", "compose.tls.yaml"):
        top = set(load(name))
        assert top <= {"services", "volumes", "networks", "secrets", "configs"} | {
            k for k in top if k.startswith("x-")}, (name, top)
    assert env_file()["COMPOSE_PROJECT_NAME"] == "fedsplit"


def test_healthcheck_script(tmp_path: Path) -> None:
    """The container healthcheck fails on a dead URL and passes without one."""
    script = DOCKER / "healthcheck.py"
    env = {**os.environ, "PYTHONPATH": str(DOCKER.parent)}
    ok = subprocess.run([sys.executable, str(script)], env=env, timeout=60)
    assert ok.returncode == 0
    dead = subprocess.run([sys.executable, str(script)], timeout=60, capture_output=True, text=True,
                          env={**env, "FEDSPLIT_HEALTH_URL": "http://127.0.0.1:9/health"})
    assert dead.returncode == 1 and "unhealthy" in dead.stderr


def compose_clis() -> list[list[str]]:
    """Every compose CLI here: docker-compose (v1) and the `docker compose` plugin (v2)."""
    found = []
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            found.append(["docker", "compose"])
    return found


# compose.tls.yaml is an overlay (its services have no image of their own): checked on top of the base
@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.tls.yaml"]])
def test_compose_config_validates(files: list[str]) -> None:
    """`docker-compose -f docker/compose.yaml config` (and `docker compose`) accept the files, run
    from the repository root as documented (only where a compose CLI exists; .ci/run installs one)."""
    clis = compose_clis()
    if not clis:
        pytest.skip("no docker compose plugin or docker-compose binary on this machine")
    args = [a for f in files for a in ("-f", f"docker/{f}")]
    env = {**os.environ, "FEDSPLIT_ADMIN_TOKEN": "x" * 40}
    for cli in clis:
        done = subprocess.run([*cli, *args, "config", "--quiet"], capture_output=True, text=True,
                              timeout=60, env=env, cwd=DOCKER.parent)
        assert done.returncode == 0, (cli, done.stderr)


def test_the_coordinators_containers_get_the_allocator_settings_of_fedsplit_up() -> None:
    """The SuperLink and coordinator services carry `COORDINATOR_MALLOC`, as `fedsplit up`'s
    processes do (issue 43); the hospitals do not."""
    from fedsplit.orchestration.flower_runtime import COORDINATOR_MALLOC

    services = load("compose.yaml")["services"]
    for name in ("superlink", "coordinator"):
        assert {k: str(v) for k, v in services[name]["environment"].items()
                if k.startswith("MALLOC_")} == COORDINATOR_MALLOC, name
    assert not any(k.startswith("MALLOC_") for k in services["hospital-1"].get("environment", {}))

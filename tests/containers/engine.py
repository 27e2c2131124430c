"""Docker engine helpers for the container tests: find an engine and a compose CLI, build the image
offline, run a compose project and always tear it down. Every wait is bounded."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
CACHE = ROOT / "build" / "containers"  # git-ignored (build/): the debootstrap base tarball
T = TypeVar("T")


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, check: bool = True,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure raise with its output (bounded by ``timeout`` seconds)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise AssertionError(f"`{' '.join(cmd)}` exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return done


def engine_problem() -> str | None:
    """Why no container can run here (None when a Docker engine answers)."""
    if shutil.which("docker") is None:
        return "no docker client on PATH (apt-get install docker.io; .ci/run does it as root)"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if info.returncode != 0:
        return f"no Docker engine answers `docker info` (start dockerd as root): {info.stderr.strip()[:300]}"
    return None


def compose_cli() -> list[str] | None:
    """`docker compose` (v2) when the plugin is there, else docker-compose (v1), else None."""
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def image_exists(name: str) -> bool:
    """Whether the engine holds image ``name``."""
    return run(["docker", "image", "inspect", name], timeout=60, check=False).returncode == 0


def base_image() -> str:
    """python:3.11-slim where the engine already has it, else a Debian base made by debootstrap
    (kept: a new import would change its id and void the build cache)."""
    for name in ("python:3.11-slim", "fedsplit-base:bookworm"):
        if image_exists(name):
            return name
    run([str(DOCKER / "base-image.sh"), "fedsplit-base:bookworm"], timeout=900,
        env={"FEDSPLIT_CACHE": str(CACHE)})
    return "fedsplit-base:bookworm"


def free_port() -> int:
    """A free TCP port on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 3.0,
             on_timeout: Callable[[], str] = lambda: "") -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{on_timeout()}")
        time.sleep(every)


class Stack:
    """One compose project (docker/compose.yaml + overlays) with its own name, ports and volumes."""

    def __init__(self, cli: list[str], files: list[str], project: str, env: dict[str, str]) -> None:
        self.cli, self.project, self.env = cli, project, env
        self.base = [*cli, "-p", project, *(a for f in files for a in ("-f", str(DOCKER / f)))]

    def compose(self, *args: str, timeout: float = 300,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a compose subcommand on this project."""
        return run([*self.base, *args], timeout=timeout, env=self.env, check=check, cwd=DOCKER)

    def container(self, service: str) -> str:
        """The container id of ``service`` (created, running or not)."""
        # v2 lists only running containers unless -a; v1's ps lists them all (and has no -a).
        args = ("ps", "-a", "-q", service) if self.cli[0] == "docker" else ("ps", "-q", service)
        ids = self.compose(*args, timeout=60).stdout.split()
        assert ids, f"no container for service {service} in project {self.project}"
        return ids[0]

    def read_out(self, name: str) -> bytes | None:
        """A file of the coordinator's out volume, or None while it is missing or unreadable."""
        done = subprocess.run(["docker", "exec", self.container("coordinator"), "cat",
                               f"/var/lib/fedsplit/out/{name}"], capture_output=True, timeout=60)
        return done.stdout if done.returncode == 0 else None

    def history(self) -> dict[str, Any]:
        """The coordinator's history.json ({} until it is written)."""
        raw = self.read_out("history.json")
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            return {}

    def logs(self, tail: int = 40) -> str:
        """The last lines of every service's log (for failure messages)."""
        return self.compose("logs", "--no-color", "--tail", str(tail), timeout=120, check=False).stdout

    def down(self) -> None:
        """Remove the project's containers, network and volumes."""
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=300, check=False)

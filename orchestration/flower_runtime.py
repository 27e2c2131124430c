"""Runs fedsplit's Flower app with Flower's own runtime, as local processes on 127.0.0.1.

`fedsplit simulate` uses `simulation()`: a SuperLink in simulation mode (Flower's Ray-based
simulation engine runs the hospitals' ClientApps) driven by ``flwr run``, exactly the path
Flower documents, with telemetry, update checks and runtime dependency installation off.
The app is staged as a small Flower app directory (`APP_PACKAGES` plus a pyproject whose
``[tool.flwr.app.config]`` lists the config's keys with fixed defaults, the run's values going
as Flower's run-config override: `stage_app`), so it works from a source checkout and from
an installed wheel alike, and its FAB is the same for every run (`app_trust`). Every process
started here is stopped on exit.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fedsplit.orchestration import watchdog
from fedsplit.protocol.atomic import atomic_path, file_version
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, FlowerRunError, error_from_record
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.kinds import run_record_from_json
from fedsplit.protocol.vertical.config import VerticalConfig

# What the staged Flower app ships under fedsplit/: everything the ServerApps and ClientApps import.
APP_PACKAGES = ("protocol", "aggregation", "server", "client")
CONNECTION = "fedsplit"
SUPEREXEC_POLL_S = "0.1"  # FLWR_SUPEREXEC_TASK_POLL_INTERVAL of every Flower process we start
# (serverapp, clientapp) of the horizontal and the vertical federation
HORIZONTAL_COMPONENTS = ("fedsplit.server.app:app", "fedsplit.client.app:app")
VERTICAL_COMPONENTS = ("fedsplit.server.vertical.app:app", "fedsplit.client.vertical.app:app")


def script_dirs() -> list[Path]:
    """Where this installation's console scripts (``fedsplit``, ``flwr``, ``flower-superlink``,
    ``flwr-serverapp``, ``flwr-clientapp``, ...) live, existing ones first-found first: beside
    this Python (a venv's ``bin``), the interpreter's scripts directory, and the folder of the
    running ``fedsplit`` console script. None of them needs to be on the caller's PATH."""
    candidates = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    if Path(sys.argv[0]).name == "fedsplit":
        candidates.append(Path(sys.argv[0]).absolute().parent)
    found: list[Path] = []
    for folder in candidates:
        if folder.is_dir() and folder not in found:
            found.append(folder)
    return found


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes: isolated FLWR_HOME, nothing phones home or installs.

    PATH starts with `script_dirs`: Flower starts its own executables by name (the SuperExec
    runs ``flwr-serverapp``, a SuperNode ``flwr-clientapp``), so they are found even when the
    caller's PATH lacks the venv's ``bin`` (else: ``FileNotFoundError: 'flwr-serverapp'``).
    """
    env = os.environ.copy()
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # the SuperExec's check for a new ServerApp/ClientApp task (Flower's default 1 s; it
        # starts one ClientApp process per message): docs/deployment.md, issue 32
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": SUPEREXEC_POLL_S,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
    })
    first = [str(folder) for folder in script_dirs()]
    rest = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry and entry not in first]
    env["PATH"] = os.pathsep.join(first + rest)
    return env


#: glibc's allocator settings for the coordinator's processes (SuperLink, SuperExec and the
#: ServerApp it starts), unless the environment already sets them. Flower moves a model as
#: 5 MiB chunks and their serialized copies; with glibc's defaults, blocks of that size come
#: from its heaps once a few have been freed (its mmap threshold adapts upward to 32 MiB), and
#: memory freed there mostly stays with the process: the ServerApp's resident size grew round
#: by round and the SuperLink's stayed near its peak between rounds. Blocks of 1 MiB or more
#: mapped on their own go back to the system when freed; two arenas bound gRPC's threads'
#: heaps. Measured in docs/scale.md. Hospitals keep glibc's defaults: what the settings cost
#: torch's training was not measured within one run.
COORDINATOR_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_ARENA_MAX": "2"}


def coordinator_env(flwr_home: Path) -> dict[str, str]:
    """`flower_env` with `COORDINATOR_MALLOC` (where the environment does not set them), for
    the SuperLink and the SuperExec that runs the ServerApp."""
    env = flower_env(flwr_home)
    for name, value in COORDINATOR_MALLOC.items():
        env.setdefault(name, value)
    return env


def tool(name: str) -> str:
    """Path of a console script of this installation (`script_dirs`), else of the one PATH finds,
    else ``name`` itself (`spawn` then says it is missing)."""
    for folder in script_dirs():
        if (folder / name).is_file():
            return str(folder / name)
    return shutil.which(name) or name


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def _neutral(value: Any) -> Any:
    """A fixed default of ``value``'s type (see `stage_app`)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return 0
    if isinstance(value, float):
        return 0.0
    return ""


def run_config_path(app_dir: Path) -> Path:
    """The run's own config beside the staged app (``APP.run-config.toml``), which ``flwr run``
    sends as Flower's run-config override: data, outside the FAB."""
    return app_dir.with_name(f"{app_dir.name}.run-config.toml")


def stage_app(
    dest: Path,
    cfg: RunConfig | VerticalConfig,
    *,
    components: tuple[str, str] = HORIZONTAL_COMPONENTS,
    extra_modules: Sequence[Path] = (),
) -> Path:
    """Write a Flower app directory (code + pyproject) and, beside it, this run's config
    (`run_config_path`).

    The FAB Flower builds from the directory is the same, byte for byte, for every run of this
    fedsplit installation: its pyproject's ``[tool.flwr.app.config]`` lists the config's keys
    with fixed defaults of each value's type, and ``flwr run`` sends the run's values as the
    override (`run_app`). So its sha256 pins the code: hospitals and the coordinator run only
    the apps whose digest their own installation computes (`orchestration.app_trust`).

    ``components`` are the (serverapp, clientapp) references; ``extra_modules`` are single
    ``.py`` files copied beside the packages (e.g. a benchmark's reference app).
    """
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    namespace = dest / "fedsplit"
    namespace.mkdir()
    shutil.copy2(Path(importlib.import_module("fedsplit").__file__), namespace / "__init__.py")
    for package in APP_PACKAGES:
        src = Path(importlib.import_module(f"fedsplit.{package}").__file__).parent
        shutil.copytree(src, namespace / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for module in extra_modules:
        shutil.copy2(module, dest / Path(module).name)
    values = cfg.to_flower()
    config = "\n".join(f"{key} = {_toml_value(_neutral(v))}" for key, v in values.items())
    with atomic_path(run_config_path(dest)) as tmp:
        tmp.write_text("".join(f"{key} = {_toml_value(v)}\n" for key, v in values.items()))
    (dest / "pyproject.toml").write_text(
        f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedsplit-app"
version = "0.1.0"
description = "fedsplit coordinator and hospital agent (staged by fedsplit)"
license = "Apache-2.0"
dependencies = ["flwr>=1.42.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedsplit"

[tool.flwr.app.components]
serverapp = "{components[0]}"
clientapp = "{components[1]}"

[tool.flwr.app.config]
{config}
"""
    )
    return dest


def write_connection(flwr_home: Path, address: str, *, root_cert: Path | None = None) -> None:
    """Write FLWR_HOME/config.toml with one SuperLink connection named ``fedsplit``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    auth = f"root-certificates = {json.dumps(str(root_cert))}" if root_cert else "insecure = true"
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{address}"\n{auth}\n'
    )


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None,
              verify: bool | str | ssl.SSLContext = True) -> None:
    """Poll ``url`` until it answers 2xx (bounded); fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise FlowerRunError(f"A Flower process exited with code {proc.returncode} before "
                                 f"{url} came up. Received: exit {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, verify=verify).is_success:
                return
        time.sleep(0.3)
    raise FlowerRunError(f"{url} did not come up within {timeout:.0f} s. Received: timeout")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """Stop a process started with its own session, and everything it started.

    The whole process group is signalled even when its leader has already exited: a SuperNode
    that ended leaves its ClientApp processes behind in its group otherwise. SIGTERM first, then
    SIGKILL for whatever is left after ``grace`` seconds; both waits are bounded.
    """
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.1, deadline - time.monotonic()))
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None or _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        settle = time.monotonic() + 5
        while _group_alive(proc.pid) and time.monotonic() < settle:
            time.sleep(0.1)
    if (dog := watchdog.current()) is not None:
        dog.forget(proc.pid)


def spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session with output appended to ``log_path``.

    This process's `watchdog` (started with the first) watches its group and carries its mark
    into ``cmd``'s environment: if this process is killed outright, the group and everything it
    started are stopped too (`stop` tells the watchdog to forget a group it stopped)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    dog = watchdog.ensure()
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(cmd, env={**env, watchdog.MARK_ENV: dog.mark}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            dog.watch(proc.pid)
            return proc
        except FileNotFoundError as e:
            raise FlowerRunError(
                f"Cannot start {cmd[0]!r}: no such executable beside this Python "
                f"({Path(sys.executable).parent}) or on PATH. Install fedsplit (with flwr) into "
                f"this environment, or put its bin folder on PATH. Received: {cmd[0]}") from e


@contextlib.contextmanager
def simulation_superlink(work: Path, env: dict[str, str]) -> Iterator[str]:
    """Run a SuperLink in simulation mode on a free loopback port; yield its address."""
    port = free_port()
    proc = spawn(
        [tool("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
         "--host", "127.0.0.1", "--port", str(port),
         "--control-api-address", f"127.0.0.1:{free_port()}",
         "--disable-runtime-dependency-installation"],
        env, work / "superlink.log",
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proc)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def log_tail(path: Path, lines: int = 6, limit: int = 600) -> str:
    """The last ``lines`` non-empty lines of a log on one line (`` | `` between them; rich's box
    drawing and colour codes dropped), at most ``limit`` characters."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    rows = [" ".join(row.strip(" │╭╮╰╯─┃━┏┓┗┛").split()) for row in text.splitlines()]
    flat = " | ".join([row for row in rows if row][-lines:])
    return flat if len(flat) <= limit else "..." + flat[-(limit - 3):]


def run_app(
    app_dir: Path,
    env: dict[str, str],
    log_path: Path,
    history_path: Path,
    *,
    federation_config: str | None = None,
    timeout: float = 3600,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_silence: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """``flwr run`` the app on the ``fedsplit`` connection; poll its history until it ends.

    ``on_silence`` gets the seconds since submitting, every `SILENCE_NOTE_S`, while this run has
    written no history yet (no coordinator has started its ServerApp).

    Any app's history qualifies (horizontal, vertical, survival): its ``status`` and ``error``
    are read here through its model (`protocol.record.kinds.run_record_from_json`), and the parsed
    JSON is returned for the caller to read through its own model
    (horizontal: `protocol.record.horizontal.RunRecord`, as `attach` and `run_experiment` do)."""
    cmd = [tool("flwr"), "run", str(app_dir), CONNECTION, "--stream",
           "--run-config", str(run_config_path(app_dir))]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    proc = spawn(cmd, env, log_path)
    deadline = time.monotonic() + timeout
    submitted = time.time() - 1.0
    history: dict[str, Any] = {}
    status: str | None = None  # the record's, read through its model (any run kind)
    error: str | None = None
    started = time.monotonic()
    next_note = started + SILENCE_NOTE_S
    seen: tuple[int, int, int] | None = None  # the version of the history last read
    try:
        while True:
            done = proc.poll() is not None
            # Only this run's history: an older one left in the out-dir must not end the wait;
            # read again only when rewritten (at 1,000 hospitals it is megabytes)
            try:
                version: tuple[int, int, int] | None = file_version(history_path)
            except OSError:  # not written yet
                version = None
            if version is not None and version != seen and version[0] >= submitted * 1e9:
                seen = version
                with contextlib.suppress(json.JSONDecodeError, OSError):
                    history = json.loads(history_path.read_text())
                    record = run_record_from_json(history, source=str(history_path))
                    status, error = record.status, record.error
                    if on_progress:
                        on_progress(history)
            if status in ("finished", "failed") or done:
                break
            if on_silence is not None and not history and time.monotonic() >= next_note:
                on_silence(time.monotonic() - started)
                next_note += SILENCE_NOTE_S
            if time.monotonic() > deadline:
                raise FlowerRunError(f"The Flower run did not finish within {timeout:.0f} s. "
                                     f"See {log_path}. Received: timeout")
            time.sleep(0.5)
    finally:
        stop(proc, grace=15)
    if status == "failed" and (recorded := error_from_record(error)) is not None:
        raise recorded  # the coordinator's own error, one line, with its exit code
    if status != "finished":
        reason = error or "the run ended without finishing its rounds"
        raise FlowerRunError(f"Flower run failed: {reason}. Its log {log_path} ends: "
                             f"{log_tail(log_path)}. Received: status "
                             f"{status or 'none (no history written)'}")
    return history


def simulation(
    cfg: RunConfig | VerticalConfig,
    num_sites: int,
    work: Path,
    *,
    components: tuple[str, str] = HORIZONTAL_COMPONENTS,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout: float = 3600,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` in Flower's simulation engine with ``num_sites`` virtual hospitals.

    ``components`` picks the app: `HORIZONTAL_COMPONENTS` by default, or `VERTICAL_COMPONENTS`.
    ``ray_address``: an existing Ray cluster's GCS address (``HOST:PORT``, as ``ray start
    --head`` prints it) that runs the hospitals, checked to answer first (`check_ray_address`);
    None: Flower starts Ray on this machine (``RAY_ADDRESS=local``), not joining a cluster that
    ``ray start`` left here (Ray's default), unless the caller's environment sets Ray's own
    ``RAY_ADDRESS``. Flower 1.42's simulation settings carry no Ray address (their
    ``init_args`` are only num_cpus, num_gpus, logging_level and log_to_driver), but its Ray
    backend calls ``ray.init()`` in the SuperLink's simulation process, which joins the cluster
    that ``RAY_ADDRESS`` in its environment names: that is how the address travels.
    """
    flwr_home = work / "flwr-home"
    env = flower_env(flwr_home)
    if ray_address:
        env["RAY_ADDRESS"] = check_ray_address(ray_address)
    else:
        env.setdefault("RAY_ADDRESS", "local")
    app_dir = stage_app(work / "app", cfg, components=components)
    with simulation_superlink(work, env) as address:
        write_connection(flwr_home, address)
        return run_app(
            app_dir, env, work / "flower.log", Path(cfg.out_dir) / "history.json",
            federation_config=(f"num-supernodes={num_sites} client-resources-num-cpus=1 "
                               f"client-resources-num-gpus=0"),
            timeout=timeout, on_progress=on_progress,
        )


def check_ray_address(address: str) -> str:
    """``address`` (a Ray cluster's ``HOST:PORT``), once its port accepts a connection (at most
    2 s); otherwise a `ConfigError` that names the address, the cause and how to start a head."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--ray-address is a Ray cluster's HOST:PORT (the head's GCS address "
                          f"that `ray start --head --port=6379` prints, e.g. 10.0.0.5:6379). "
                          f"Received: {address!r}")
    why = probe(address.strip())
    if why is not None:
        raise ConfigError(f"No Ray cluster answers at {address.strip()} ({why}); start its head "
                          f"with `ray start --head --port={port}` there (docs/simulate.md, 'On a "
                          f"Ray cluster'). Received: --ray-address {address}")
    return address.strip()


#: How long `fedsplit up --superlink` waits for the SuperLink's port to accept a connection.
CONNECT_TIMEOUT_S = 30.0
#: How often a submitted run that no coordinator has started yet is reported (`run_app`).
SILENCE_NOTE_S = 30.0


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); anything else is a `ConfigError`."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--superlink is the SuperLink's HOST:PORT, e.g. 127.0.0.1:8000 or "
                          f"superlink.example.org:8000. Received: {address!r}")
    return host, int(port)


def probe(address: str, timeout: float = 2.0) -> str | None:
    """None when a TCP connection to ``address`` (HOST:PORT) opens within ``timeout`` seconds,
    else why not, in a few words (``connection refused``, ``no answer within 2 s``, ...)."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "connection refused"
    except socket.gaierror as e:
        return f"host name {host!r} does not resolve: {e.strerror or e}"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or type(e).__name__


def wait_for_superlink(address: str, timeout: float = CONNECT_TIMEOUT_S, *,
                       say: Callable[[str], None] = lambda _msg: None,
                       every: float = 1.0) -> float:
    """Wait (bounded by ``timeout`` seconds) until the SuperLink's port at ``address`` accepts a
    connection; return the seconds waited. While it does not, ``say`` gets one line (and one
    when it comes up); after ``timeout`` a `FlowerRunError` names the address, the cause and the
    fix. ``flwr run`` itself would retry silently for minutes."""
    started = time.monotonic()
    deadline = started + timeout
    why = probe(address, timeout=min(2.0, timeout))
    if why is None:
        return 0.0
    say(f"waiting for the SuperLink at {address} ({why}); retrying for {timeout:.0f} s")
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(every, left))
        why = probe(address, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        if why is None:
            waited = time.monotonic() - started
            say(f"the SuperLink at {address} answers (after {waited:.0f} s)")
            return waited
    raise FlowerRunError(
        f"The SuperLink at {address} is not reachable ({why}) after {timeout:.0f} s of retrying. "
        f"Start it first (flower-superlink, docs/deployment.md \"Hospitals on their own files\") or "
        f"fix --superlink: the host and port where it listens, reachable from this machine. "
        f"Received: --superlink {address}")


def attach(cfg: RunConfig, superlink: str, work: Path, *, root_cert: Path | None = None,
           on_progress: Callable[[RunRecord], None] | None = None, timeout: float = 3600,
           connect_timeout: float = CONNECT_TIMEOUT_S,
           say: Callable[[str], None] = lambda _msg: None) -> RunRecord:
    """Submit ``cfg`` to a running SuperLink and follow its run record (compose's federation
    job); ``on_progress`` gets the record each time the coordinator rewrites it.

    The SuperLink must accept a connection within ``connect_timeout`` seconds (`wait_for_superlink`,
    which tells ``say`` while it waits); the run must end within ``timeout`` seconds."""
    wait_for_superlink(superlink, connect_timeout, say=say)
    home = work / "flwr-home"
    write_connection(home, superlink, root_cert=root_cert.resolve() if root_cert else None)
    app_dir = stage_app(work / "app", cfg)
    path = Path(cfg.out_dir) / HISTORY_FILE
    progress = None if on_progress is None else (
        lambda raw: on_progress(RunRecord.from_json(raw, source=str(path))))

    def silence(seconds: float) -> None:
        say(f"the run is submitted to {superlink}, but no coordinator has started it after "
            f"{seconds:.0f} s (no {path}): a flower-superexec must run the ServerApp for this "
            f"SuperLink, with this environment's bin on its PATH (docs/deployment.md); its log says "
            f"why not. Waiting up to {timeout:.0f} s (--timeout)")

    return RunRecord.from_json(run_app(app_dir, flower_env(home), work / "flwr-run.log", path,
                                       on_progress=progress, timeout=timeout,
                                       on_silence=silence), source=str(path))


# --- deployment runtime: SuperLink + SuperExec + SuperNodes (fedsplit up, site run, compose) ---


@dataclass(frozen=True)
class LinkTls:
    """TLS material of a SuperLink: CA bundle, server certificate and key."""

    ca: Path
    cert: Path
    key: Path


def superlink_command(port: int, *, host: str = "127.0.0.1", tls: LinkTls | None = None,
                      node_auth: bool = False, database: Path | None = None,
                      isolation: str = "process",
                      superexec_secret: Path | None = None) -> list[str]:
    """``flower-superlink`` for deployment: one HTTP(S) port, no runtime dependency installation.

    With ``isolation="process"`` the ServerApp runs in a separate SuperExec (the coordinator),
    which can be stopped and restarted without the SuperLink losing its hospitals. With
    ``superexec_secret`` (`write_superexec_secret`) the Runtime API serves only a SuperExec
    holding the same file (Flower's HMAC SuperExec authentication).

    The port serves the Fleet, Control and Runtime APIs alike, and Flower authenticates no one
    on the Control API: keep ``host`` on loopback and let hospitals in through the front proxy
    (`orchestration.front_proxy`, docs/deployment.md "Ports").
    """
    if node_auth and tls is None:
        raise FlowerRunError("SuperNode authentication needs TLS on the SuperLink: pass the "
                             "certificates (fedsplit certs) too. Received: node_auth without TLS")
    cmd = [tool("flower-superlink"), "--host", host, "--port", str(port),
           "--isolation", isolation, "--disable-runtime-dependency-installation"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert),
                "--ssl-keyfile", str(tls.key)]
    if node_auth:
        cmd.append("--enable-supernode-auth")
    if database is not None:
        cmd += ["--database", str(database)]
    if superexec_secret is not None:
        if isolation != "process":
            raise FlowerRunError("SuperExec authentication is for a separate SuperExec: use "
                                 "isolation='process'. Received: isolation "
                                 f"{isolation!r} with a SuperExec secret")
        cmd += ["--superexec-auth-secret-file", str(superexec_secret)]
    return cmd


def superexec_command(runtime_address: str, *, root_cert: Path | None = None,
                      secret: Path | None = None) -> list[str]:
    """``flower-superexec`` that runs the ServerApp (or ClientApp) of a ``process``-isolated peer
    (authenticating with ``secret`` when its peer requires it: `superlink_command`)."""
    cmd = [tool("flower-superexec"), "--runtime-api-address", runtime_address]
    cmd += ["--root-certificates", str(root_cert)] if root_cert else ["--insecure"]
    return cmd + (["--superexec-auth-secret-file", str(secret)] if secret else [])


def write_superexec_secret(path: Path, nbytes: int = 32) -> Path:
    """Write a new random SuperExec secret (``nbytes`` from `secrets`, hex: Flower reads the
    file's exact bytes) to ``path``, 0600, replacing any older one; return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(nbytes))
    return path


def node_config(data_path: Path | str, site_name: str, *, recipe: str = "",
                recipe_params: str = "", hospital: Mapping[str, str] | None = None) -> str:
    """The ``--node-config`` string telling our ClientApp where its data is and what it is called
    (and, with ``recipe``, the hospital's own recipe and its parameters as JSON; ``hospital``:
    more of the hospital's own settings, e.g. its policy file and state folder)."""
    extra = dict(hospital or {})
    for value in (str(data_path), site_name, *extra.values()):
        if "'" in value or '"' in value:
            raise FlowerRunError("Data paths, site names and a hospital's settings cannot contain "
                                 f"quotes (Flower's node config syntax). Rename it. Received: "
                                 f"{value!r}")
    text = f"data-path='{data_path}' site-name='{site_name}'"
    text += "".join(f" {key}='{value}'" for key, value in extra.items() if value)
    if recipe:
        if "'" in recipe or "'" in recipe_params:
            raise FlowerRunError("A recipe reference and its parameters cannot contain single "
                                 "quotes (Flower's node config syntax); write JSON strings with "
                                 f"double quotes. Received: {recipe!r} {recipe_params!r}")
        text += f" recipe='{recipe}' recipe-params='{recipe_params or '{}'}'"
    return text


def supernode_command(superlink: str, *, data_path: Path | str, site_name: str, port: int,
                      host: str = "127.0.0.1", root_cert: Path | None = None,
                      key: Path | None = None, isolation: str = "subprocess", recipe: str = "",
                      recipe_params: str = "", hospital: Mapping[str, str] | None = None
                      ) -> list[str]:
    """``flower-supernode`` for one hospital, retrying the SuperLink forever when it drops."""
    config = node_config(data_path, site_name, recipe=recipe, recipe_params=recipe_params,
                         hospital=hospital)
    cmd = [tool("flower-supernode"), "--superlink", superlink, "--host", host, "--port", str(port),
           "--isolation", isolation, "--node-config", config]
    cmd += ["--root-certificates", str(root_cert)] if root_cert else ["--insecure"]
    if key is not None:
        cmd += ["--auth-supernode-private-key", str(key)]
    return cmd


def health_url(address: str, tls: bool) -> str:
    """The SuperLink's health endpoint."""
    return f"{'https' if tls else 'http'}://{address}/health"


def tls_context(ca: Path | None) -> bool | ssl.SSLContext:
    """What httpx should verify against: our CA when given, else the system default."""
    return ssl.create_default_context(cafile=str(ca)) if ca else True


def register_supernodes(env: dict[str, str], keys: dict[str, Path], timeout: float = 90.0) -> None:
    """``flwr supernode register`` each hospital's public key (name -> .pub), in parallel."""
    procs = {
        name: subprocess.Popen(
            [tool("flwr"), "supernode", "register", str(key), CONNECTION, "--name", name],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for name, key in keys.items()
    }
    deadline = time.monotonic() + timeout
    try:
        for name, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired as e:
                raise FlowerRunError(f"Registering {name} with the SuperLink did not finish within "
                                     f"{timeout:.0f} s. Is the SuperLink up? Received: timeout") from e
            if proc.returncode != 0:
                lines = out.decode(errors="replace").strip().splitlines()[-5:]
                raise FlowerRunError(f"`flwr supernode register` refused {name}'s key {keys[name]}: "
                                     f"{' | '.join(lines)}. Received: exit {proc.returncode}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)

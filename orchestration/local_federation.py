"""A whole federation as local processes on 127.0.0.1: the compose topology without containers.

`LocalFederation` starts, each in its own process group with its own FLWR_HOME and log file:

- the SuperLink (``flower-superlink --isolation process``: one HTTP(S) port, TLS and SuperNode
  authentication with ``tls=True``); with TLS it listens on an internal loopback port with
  SuperExec authentication, and its front proxy (Debian's nginx, `front_proxy`) serves the
  public port hospitals connect to: the Fleet API only, Control and Runtime API refused;
- the coordinator: a ``flower-superexec`` that runs fedsplit's ServerApp for the SuperLink;
- one ``fedsplit site run`` agent per hospital (a SuperNode with its own partition);
- the admin API (``fedsplit admin serve``) when this build has it;

then submits the run (``flwr run``) and supervises it like a container runtime with restart
policies would: a hospital agent that dies is restarted, and a coordinator that dies is restarted
and the run resubmitted, so the ServerApp resumes after the last completed round. `close()`
(also on Ctrl-C and on errors) stops every process group it started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from fedsplit.orchestration.certs import CertPaths, make_certs
from fedsplit.orchestration.flower_runtime import (
    CONNECTION,
    FlowerRunError,
    LinkTls,
    coordinator_env,
    flower_env,
    free_port,
    health_url,
    register_supernodes,
    run_config_path,
    spawn,
    stage_app,
    stop,
    superexec_command,
    superlink_command,
    tls_context,
    tool,
    wait_http,
    write_connection,
    write_superexec_secret,
)
from fedsplit.orchestration.front_proxy import FrontProxy, nginx_binary
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import (
    ConfigError,
    HospitalFailure,
    NoTrainingError,
    error_from_record,
)
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.horizontal import RunRecord

GLOBAL_MODEL = "global.h5"
# Exit codes of a hospital agent that a restart cannot fix: its options or its data are wrong.
AGENT_FATAL = {ConfigError.exit_code: "ConfigError", HospitalFailure.exit_code: "HospitalFailure"}
COORDINATOR = "coordinator"
SUPERLINK = "superlink"
FRONT_PROXY = "front-proxy"
ADMIN = "admin"
RUN = "flwr-run"


def fedsplit_command() -> list[str]:
    """How to start the ``fedsplit`` CLI of this installation as a subprocess."""
    script = Path(tool("fedsplit"))
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from fedsplit.cli.app import main; sys.exit(main())"]


def check_trained(history: RunRecord, out: Path) -> None:
    """Raise `NoTrainingError` (one line: each hospital's reason) unless the run trained and
    its global model ``out/global.h5`` exists."""
    reason = history.failure()
    model = out / GLOBAL_MODEL
    if reason is None and not model.is_file():
        reason = (f"{len(history.model_rounds)} round(s) saved a model, but {model} does not "
                  f"exist")
    if reason is None:
        return
    raise NoTrainingError(
        f"The federation ended without a model to present: {reason}. Fix what is named (each "
        f"hospital's log: WORK/logs/NAME.log, or its agent's console) and run again. "
        f"Received: {out / HISTORY_FILE} status {history.status or 'none'}, "
        f"{len(history.model_rounds)} of {len(history.rounds)} round(s) with a model")


def admin_available() -> bool:
    """Whether this build has the admin API command (``fedsplit admin serve``)."""
    return importlib.util.find_spec("fedsplit.cli.admin") is not None


@dataclass
class Site:
    """One simulated hospital: its name and the folder holding only its rows (and, optionally,
    the hospital's own recipe: ``fedsplit site run --recipe``)."""

    name: str
    data: Path
    recipe: str = ""
    recipe_params: str = "{}"


@dataclass
class LocalFederation:
    """SuperLink, coordinator, hospitals and admin API as supervised local processes."""

    work: Path
    sites: list[Site]
    tls: bool = False
    port: int = 0
    admin_port: int | None = 0
    say: Callable[[str], None] = print
    restart_delay: float = 2.0
    max_restarts: int = 5
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    certs: CertPaths | None = None
    admin_url: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Flower's ``--database``: the SuperLink's state and message objects in this SQLite file
    #: instead of its memory (docs/scale.md); made anew when the SuperLink starts
    database: Path | None = None

    def __post_init__(self) -> None:
        self.work = self.work.resolve()
        self.port = self.port or free_port()
        # Hospitals connect to `address`: with TLS the front proxy's public port (Fleet API and
        # /health only, orchestration/front_proxy.py), without it the SuperLink itself. The
        # operator's flwr CLI and the coordinator use `link_address`, the SuperLink's own port,
        # on loopback only.
        self.address = f"127.0.0.1:{self.port}"
        self.link_port = self.port
        while self.tls and self.link_port == self.port:
            self.link_port = free_port()
        self.link_address = f"127.0.0.1:{self.link_port}"
        # the coordinator's SuperExec authenticates to the SuperLink's Runtime API (TLS only)
        self.superexec_secret = self.work / "secrets" / "superexec" if self.tls else None
        self.logs = self.work / "logs"
        self.homes = self.work / "homes"
        self.cli_env = flower_env(self.homes / "cli")
        self._restarts: dict[str, int] = {}
        self._run_log_offset = 0

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process group this federation started (newest first)."""
        for name in reversed(list(self.procs)):
            stop(self.procs[name], grace=10)
        self._write_pids()
        if self.superexec_secret is not None:
            self.superexec_secret.unlink(missing_ok=True)

    def _start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = spawn(cmd, env, self.logs / f"{name}.log")
        self.procs[name] = proc
        self._write_pids()
        return proc

    def _write_pids(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        alive = {n: p.pid for n, p in self.procs.items()}
        (self.work / "pids.json").write_text(json.dumps(alive, indent=2))

    def _event(self, kind: str, **info: Any) -> None:
        self.events.append({"event": kind, "at": time.time(), **info})

    @property
    def root_cert(self) -> Path | None:
        """The CA the SuperLink's certificate chains to (TLS only)."""
        return self.certs.ca if self.certs else None

    # --- components ------------------------------------------------------------------------

    def start_superlink(self) -> None:
        """Start the SuperLink (TLS + node auth + SuperExec auth when ``tls``, then its front
        proxy on the public port) and register the hospitals' keys."""
        link_tls = None
        if self.tls:
            nginx_binary()  # a missing nginx is one ConfigError, before anything starts
            # one machine: the hospitals' keys are made here too (make_certs: a rehearsal)
            self.certs = make_certs(self.work / "certs", [s.name for s in self.sites])
            link_tls = LinkTls(self.certs.ca, self.certs.server_cert, self.certs.server_key)
            write_superexec_secret(self.superexec_secret)
        home = self.homes / SUPERLINK
        if self.database is not None:  # an earlier federation's runs and nodes are not this one's
            for stale in (self.database, *self.database.parent.glob(f"{self.database.name}-*")):
                stale.unlink(missing_ok=True)
            self.database.parent.mkdir(parents=True, exist_ok=True)
        proc = self._start(SUPERLINK, superlink_command(self.link_port, tls=link_tls,
                                                        node_auth=self.tls,
                                                        superexec_secret=self.superexec_secret,
                                                        database=self.database),
                           coordinator_env(home))
        wait_http(health_url(self.link_address, self.tls), 60, proc,
                  verify=tls_context(self.root_cert))
        if self.tls:
            self.start_front_proxy()
        write_connection(self.homes / "cli", self.link_address, root_cert=self.root_cert)
        if self.certs is not None:
            register_supernodes(self.cli_env, {s.name: self.certs.public_key(s.name) for s in self.sites})
        if self.tls:
            self.say(f"SuperLink on {self.link_address} (TLS + SuperNode auth + SuperExec auth; "
                     f"Control API for the operator here only), hospitals through the front "
                     f"proxy on {self.address} (Fleet API only)")
        else:
            self.say(f"SuperLink on {self.address} (insecure)")

    def start_front_proxy(self) -> None:
        """Start nginx on the public port: TLS with the SuperLink's certificate, the Fleet API
        and /health forwarded to the SuperLink, everything else refused (`FrontProxy`)."""
        assert self.certs is not None, "the front proxy serves the SuperLink's TLS certificate"
        proxy = FrontProxy(self.address, self.link_address, self.certs.server_cert,
                           self.certs.server_key, self.certs.ca,
                           access_log=self.logs / f"{FRONT_PROXY}-access.log")
        proc = self._start(FRONT_PROXY, proxy.command(self.work / FRONT_PROXY),
                           flower_env(self.homes / FRONT_PROXY))
        wait_http(health_url(self.address, True), 30, proc, verify=tls_context(self.root_cert))

    def check_front_proxy(self) -> None:
        """Restart the front proxy if it died (for the supervision loop, like a hospital)."""
        proc = self.procs.get(FRONT_PROXY)
        if proc is not None and proc.poll() is not None:
            stop(proc, grace=2)
            self._restart(FRONT_PROXY, f"exited with code {proc.returncode}")
            self.start_front_proxy()

    def start_coordinator(self) -> None:
        """Start the SuperExec that runs the ServerApp (the coordinator)."""
        # `fedsplit superexec`: flower-superexec that runs only fedsplit's own ServerApp
        flower = superexec_command(self.link_address, root_cert=self.root_cert,
                                   secret=self.superexec_secret)
        home = self.homes / COORDINATOR
        self._start(COORDINATOR, [*fedsplit_command(), "superexec", "--flwr-home", str(home),
                                  *flower[1:]], coordinator_env(home))

    def start_site(self, site: Site) -> None:
        """Start one hospital agent (``fedsplit site run``) on its own partition and FLWR_HOME."""
        cmd = [*fedsplit_command(), "site", "run", "--superlink", self.address,
               "--data", str(site.data), "--name", site.name, "--port", str(free_port()),
               "--flwr-home", str(self.homes / site.name)]
        if site.recipe:
            cmd += ["--recipe", site.recipe, "--recipe-params", site.recipe_params]
        if self.certs is not None:
            cmd += ["--root-cert", str(self.certs.ca), "--key", str(self.certs.supernode_keys[site.name])]
        else:
            cmd.append("--insecure")
        self._start(site.name, cmd, flower_env(self.homes / site.name))

    def start_admin(self) -> None:
        """Start the admin API when this build has it; its token is written to WORK/admin/token."""
        if self.admin_port is None:
            return
        if not admin_available():
            self.say("admin API: not started (this build has no `fedsplit admin` command)")
            return
        port = self.admin_port or free_port()
        data = self.work / "admin"
        data.mkdir(parents=True, exist_ok=True)
        token = data / "token"
        if not token.exists():
            fd = os.open(token, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(32))
        env = {**flower_env(self.homes / ADMIN), "FEDSPLIT_ADMIN_TOKEN_FILE": str(token)}
        env.pop("FEDSPLIT_ADMIN_TOKEN", None)
        proc = self._start(ADMIN, [*fedsplit_command(), "admin", "serve", "--host", "127.0.0.1",
                                   "--port", str(port), "--data-dir", str(data),
                                   "--runs", str(self.work)], env)
        wait_http(f"http://127.0.0.1:{port}/healthz", 60, proc)
        self.admin_url = f"http://127.0.0.1:{port}"
        self.say(f"admin API on {self.admin_url}, web view {self.admin_url}/ui "
                 f"(admin token in {token})")

    def start(self) -> None:
        """Start the SuperLink, the coordinator, every hospital and the admin API."""
        self.start_superlink()
        self.start_coordinator()
        for site in self.sites:
            self.start_site(site)
        self.say(f"{len(self.sites)} hospital agents: {', '.join(s.name for s in self.sites)}")
        self.start_admin()

    def submit(self, app_dir: Path) -> None:
        """``flwr run`` the staged app on this federation (streams its log to logs/flwr-run.log)."""
        if RUN in self.procs:
            stop(self.procs[RUN], grace=5)
        self._run_log_offset = (self.logs / f"{RUN}.log").stat().st_size \
            if (self.logs / f"{RUN}.log").exists() else 0
        self._start(RUN, [tool("flwr"), "run", str(app_dir), CONNECTION, "--stream",
                          "--run-config", str(run_config_path(app_dir))], self.cli_env)

    def current_run_id(self) -> str | None:
        """The id of the run last submitted, once ``flwr run`` has printed it."""
        log = self.logs / f"{RUN}.log"
        if not log.exists():
            return None
        with open(log, "rb") as fh:
            fh.seek(self._run_log_offset)
            found = re.findall(rb"Successfully started run (\d+)", fh.read())
        return found[-1].decode() if found else None

    def stop_run(self, run_id: str) -> None:
        """``flwr stop`` a run whose coordinator died, so hospitals drop its pending messages."""
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run([tool("flwr"), "stop", run_id, CONNECTION], env=self.cli_env,
                           capture_output=True, timeout=60, check=False)

    # --- supervision -----------------------------------------------------------------------

    def _restart(self, name: str, reason: str) -> None:
        count = self._restarts.get(name, 0) + 1
        self._restarts[name] = count
        if count > self.max_restarts:
            raise FlowerRunError(f"{name} died {count} times; giving up. See {self.logs / name}.log. "
                                 f"Received: {reason}")
        self._event("restart", process=name, reason=reason)
        self.say(f"{name}: {reason}; restarting it")
        time.sleep(self.restart_delay)

    def agent_error(self, name: str, code: int) -> Exception:
        """The error a hospital agent stopped with (its last ``ErrorClass: message`` line in
        its log, rebuilt with its class and exit code), else a `FlowerRunError` naming it."""
        log = self.logs / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        prefix = f"{AGENT_FATAL[code]}: "
        starts = [m.start() for m in re.finditer(rf"(?m)^{re.escape(prefix)}", text)]
        if starts and (error := error_from_record(" ".join(text[starts[-1]:].split()))):
            return error
        return FlowerRunError(f"hospital {name}: its agent stopped with exit code {code} "
                              f"({AGENT_FATAL[code]}), which a restart cannot fix; see {log}. "
                              f"Received: exit {code}")

    def _check_sites(self) -> None:
        for site in self.sites:
            proc = self.procs[site.name]
            if proc.poll() is not None:
                stop(proc, grace=2)  # the rest of its process group
                if proc.returncode in AGENT_FATAL:
                    raise self.agent_error(site.name, proc.returncode)
                self._restart(site.name, f"agent exited with code {proc.returncode}")
                self.start_site(site)

    def run(self, cfg: RunConfig, *, timeout: float = 3600,
            on_progress: Callable[[RunRecord], None] | None = None) -> RunRecord:
        """Run ``cfg`` to its end, restarting dead hospitals and a dead coordinator (resume);
        ``on_progress`` gets the run record each time the coordinator rewrites it."""
        app_dir = stage_app(self.work / "app", cfg)
        history_path = Path(cfg.out_dir) / HISTORY_FILE
        self.submit(app_dir)
        submitted = time.time() - 1.0
        deadline = time.monotonic() + timeout
        history = RunRecord()
        run_ended_at: float | None = None
        while True:
            if history_path.exists() and history_path.stat().st_mtime >= submitted:
                with contextlib.suppress(ConfigError):
                    history = RunRecord.load(history_path)
                    if on_progress:
                        on_progress(history)
            status = history.status
            if status == "finished":
                return history
            if status == "failed":
                # the coordinator's own fedsplit error, with its class and exit code (as
                # `flower_runtime.run_app` raises it for simulate and --superlink)
                if (recorded := error_from_record(history.error)) is not None:
                    raise recorded
                if not history.model_rounds:  # nothing trained: each hospital's reason
                    check_trained(history, Path(cfg.out_dir))
                raise FlowerRunError(f"The federation failed: {history.error}. Logs: "
                                     f"{self.logs}. Received: status failed")
            if self.procs[SUPERLINK].poll() is not None:
                raise FlowerRunError(f"The SuperLink exited (code {self.procs[SUPERLINK].returncode}); "
                                     f"see {self.logs / 'superlink.log'}. Received: SuperLink down")
            self.check_front_proxy()
            self._check_sites()
            coordinator = self.procs[COORDINATOR]
            run_proc = self.procs[RUN]
            if run_proc.poll() is not None and run_ended_at is None:
                run_ended_at = time.monotonic()
            # The coordinator died, or the run ended without a final history: restart + resume.
            if coordinator.poll() is not None or (
                    run_ended_at is not None and time.monotonic() - run_ended_at > 15):
                stop(coordinator, grace=5)
                if (run_id := self.current_run_id()) is not None:
                    self.stop_run(run_id)
                done = history.completed_rounds
                reason = (f"exited with code {coordinator.returncode}" if coordinator.returncode
                          is not None else "its run ended without finishing")
                self._restart(COORDINATOR, f"{reason}; the new one resumes after round {done}")
                self.start_coordinator()
                self.submit(app_dir)
                submitted, run_ended_at = time.time() - 1.0, None
            if time.monotonic() > deadline:
                raise FlowerRunError(f"The federation did not finish within {timeout:.0f} s. Logs: "
                                     f"{self.logs}. Received: timeout")
            time.sleep(0.5)

"""A hospital's agent process: its Flower SuperNode, supervised (``fedsplit site run``).

The SuperNode itself retries a dropped SuperLink connection; if it exits unexpectedly it is
restarted with backoff. A refused key or bad arguments stop the agent with a clear
`SiteAgentError` instead of retrying forever.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO

from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, HospitalFailure, SiteAgentError
from rich.console import Console

_console = Console(stderr=True, highlight=False)


def _warn(message: str) -> None:
    _console.print(message)


# Exit codes of flower-supernode that retrying cannot fix (flwr.supercore.exit.ExitCode).
FATAL_EXIT_CODES = {302: "its private key is invalid", 303: "node auth needs TLS (--root-cert)",
                    304: "the trusted-entities file is invalid"}
# "must be registered": the SuperLink wants node auth and this agent has no --key. Fatal at once.
NO_KEY = re.compile(r"must be registered", re.IGNORECASE)
# Refused activation: the key is not registered, or this node's previous session (a crash) is still
# counted online; Flower drops it after 2 missed heartbeats (<= 60 s), so retry that long first.
NOT_ACTIVATED = re.compile(r"Failed to activate|code: ?20\d\d|UNAUTHORIZED", re.IGNORECASE)
ACTIVATION_GRACE_S = 90.0
ACTIVATION_RETRY_S = 10.0


def check_key(key: Path) -> None:
    """Fail early unless ``key`` is an OpenSSH NIST-EC private key, as Flower requires."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    try:
        loaded = load_ssh_private_key(key.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--key must be a readable OpenSSH private key without passphrase, NIST-EC (P-256/384/"
            f"521), e.g. from `fedsplit certs` or `ssh-keygen -t ecdsa -b 384`. ({e}) Received: {key}"
        ) from e
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"Flower SuperNode keys must be NIST elliptic-curve keys (ecdsa), not "
                          f"{type(loaded).__name__}. Received: {key}")


def describe_device() -> str:
    """Which device the ClientApp will train on here (run config ``device=auto``)."""
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU (torch {torch.__version__}; no CUDA device visible)"


def _pump(stream: IO[bytes], seen: list[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        seen.append(line)
        del seen[:-200]
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}", flush=True)


def supervise(cmd: list[str], env: dict[str, str], *, max_restarts: int, name: str,
              say: Callable[[str], None] = _warn) -> int:
    """Run the SuperNode, restarting it on unexpected exits; return 0 when asked to stop.

    Its output is forwarded, time-stamped, to stdout; ``say`` reports restarts (rich markup).
    """
    stopping = threading.Event()
    current: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        for proc in current:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    restarts, backoff = 0, 2.0
    refused_since: float | None = None
    try:
        while True:
            seen: list[str] = []
            started = time.monotonic()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            current[:] = [proc]
            pump = threading.Thread(target=_pump, args=(proc.stdout, seen), daemon=True)
            pump.start()
            try:
                rc = proc.wait()
            finally:
                pump.join(5)
            if stopping.is_set():
                return 0
            tail = " | ".join(seen[-4:])
            if rc in FATAL_EXIT_CODES:
                raise SiteAgentError(f"{name}: the SuperNode stopped because "
                                     f"{FATAL_EXIT_CODES[rc]}. Received: exit {rc}: {tail}")
            # all of this run's output (its last 200 lines, see _pump): Flower's refusal line can be
            # followed by a long traceback (seen: ~70 lines), so a short tail would miss it
            if any(NO_KEY.search(line) for line in seen):
                raise SiteAgentError(
                    f"{name}: the SuperLink requires node authentication: start the agent with "
                    f"--key (this hospital's registered private key). Received: exit {rc}: {tail}")
            refusal = next((line for line in seen if NOT_ACTIVATED.search(line)), None)
            if refusal is not None:
                tail = refusal.strip()
                refused_since = refused_since or started
                if time.monotonic() - refused_since > ACTIVATION_GRACE_S:
                    raise SiteAgentError(
                        f"{name}: the SuperLink refused this hospital for "
                        f"{ACTIVATION_GRACE_S:.0f} s. Its public key must be registered by the "
                        f"coordinator (`flwr supernode register KEY.pub <connection>`) and --key must "
                        f"be the matching private key. Received: exit {rc}: {tail}")
                say(f"[yellow]{name}: activation refused (key not registered, or the "
                              f"previous session is still counted online); retrying[/]")
                if stopping.wait(ACTIVATION_RETRY_S):
                    return 0
                continue
            refused_since = None
            if time.monotonic() - started > 120:
                restarts, backoff = 0, 2.0  # it ran fine for a while: a fresh failure
            restarts += 1
            if restarts > max_restarts:
                raise SiteAgentError(f"{name}: the SuperNode exited {restarts} times in a row; giving "
                                     f"up. Check the SuperLink address and the log above. "
                                     f"Received: exit {rc}: {tail}")
            say(f"[yellow]{name}: SuperNode exited with code {rc}; restarting in "
                          f"{backoff:.0f} s ({restarts}/{max_restarts})[/]")
            if stopping.wait(backoff):
                return 0
            backoff = min(backoff * 2, 30.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


READING = "reading its data"


def read_site_data(data: Path, site: str, *, recipe: str = "", recipe_params: str = "{}",
                   cfg: RunConfig | None = None) -> tuple[int, Path]:
    """Read hospital ``site``'s data at ``data`` exactly as its ClientApp will, before its
    SuperNode starts; return its rows and the file its node config names (``data`` itself when
    the recipe's reader reads it, else the table or NPZ file in it). Any failure (a missing
    file, a file without labels, a suffix no reader reads, a recipe reader that raises) is one
    `HospitalFailure` line naming the hospital, the stage (``reading its data``) and the cause.

    ``recipe``: the node's own recipe (``site run --recipe``), read by its reader when it has
    one (`client.site.load_site`). ``cfg``: the run config, when known (``fedsplit up``): the
    whole load is checked, a table's target column included. Without it (``site run``: the
    coordinator's run config names the target), a table is read and counted, its columns
    checked by the federation's schema exchange before round 1.
    """
    from fedsplit.client.data import TABLE_SUFFIXES, read_table
    from fedsplit.client.failures import hospital_stage
    from fedsplit.client.node_config import NodeConfig
    from fedsplit.client.site import DATA_SUFFIXES, _recipe_read, load_site, resolve_data_path

    node = NodeConfig(data_path=str(data), site_name=site, recipe=recipe,
                      recipe_params=(recipe_params or "{}") if recipe else "")
    run_cfg = cfg if cfg is not None else RunConfig()
    try:
        with hospital_stage(site, READING):
            if not data.exists():
                raise ConfigError(f"data file {data} does not exist; give the hospital's own file "
                                  f"(site run --data, up --site NAME=FILE). Received: {data}")
            if _recipe_read(node, run_cfg) is not None:
                loaded = load_site(node, 0, run_cfg)  # the same read (cached) and split
                return len(loaded.train) + len(loaded.val), data
            path = resolve_data_path(node, run_cfg)
            if path.suffix.lower() not in DATA_SUFFIXES:
                reader = recipe or run_cfg.recipe
                raise ConfigError(
                    f"{path.name} is not a .csv, .parquet or .npz file, and "
                    + (f"recipe {reader}'s read_data does not read it (it returned None): give a "
                       f"file it reads" if reader else "no recipe reads it: give the recipe whose "
                       "read_data reads it (--recipe REF, the run's)")
                    + f". Received: {path}")
            if cfg is None and path.suffix.lower() in TABLE_SUFFIXES:
                rows = len(read_table(path))
                if rows < 2:
                    raise ConfigError(f"a hospital needs at least 2 rows (train and evaluation). "
                                      f"Received: {rows} in {path}")
                return rows, path
            loaded = load_site(node, 0, run_cfg)
            return len(loaded.train) + len(loaded.val), path
    except HospitalFailure as failure:
        if "Received:" in str(failure):
            raise
        fix = f"{failure.fix}. Received: {data}" if failure.fix else f"Received: {data}"
        raise HospitalFailure(site, READING, failure.cause, fix) from failure.__cause__


def forget_reads() -> None:
    """Drop what `read_site_data` kept in this process (`client.site` caches each read)."""
    from fedsplit.client import site as client_site

    reads = getattr(client_site, "_READ", None)
    if isinstance(reads, dict):
        reads.clear()
    for name in ("_raw", "_encoded", "_load"):  # functools.lru_cache'd readers
        if hasattr(cached := getattr(client_site, name, None), "cache_clear"):
            cached.cache_clear()


def run_agent(superlink: str, data: Path, *, root_cert: Path | None = None,
              key: Path | None = None, insecure: bool = False, name: str | None = None,
              port: int = 9094, host: str = "127.0.0.1", isolation: str = "subprocess",
              flwr_home: Path | None = None, max_restarts: int = 10,
              on_start: Callable[[str], None] = lambda _msg: None, recipe: str = "",
              recipe_params: str = "{}", policy: Path | None = None,
              state_dir: Path | None = None) -> None:
    """``fedsplit site run``: check the options against each other, then start this hospital's
    SuperNode (fedsplit's ClientApp on ``data``) and `supervise` it until it ends.

    ``on_start`` gets one line saying what starts (name, SuperLink, TLS, data, device).
    ``recipe``: this hospital's own recipe (node config ``recipe``, ``recipe-params``), imported
    and its parameters validated here first; a recipe whose reader reads ``data`` (e.g. a folder of
    images) gets the folder itself.

    The hospital decides (docs/privacy.md, "The hospital decides"): ``policy`` is its policy file
    (`protocol.site_policy.SitePolicy`, validated here; defaults without one), ``state_dir`` the
    folder of its privacy ledger and egress log (default FLWR_HOME/state); both reach the
    ClientApp through the node config, which the coordinator cannot change. Only the apps this
    installation of fedsplit builds (and the policy's ``trusted_apps``) run here:
    `orchestration.app_trust` puts the checking launchers first on the SuperNode's PATH.
    """
    from fedsplit.orchestration.app_trust import prepare_home, trusted_env
    from fedsplit.orchestration.flower_runtime import flower_env, supernode_command
    from fedsplit.protocol.site_policy import (
        NODE_COORDINATOR,
        NODE_POLICY,
        NODE_STATE_DIR,
        SitePolicy,
    )

    if root_cert is None and not insecure:
        raise ConfigError("Give --root-cert CA.crt to reach the SuperLink over TLS, or --insecure for "
                          "a plaintext test set-up. Received: neither")
    if root_cert is not None and insecure:
        raise ConfigError(f"--root-cert and --insecure exclude each other. Received: both ({root_cert})")
    if key is not None and root_cert is None:
        raise ConfigError("Node authentication (--key) needs TLS: add --root-cert. Received: --key "
                          f"{key} with --insecure")
    if isolation not in ("subprocess", "process"):
        raise ConfigError(f"--isolation must be subprocess or process. Received: {isolation!r}")
    if root_cert is not None and not root_cert.is_file():
        raise ConfigError(f"--root-cert must be a readable CA certificate file. Received: {root_cert}")
    if key is not None:
        check_key(key)
    if policy is not None:
        policy = policy.resolve()
    rules = SitePolicy.load(policy)  # a bad policy file is one line, before anything starts
    impl = None
    if recipe:
        from fedsplit.client.recipes import load_recipe

        impl = load_recipe(recipe, recipe_params)
    site_name = name or (data.name if data.is_dir() else data.stem)
    # Pre-flight: the data, read as the ClientApp will read it, before the SuperNode starts.
    rows, data_file = read_site_data(data.resolve(), site_name, recipe=recipe,
                                     recipe_params=recipe_params)
    forget_reads()  # the ClientApp reads it in its own process
    home = (flwr_home or Path.home() / ".fedsplit" / site_name).resolve()
    state = (state_dir or home / "state").resolve()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    trust = prepare_home(home, site_name,
                         {digest: "trusted by this hospital's policy" for digest in rules.trusted_apps})
    env = trusted_env(flower_env(home), home)
    coordinator = f"{superlink} ({'CA sha256 ' + _sha256(root_cert) if root_cert else 'insecure'})"
    cmd = supernode_command(superlink, data_path=data_file.resolve(), site_name=site_name, port=port,
                            host=host, root_cert=root_cert.resolve() if root_cert else None,
                            key=key.resolve() if key else None, isolation=isolation,
                            recipe=recipe, recipe_params=recipe_params if recipe else "",
                            hospital={NODE_POLICY: str(policy or ""), NODE_STATE_DIR: str(state),
                                      NODE_COORDINATOR: coordinator})
    model = (f"recipe {recipe} ({impl.identity.label()})" if impl is not None
             else "the run's recipe or built-in model (no --recipe of its own)")
    fedsplit_app = next((d for d, label in trust.apps.items() if label.endswith("horizontal app")), "")
    on_start(f"{site_name}: SuperNode -> {superlink} ({'TLS' if root_cert else 'insecure'}"
             f"{', node auth' if key else ''}); data {data_file} ({rows} rows); "
             f"{model}; trains on {describe_device()}; "
             f"policy {policy or 'defaults'}; state {state}; runs only apps it trusts "
             f"({len(trust.apps)}, fedsplit's sha256 {fedsplit_app[:12]}...)")
    supervise(cmd, env, max_restarts=max_restarts, name=site_name)


def _sha256(path: Path) -> str:
    """sha256 of a file's bytes (the CA certificate this hospital trusts)."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()

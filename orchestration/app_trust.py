"""Which Flower apps a hospital (or the coordinator) runs: only the exact fedsplit app its own
installation builds, pinned by the FAB's sha256.

A Flower app travels as a FAB (a zip of its code) that the SuperLink hands to every SuperNode;
Flower 1.42 verifies FAB signatures only against its hub's records, which a hospital network
cannot reach. fedsplit pins instead: the FAB of each of its apps (horizontal, vertical,
survival) is built the same way, byte for byte, by every installation of the same fedsplit
(`flower_runtime.stage_app` writes a pyproject whose run-config defaults are fixed; the run's own
values travel as Flower's run-config override, which is data, never code). So a hospital knows,
from its own installation alone, the sha256 of every app it is willing to run
(`trusted_digests`), plus any its policy adds (``trusted_apps``, after its own review).

`prepare_home` writes, into a Flower process's FLWR_HOME:

- ``fedsplit-trust.json``: who this is (hospital name, or coordinator) and the trusted digests;
- ``bin/flwr-clientapp`` and ``bin/flwr-serverapp``: the launchers (`orchestration.app_launcher`)
  that Flower's SuperExec starts by name for every message (``bin/`` is put first on PATH by
  `trusted_env`). Each checks the FAB it is handed before a line of it is installed or imported,
  and refuses anything else in one line naming the app's publisher, name, version and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.errors import ConfigError

TRUST_FILE = "fedsplit-trust.json"
LAUNCHERS = {"clientapp": "flwr-clientapp", "serverapp": "flwr-serverapp"}


@dataclass(frozen=True)
class Trust:
    """Who runs the launchers (``who``: a hospital's name, or ``coordinator``) and the app
    digests it runs (sha256 hex -> what the app is)."""

    who: str
    apps: dict[str, str]

    def to_json(self) -> str:
        """The trust file's text."""
        return json.dumps({"who": self.who, "apps": self.apps}, indent=2, sort_keys=True)

    @classmethod
    def read(cls, home: Path) -> Trust:
        """The trust file of FLWR_HOME ``home``; a `ConfigError` when missing or malformed."""
        path = home / TRUST_FILE
        try:
            raw = json.loads(path.read_text())
            return cls(str(raw["who"]), {str(k): str(v) for k, v in dict(raw["apps"]).items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"No readable list of trusted apps at {path}: start this process with "
                              f"`fedsplit site run` (a hospital) or `fedsplit superexec` (the "
                              f"coordinator), which write it. Received: {type(e).__name__}: {e}") from e


def app_digest(app_dir: Path) -> str:
    """The sha256 of the FAB Flower builds from ``app_dir`` (what ``flwr run`` submits)."""
    from flwr.cli.build import build_fab_from_disk

    return hashlib.sha256(build_fab_from_disk(app_dir)).hexdigest()


def _fedsplit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedsplit")
    except PackageNotFoundError:
        return "checkout"


def trusted_digests() -> dict[str, str]:
    """The sha256 of each of fedsplit's own apps as this installation builds them."""
    from fedsplit.orchestration.flower_runtime import (
        HORIZONTAL_COMPONENTS,
        VERTICAL_COMPONENTS,
        stage_app,
    )
    from fedsplit.orchestration.survival.run import SURVIVAL_COMPONENTS
    from fedsplit.protocol.config import RunConfig
    from fedsplit.protocol.survival import SurvivalRun
    from fedsplit.protocol.vertical.config import VerticalConfig

    apps = {
        "horizontal": (RunConfig(), HORIZONTAL_COMPONENTS),
        "vertical": (VerticalConfig(), VERTICAL_COMPONENTS),
        "survival": (SurvivalRun(mode="km", time="", event="", out_dir=""), SURVIVAL_COMPONENTS),
    }
    version = _fedsplit_version()
    digests = {}
    with tempfile.TemporaryDirectory(prefix="fedsplit-trust-") as tmp:
        for kind, (cfg, components) in apps.items():
            app = stage_app(Path(tmp) / kind, cfg, components=components)  # type: ignore[arg-type]
            digests[app_digest(app)] = f"fedsplit {version} {kind} app"
    return digests


def _launcher_script(role: str) -> str:
    # -P: nothing from the working directory or the script's folder shadows an installed module
    return (f"#!{sys.executable} -P\n"
            f"# fedsplit: {LAUNCHERS[role]} that runs only the apps in ../{TRUST_FILE}\n"
            f"from fedsplit.orchestration.app_launcher import main\n"
            f"main({role!r})\n")


def prepare_home(home: Path, who: str, extra: dict[str, str] | None = None) -> Trust:
    """Write the trust file and the launchers into FLWR_HOME ``home``; return the trust.

    ``extra``: more digests this party trusts (a hospital's policy ``trusted_apps``). Any app
    installed in ``home/apps`` before is removed, so only what the launchers checked is there.
    """
    home.mkdir(parents=True, exist_ok=True)
    trust = Trust(who, {**trusted_digests(), **(extra or {})})
    shutil.rmtree(home / "apps", ignore_errors=True)
    with atomic_path(home / TRUST_FILE) as tmp:
        tmp.write_text(trust.to_json())
    bin_dir = home / "bin"
    bin_dir.mkdir(exist_ok=True)
    for role, name in LAUNCHERS.items():
        with atomic_path(bin_dir / name) as tmp:
            tmp.write_text(_launcher_script(role))
            tmp.chmod(0o755)
    return trust


def trusted_env(env: dict[str, str], home: Path) -> dict[str, str]:
    """``env`` with ``home/bin`` (the launchers) first on PATH, so Flower's SuperExec starts them
    instead of its own ``flwr-clientapp`` / ``flwr-serverapp``."""
    out = dict(env)
    out["FLWR_HOME"] = str(home)
    rest = [p for p in out.get("PATH", "").split(os.pathsep) if p and p != str(home / "bin")]
    out["PATH"] = os.pathsep.join([str(home / "bin"), *rest])
    return out

"""``flwr-clientapp`` / ``flwr-serverapp`` that run only a trusted app (`orchestration.app_trust`).

Flower's SuperExec starts one of these processes for every message a hospital handles (and for
the coordinator's ServerApp); each pulls the run's FAB, installs it under FLWR_HOME/apps and
imports its code. This launcher is Flower's own entry point with one check put in front of the
install: the FAB's bytes must hash to a digest in FLWR_HOME's trust file, and the digest the
run claims (which names the folder Flower then imports from) must be the same. Anything else is
refused before a file of it is written or a line of it runs: one line in this party's log
(``hospital NAME, checking the app: refused app PUBLISHER/NAME VERSION sha256 ...: why``), and,
for a hospital, the same line as the reply's error, which the coordinator records against it.

The check wraps three functions of Flower 1.42's runtime modules (`pull_task_input` and
`install_from_fab` of ``flwr.supernode.runtime.run_clientapp``; `install_from_fab` and
`get_project_dir` of ``flwr.superlink.runtime.run_serverapp``); `tests/deploy/test_app_trust.py`
runs real SuperNodes against a foreign FAB, so a Flower upgrade that moves them fails there.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedsplit.orchestration.app_trust import Trust
from fedsplit.protocol.errors import HospitalFailure

STAGE = "checking the app"
#: Every refusal, one line each, in FLWR_HOME (the coordinator's ServerApp output is not logged).
REFUSALS = "refused-apps.log"


class UntrustedApp(HospitalFailure):
    """The FAB a run brought is not an app this party trusts; nothing of it ran."""

    reason = "untrusted_app"


def _describe(content: bytes) -> str:
    """``publisher/name version`` from a FAB's pyproject, read as data (nothing imported)."""
    import io
    import tomllib
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(content)) as fab:
            project = tomllib.loads(fab.read("pyproject.toml").decode("utf-8"))
        publisher = project.get("tool", {}).get("flwr", {}).get("app", {}).get("publisher", "?")
        name = project.get("project", {}).get("name", "?")
        version = project.get("project", {}).get("version", "?")
        return f"{publisher}/{name} {version}"
    except Exception:  # a FAB that is not even a readable zip is still refused, by hash
        return "(unreadable FAB)"


def _trusted_what(trust: Trust) -> str:
    """What the trusted apps are, briefly: ``fedsplit 0.1.0's apps`` and any others."""
    labels = sorted(set(trust.apps.values()))
    ours = sorted({label.rsplit(" ", 2)[0] for label in labels if label.startswith("fedsplit ")})
    others = len([label for label in labels if not label.startswith("fedsplit ")])
    return ", ".join([*(f"{v}'s apps" for v in ours), *([f"{others} of its policy"] if others
                                                          else [])])


class Checker:
    """Checks FABs against the trust file of this process's FLWR_HOME."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.trust: Trust | None = None
        self.error: Exception | None = None
        try:
            self.trust = Trust.read(home)
        except Exception as e:  # no trust file: refuse everything, saying why
            self.error = e
        self.verified: set[str] = set()
        self.pending: UntrustedApp | None = None

    @property
    def who(self) -> str:
        """The party this process runs for."""
        return self.trust.who if self.trust else "?"

    def refusal(self, content: bytes, digest: str, why: str) -> UntrustedApp:
        """The one-line refusal, also printed to this party's log."""
        error = UntrustedApp(
            self.who if self.who != "coordinator" else "the coordinator", STAGE,
            f"refused app {_describe(content)} sha256 {digest}: {why}; nothing of it was "
            f"installed or run",
            "Run the same fedsplit version as the coordinator, or, after reviewing that app, add "
            "its sha256 to trusted_apps in this hospital's policy file")
        print(f"ERROR: {error}", file=sys.stderr, flush=True)
        # also kept in FLWR_HOME: Flower hides a ServerApp process's output from the log
        with contextlib.suppress(OSError), open(self.home / REFUSALS, "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {error}\n")
        return error

    def check(self, content: bytes, claimed: str | None = None) -> str:
        """The FAB's digest if trusted (and equal to ``claimed``, the run's); else raise."""
        digest = hashlib.sha256(content).hexdigest()
        if self.trust is None:
            raise self.refusal(content, digest, f"this process has no list of trusted apps "
                                                f"({self.error})")
        if digest not in self.trust.apps:
            known = ", ".join(d[:12] for d, _ in sorted(self.trust.apps.items(),
                                                        key=lambda kv: kv[1]))
            raise self.refusal(content, digest, f"it is none of the {len(self.trust.apps)} "
                                                f"apps this party trusts ({known}: "
                                                f"{_trusted_what(self.trust)})")
        if claimed is not None and claimed != digest:
            raise self.refusal(content, digest, f"the run names it sha256 {claimed}, which is "
                                                f"not the hash of its bytes")
        self.verified.add(digest)
        return digest


def _client(checker: Checker) -> Callable[[], None]:
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    # the module itself (its package exports a function of the same name)
    runtime = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    pull, install = runtime.pull_task_input, runtime.install_from_fab

    def checked_pull(client: Any) -> Any:
        message, context, run, fab = pull(client)
        try:  # raised by the install below, once Flower holds the message to reply to
            checker.check(fab.content, fab.hash_str)
            if run.fab_hash and run.fab_hash != fab.hash_str:
                raise checker.refusal(fab.content, fab.hash_str,
                                      f"the run names another app (sha256 {run.fab_hash})")
        except UntrustedApp as e:
            checker.pending = e
        return message, context, run, fab

    def checked_install(content: bytes, *args: Any, **kwargs: Any) -> Any:
        if checker.pending is not None:
            raise checker.pending
        checker.check(content)
        return install(content, *args, **kwargs)

    runtime.pull_task_input = checked_pull
    runtime.install_from_fab = checked_install
    return flwr_clientapp


def _server(checker: Checker) -> Callable[[], None]:
    from flwr.superlink.cli.flwr_serverapp import flwr_serverapp

    runtime = importlib.import_module("flwr.superlink.runtime.run_serverapp")

    install, project_dir = runtime.install_from_fab, runtime.get_project_dir

    def checked_install(content: bytes, *args: Any, **kwargs: Any) -> Any:
        checker.check(content)
        return install(content, *args, **kwargs)

    def checked_project_dir(fab_id: str, fab_version: str, fab_hash: str, *args: Any,
                            **kwargs: Any) -> Any:
        if fab_hash not in checker.verified:
            raise checker.refusal(b"", fab_hash, "the run names an app other than the one "
                                                 "whose bytes were checked")
        return project_dir(fab_id, fab_version, fab_hash, *args, **kwargs)

    runtime.install_from_fab = checked_install
    runtime.get_project_dir = checked_project_dir
    return flwr_serverapp


def main(role: str) -> None:
    """Run Flower's ``flwr-clientapp`` (``role="clientapp"``) or ``flwr-serverapp`` with the
    check in front of its install."""
    home = Path(os.environ.get("FLWR_HOME", "") or Path.home() / ".flwr")
    checker = Checker(home)
    entry = _client(checker) if role == "clientapp" else _server(checker)
    entry()

"""No PATH surprises: the Flower executables fedsplit starts (and the ones they start by name:
the SuperExec runs ``flwr-serverapp``, a SuperNode ``flwr-clientapp``) are found when the caller's
PATH lacks this environment's ``bin`` (issue 31, finding 10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fedsplit.orchestration import flower_runtime
from fedsplit.orchestration.flower_runtime import flower_env, script_dirs, spawn, tool
from fedsplit.protocol.errors import FlowerRunError

FLOWER = ("flower-superlink", "flower-superexec", "flower-supernode", "flwr", "flwr-serverapp",
          "flwr-clientapp")
BARE_PATH = os.pathsep.join(["/usr/bin", "/bin"])


@pytest.fixture
def bare_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's PATH without this environment's bin (a shell that never activated it)."""
    bins = {str(d) for d in script_dirs()}
    if bins & set(BARE_PATH.split(os.pathsep)):
        pytest.skip("fedsplit is installed in /usr/bin or /bin: no PATH lacks its scripts")
    monkeypatch.setenv("PATH", BARE_PATH)


def test_children_find_flower_executables_without_the_venv_on_path(bare_path: None,
                                                                    tmp_path: Path) -> None:
    env = flower_env(tmp_path / "home")
    entries = env["PATH"].split(os.pathsep)
    assert entries[: len(script_dirs())] == [str(d) for d in script_dirs()]
    assert entries[-2:] == BARE_PATH.split(os.pathsep)  # the caller's PATH follows, unchanged
    # a child started with this env resolves every Flower executable by name, in this installation
    probe = ("import shutil, sys, json; print(json.dumps({n: shutil.which(n) for n in "
             f"{list(FLOWER)!r}}}))")
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                           check=True, timeout=60)
    resolved = json.loads(found.stdout)
    for name in FLOWER:
        assert resolved[name] is not None, f"{name} not found from the child's PATH"
        assert Path(resolved[name]).parent in script_dirs(), resolved[name]
        assert tool(name) == resolved[name]  # what fedsplit starts itself: the same file


def test_a_flower_executable_runs_as_a_child_without_the_venv_on_path(bare_path: None,
                                                                      tmp_path: Path) -> None:
    """`spawn` (how every Flower process starts) with the bare PATH: flwr-serverapp answers."""
    log = tmp_path / "serverapp.log"
    proc = spawn(["flwr-serverapp", "--help"], flower_env(tmp_path / "home"), log)
    assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    assert log.read_text().startswith("usage: flwr-serverapp")


def test_a_missing_executable_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", BARE_PATH)
    monkeypatch.setattr(flower_runtime, "script_dirs", lambda: [])
    with pytest.raises(FlowerRunError, match="Cannot start 'flower-nonesuch'") as info:
        spawn([tool("flower-nonesuch"), "--help"], flower_env(tmp_path / "h"), tmp_path / "x.log")
    assert "\n" not in str(info.value) and str(info.value).endswith("Received: flower-nonesuch")

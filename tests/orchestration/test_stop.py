"""stop() ends a whole process group, also when its leader has already exited."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fedsplit.orchestration.flower_runtime import spawn, stop

# The leader starts a child in its own process group, says so, and exits: what a SuperNode that
# ended leaves behind (its ClientApp processes).
LEADER = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("child started", flush=True)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stop_ends_the_group_left_behind_by_an_exited_leader(tmp_path: Path) -> None:
    log = tmp_path / "leader.log"
    proc = spawn([sys.executable, "-c", LEADER], dict(os.environ), log)
    proc.wait(30)
    assert _group_alive(proc.pid), "the child should still run in the leader's group"
    started = time.monotonic()
    stop(proc, grace=5)
    assert not _group_alive(proc.pid)
    assert time.monotonic() - started < 10


def test_stop_ends_a_running_group(tmp_path: Path) -> None:
    proc = spawn([sys.executable, "-c", LEADER + "import time; time.sleep(120)\n"], dict(os.environ),
                 tmp_path / "leader.log")
    deadline = time.monotonic() + 30
    while "child started" not in (tmp_path / "leader.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    stop(proc, grace=5)
    assert proc.poll() is not None and not _group_alive(proc.pid)

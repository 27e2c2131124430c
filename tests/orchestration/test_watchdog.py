"""The run's watchdog (`orchestration.watchdog`): a run killed outright (SIGKILL) leaves nothing
of what it started running; a run that exits normally has its watchdog leave with it and signal
nothing it did not start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._helpers.leftovers import alive, left_after, tagged, tagged_processes, tree

# A run: spawn() a group whose leader starts a child in a new session (as Flower's SuperLink
# starts its SuperExec), then wait to be killed; or, with "exit", stop its group itself, start one
# process of its own outside spawn (not the run's: the watchdog must leave it alone) and exit.
RUN = """
import os, subprocess, sys, time
from pathlib import Path
from fedsplit.orchestration.flower_runtime import spawn, stop
leader = spawn([sys.executable, "-c", "import subprocess, time; "
                "subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"],
               dict(os.environ), Path(sys.argv[1]))
time.sleep(1.5)  # the detached child exists and the watchdog has noted it
if sys.argv[2] == "exit":
    stop(leader, grace=5)
    own = subprocess.Popen(["sleep", "300"], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(own.pid, flush=True)
    sys.exit(0)
print("ready", flush=True)
time.sleep(300)
"""


def _watchdogs(tag: str) -> dict[int, str]:
    return {p: c for p, c in tagged_processes(tag).items() if "orchestration.watchdog" in c}


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_a_killed_run_leaves_nothing_running(tmp_path: Path) -> None:
    env, tag = tagged(dict(os.environ))
    run = subprocess.Popen([sys.executable, "-c", RUN, str(tmp_path / "leader.log"), "wait"],
                           stdout=subprocess.PIPE, env=env, start_new_session=True)
    try:
        assert run.stdout is not None and run.stdout.readline().strip() == b"ready"
        noted = tree(run.pid)
        commands = " | ".join(tagged_processes(tag).values())
        assert "sleep 300" in commands and "orchestration.watchdog" in commands, commands
        run.kill()
        run.wait(10)
        left = left_after(tag, noted, timeout=15)
        assert not left, f"still running after the run was killed: {left}"
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)


def test_a_run_that_exits_takes_its_watchdog_and_leaves_other_processes_alone(tmp_path: Path) -> None:
    env, tag = tagged(dict(os.environ))
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "leader.log"), "exit"],
                          capture_output=True, env=env, timeout=60, check=True)
    own = int(done.stdout.split()[-1])
    try:
        deadline = time.monotonic() + 10
        while _watchdogs(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _watchdogs(tag), "the watchdog outlived the run that exited"
        # the run's own process outside spawn() is still there: the watchdog signalled nothing
        assert alive({own: tree(own)[own]}), "the watchdog killed a process the run did not spawn"
        assert set(tagged_processes(tag)) == {own}
    finally:
        os.kill(own, signal.SIGKILL)

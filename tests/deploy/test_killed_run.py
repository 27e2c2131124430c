"""Nothing outlives a killed run (issue 43): `fedsplit up` and `fedsplit simulate` SIGKILLed in the
middle of a round leave none of their processes running (SuperLink, SuperExecs, SuperNodes,
hospital agents, the admin API, Flower's simulation engine and Ray): their watchdog
(`orchestration.watchdog`) stops them within seconds.

The run's processes are found two ways: by a tag the test puts into the run's environment (every
process started from it inherits it, the watchdog too), and by the run's process tree noted just
before the kill (a process that rewrites its environment, e.g. with its title, still counts).
Every wait is bounded; whatever is left is killed at the end, so nothing outlives the test either.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fedsplit.orchestration.flower_runtime import flower_env
from fedsplit.orchestration.local_federation import fedsplit_command

from tests._helpers.leftovers import left_after, tagged, tagged_processes, tree

ROUNDS = "50"  # many more than are reached: the kill lands while rounds are running


def _round_done(out: Path) -> bool:
    """Whether some history.json under ``out`` records a trained round (the next one has started)."""
    for path in out.rglob("history.json"):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            if any(r.get("train") for r in json.loads(path.read_text()).get("rounds", [])):
                return True
    return False


def _kill_mid_round(args: list[str], out: Path, log: Path, env: dict[str, str], tag: str,
                    timeout: float) -> None:
    with open(log, "wb") as fh:
        run = subprocess.Popen([*fedsplit_command(), *args], stdout=fh, stderr=subprocess.STDOUT,
                               env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _round_done(out):
            tail = log.read_text(errors="replace")[-2000:]
            assert run.poll() is None, f"the run ended early (exit {run.returncode}): {tail}"
            assert time.monotonic() < deadline, f"no round trained within {timeout:.0f} s: {tail}"
            time.sleep(0.5)
        noted = tree(run.pid)
        assert len(noted) > 3, f"the run should have started its processes: {noted}"
        killed = time.monotonic()
        os.kill(run.pid, signal.SIGKILL)
        run.wait(10)
        left = left_after(tag, noted, timeout=20)
        assert not left, f"still running 20 s after the run was SIGKILLed: {left}"
        print(f"{args[0]}: {len(noted)} processes, all gone {time.monotonic() - killed:.1f} s "
              f"after the SIGKILL")
    finally:
        for pid in tagged_processes(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_up_leaves_nothing_running(tmp_path: Path) -> None:
    env, tag = tagged(flower_env(tmp_path / "flwr-home"))
    work = tmp_path / "up"
    _kill_mid_round(["up", "--sites", "2", "--rounds", ROUNDS, "--dataset", "breast-cancer",
                     "--work", str(work), "--timeout", "600"],
                    work, tmp_path / "up.log", env, tag, timeout=300)


@pytest.mark.slow
def test_a_killed_simulate_leaves_nothing_running(tmp_path: Path) -> None:
    env, tag = tagged(flower_env(tmp_path / "flwr-home"))
    out = tmp_path / "sim"
    _kill_mid_round(["simulate", "--sites", "2", "--rounds", ROUNDS, "--dataset", "breast-cancer",
                     "--out", str(out)], out, tmp_path / "simulate.log", env, tag, timeout=300)

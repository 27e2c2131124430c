"""Run ``fedsplit up`` as a real process group, as an operator's shell would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from fedsplit.orchestration.local_federation import fedsplit_command


def run_up_process(args: list[str], log: Path, env: dict[str, str], timeout: float) -> int:
    """``fedsplit up ARGS`` in its own session, output in ``log``; its exit code. On leaving, the
    whole process group gets SIGTERM, 20 s to stop, then SIGKILL, so nothing outlives the test."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*fedsplit_command(), "up", *args], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

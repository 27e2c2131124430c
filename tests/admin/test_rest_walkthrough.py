"""docs/rest-walkthrough.md's commands, run as written (bash, the venv's commands on PATH) in a
folder outside the checkout: two hospitals upload, the coordinator aggregates, hospital-a
downloads an aggregate the release rule allows. Then the same block with one hospital: the
download stops on the refusal (curl exits 22) and writes no file.

The only changes to the block: the port (a free one instead of 8080, which may be taken here) and
a trap that stops the service if a command fails.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fedsplit.protocol.weights import read_weights

# a live server and four fresh interpreters (about 10 s on 2 cores): with the slow tests
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "rest-walkthrough.md"
#: stops the service however the script ends (bash -e stops it at the first failing command)
STOP_ON_EXIT = "trap 'kill %1 2>/dev/null || true' EXIT\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block() -> str:
    """The walk-through's first bash block."""
    found = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"{DOC} has no ```bash block"
    return found.group(1)


def _run(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDSPLIT_ADMIN_TOKEN")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    """Every command succeeds (bash -e), the service answers before the first call, and the
    downloaded file is the aggregate of both hospitals' 220 rows, not a JSON refusal."""
    block = _block()
    assert "sleep" not in block and "curl -s " not in block and "curl -s -o" not in block
    assert block.count("curl --fail") == block.count("curl ")
    script = block.replace("8080", str(_free_port()))
    done = _run(STOP_ON_EXIT + script, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model = read_weights(tmp_path / "runs" / "round-1.h5")
    assert model.num_examples == 220
    assert '{"status":"ok"}' in done.stdout


def test_one_hospital_is_refused_and_no_file_is_written(tmp_path: Path) -> None:
    """The same block with hospital-b's upload taken out (a round of one, min_uploads 1): the
    hospital's download stops with curl's exit code 22 and runs/round-1.h5 is not written."""
    lines = [line for line in _block().splitlines()
             if "SITE_B" not in line and "site-b" not in line and not line.startswith("kill ")]
    script = "\n".join(lines).replace('"min_uploads": 2', '"min_uploads": 1')
    script = script.replace("8080", str(_free_port()))
    done = _run(STOP_ON_EXIT + script, tmp_path)
    assert done.returncode == 22, done.stdout[-3000:] + done.stderr[-3000:]
    assert "403" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "runs" / "round-1.h5").exists()

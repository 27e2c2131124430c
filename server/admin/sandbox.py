"""Runs `inspect_worker` on an untrusted upload in a fresh, resource-limited process.

Each upload is parsed by its own child of the zygote process (`server.admin.zygote`), which
has h5py and numpy imported already, so a parse starts in milliseconds. A crash of the HDF5
library (segfault, abort), an exhausted memory limit or a hang ends only that child: the
parent waits at most ``timeout_s``, kills it, and turns every such end into a refusal. At most
``workers`` parses run at once. If the zygote itself dies it is started again.

The child's JSON answer is parsed once, here, into a typed `server.admin.inspection.Parsed`
(returned) or `Refused` (raised as `UploadRefusedError` with its ``reason``). A child that
could not set its resource limits refuses to parse (``sandbox_limits``); that is a fault of
the coordinator, not of the file, so it is also logged as an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fedsplit.server.admin.errors import UploadRefusedError
from fedsplit.server.admin.inspection import InspectRequest, InspectResult, Parsed, Refused, result_from_json

log = logging.getLogger(__name__)

_POLL_S = 0.005
_REPO_ROOT = Path(__file__).resolve().parents[2]


class Sandbox:
    """Parses uploads in separate processes, ``workers`` at a time."""

    def __init__(self, *, workers: int, timeout_s: float) -> None:
        self._slots = threading.BoundedSemaphore(workers)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._zygote: subprocess.Popen[str] | None = None

    def start(self) -> None:
        """Start the zygote now (it imports h5py in the background) instead of at the first upload."""
        with self._lock:
            self._ensure_zygote()

    def inspect(self, source: Path, dest: Path, request: InspectRequest) -> Parsed:
        """Return what the worker read from ``source``; raise `UploadRefusedError` on refusal."""
        with self._slots:
            result = self._run(source, dest, request)
        if isinstance(result, Refused):
            if result.reason == "sandbox_limits":
                log.error("upload sandbox refused to parse: %s", result.message)
            raise UploadRefusedError(result.message, result.reason)
        return result

    def close(self) -> None:
        """Stop the zygote (running children finish on their own)."""
        with self._lock:
            zygote, self._zygote = self._zygote, None
        if zygote is None:
            return
        with contextlib.suppress(OSError):
            zygote.stdin.close()  # type: ignore[union-attr]
        try:
            zygote.wait(5)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait(5)
        with contextlib.suppress(OSError):
            zygote.stdout.close()  # type: ignore[union-attr]

    # -- internals -----------------------------------------------------------------------
    def _ensure_zygote(self) -> subprocess.Popen[str]:
        if self._zygote is not None and self._zygote.poll() is None:
            return self._zygote
        env = dict(os.environ)
        env["HDF5_PLUGIN_PRELOAD"] = "::"  # HDF5: never load a plugin library
        env["HDF5_PLUGIN_PATH"] = ""
        env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = "1"
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "fedsplit.server.admin.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(_REPO_ROOT),
        )
        return self._zygote

    def _fork(self, job: dict[str, Any]) -> int:
        line = json.dumps(job) + "\n"
        with self._lock:
            for attempt in range(2):
                zygote = self._ensure_zygote()
                try:
                    zygote.stdin.write(line)  # type: ignore[union-attr]
                    zygote.stdin.flush()  # type: ignore[union-attr]
                    reply = zygote.stdout.readline()  # type: ignore[union-attr]
                except (BrokenPipeError, OSError, ValueError):
                    reply = ""
                if reply:
                    return int(json.loads(reply)["pid"])
                with contextlib.suppress(OSError):
                    zygote.kill()
                zygote.wait(5)
                self._zygote = None
                if attempt == 1:
                    break
        raise UploadRefusedError(
            "The upload sandbox could not start a parser process; the upload was not stored. Try "
            "again; if it persists the coordinator's logs say why. Received: sandbox unavailable",
            "sandbox_unavailable",
        )

    def _run(self, source: Path, dest: Path, request: InspectRequest) -> InspectResult:
        result_path = dest.with_name(f"{dest.name}.{uuid.uuid4().hex}.result.json")
        job = {
            "source": str(source),
            "dest": str(dest),
            "result": str(result_path),
            "request": request.to_json(),
        }
        pid = self._fork(job)
        deadline = time.monotonic() + self._timeout_s
        try:
            while True:
                if result_path.exists():
                    return result_from_json(result_path.read_text())
                if not _alive(pid):
                    if result_path.exists():
                        return result_from_json(result_path.read_text())
                    return _crashed()
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    return Refused(
                        reason="timeout",
                        message=(
                            f"Parsing the uploaded file took longer than {self._timeout_s:g} s and was "
                            f"stopped; a weight file parses in seconds. Check the file (a crafted or "
                            f"damaged HDF5 file can make the reader loop). Received: > "
                            f"{self._timeout_s:g} s"
                        ),
                    )
                time.sleep(_POLL_S)
        finally:
            result_path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _crashed() -> Refused:
    return Refused(
        reason="parser_crash",
        message=(
            "The HDF5 reader crashed on the uploaded file (its sandbox process ended without an "
            "answer, e.g. killed by the memory limit), so the file is damaged or crafted. Re-export "
            "it and upload again. Received: no answer from the parser"
        ),
    )

"""Runs `inspect_worker` on an untrusted upload in a fresh, resource-limited process.

Each upload gets its own process, forked from a forkserver that has already imported h5py and
numpy (so a parse costs milliseconds of start-up, not an interpreter launch). A crash of the
HDF5 library (segfault, abort), an exhausted memory limit or a hang kills only that process:
the parent waits at most ``timeout_s`` and turns every such end into a refusal. At most
``workers`` parses run at once.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

from server.admin.errors import UploadRefusedError
from server.admin.inspect_worker import InspectRequest

_PRELOAD = ["server.admin.inspect_worker"]
_CTX = multiprocessing.get_context("forkserver")


class Sandbox:
    """Parses uploads in separate processes, ``workers`` at a time."""

    def __init__(self, *, workers: int, timeout_s: float) -> None:
        self._slots = threading.BoundedSemaphore(workers)
        self._timeout_s = timeout_s
        # Disable HDF5 plugins for the forkserver (inherits the environment when it starts).
        os.environ["HDF5_PLUGIN_PRELOAD"] = "::"
        _CTX.set_forkserver_preload(_PRELOAD)

    def inspect(self, source: Path, dest: Path, request: InspectRequest) -> dict[str, Any]:
        """Return the worker's result for ``source``; raise `UploadRefusedError` on refusal."""
        with self._slots:
            result = self._run(source, dest, request)
        if not result.get("ok"):
            raise UploadRefusedError(result["message"], result["reason"])
        return result

    def _run(self, source: Path, dest: Path, request: InspectRequest) -> dict[str, Any]:
        from server.admin import inspect_worker

        receiver, sender = _CTX.Pipe(duplex=False)
        proc = _CTX.Process(
            target=inspect_worker.run, args=(sender, str(source), str(dest), request), daemon=True
        )
        proc.start()
        sender.close()
        try:
            if receiver.poll(self._timeout_s):
                try:
                    return receiver.recv()
                except (EOFError, OSError):
                    proc.join(5)
                    return _crashed(proc.exitcode)
            return {
                "ok": False,
                "reason": "timeout",
                "message": (
                    f"Parsing the uploaded file took longer than {self._timeout_s:g} s and was "
                    f"stopped; a weight file parses in seconds. Check the file (a crafted or "
                    f"damaged HDF5 file can make the reader loop). Received: > {self._timeout_s:g} s"
                ),
            }
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            receiver.close()
            proc.close() if proc.exitcode is not None else None


def _crashed(exitcode: int | None) -> dict[str, Any]:
    return {
        "ok": False,
        "reason": "parser_crash",
        "message": (
            "The HDF5 reader crashed on the uploaded file (the sandbox process ended without an "
            "answer), so the file is damaged or crafted. Re-export it and upload again. "
            f"Received: exit code {exitcode}"
        ),
    }

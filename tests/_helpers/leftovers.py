"""Finding what a killed run left running: by a tag in the environment, or by the process tree
noted before the kill (a process that rewrites its environment, e.g. with its title, still
counts)."""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

PROC = Path("/proc")
TAG_ENV = "FEDSPLIT_TEST_TAG"


def tagged(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """``env`` with a fresh tag every process started from it inherits, and the tag."""
    tag = uuid.uuid4().hex
    return {**env, TAG_ENV: tag}, tag


def _start_time(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        raw = (PROC / str(pid) / "stat").read_bytes()
        fields = raw[raw.rfind(b")") + 2:].split()
        if fields[0] != b"Z":  # a zombie has ended; its parent has not reaped it yet
            return int(fields[19])
    return None


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def tagged_processes(tag: str) -> dict[int, str]:
    """pid -> command line of live processes whose environment carries ``tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes() and _start_time(int(entry.name)):
                    found[int(entry.name)] = _cmdline(int(entry.name))
    return found


def tree(root: int) -> dict[int, int]:
    """pid -> start time of ``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                raw = (entry / "stat").read_bytes()
                ppid = int(raw[raw.rfind(b")") + 2:].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if (start := _start_time(pid)) is not None:
            found[pid] = start
        todo += children.get(pid, [])
    return found


def alive(noted: dict[int, int]) -> dict[int, str]:
    """Those of ``noted`` (pid -> start time) still running: pid -> command line."""
    return {pid: _cmdline(pid) for pid, start in noted.items() if _start_time(pid) == start}


def left_after(tag: str, noted: dict[int, int], timeout: float) -> dict[int, str]:
    """What is still running of the tagged or noted processes after at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = {**alive(noted), **tagged_processes(tag)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)

"""Nothing a run started outlives it: a watchdog process that stops them when the run is killed.

`fedsplit simulate` and `fedsplit up` start every Flower process (`flower_runtime.spawn`) in its
own session, so it can be stopped as a group, and Flower's own processes detach further (a
simulation SuperLink starts its SuperExec in a new session). Normally the run stops them all
(`flower_runtime.stop`). When the run itself is killed outright (SIGKILL, the kernel's
out-of-memory killer) no code of it runs, and without this every one of them would keep running.

The first `spawn` of a process starts one watchdog (`ensure`): ``python -m
fedsplit.orchestration.watchdog PARENT MARK``, in its own session, reading the parent's lines on
a pipe (``+PID``: a process group the run started, ``-PID``: stopped by the run, forget it). It
also notes, every `SNAPSHOT_S`, every live descendant of those groups' leaders (pid and start
time, from ``/proc``), and looks again when the run dies: a process that left its group keeps
its place even if its own parent is gone by then. Every process the run starts carries ``MARK_ENV`` in
its environment (inherited by whatever it starts in turn).

When the pipe hits end-of-file (the run exited or died: the kernel closes its end) or the parent
is no longer its parent, the watchdog stops what the run has not stopped itself: the groups still
listed, the noted descendants still alive (same pid and start time), and any process whose
environment carries this run's mark; SIGTERM, then SIGKILL after `GRACE_S` for what is left; then
it exits. A run that ended normally has forgotten every group and its processes are gone: nothing
is signalled twice. Killed processes are reaped by init, as orphans are. Linux only (``/proc``);
elsewhere it watches the process groups alone.

Why not ``prctl(PR_SET_PDEATHSIG)`` on each child: it fires when the *thread* that started the
child exits, not the process, and it reaches only that child, not its group or what it detached.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

#: Environment variable every process a run starts carries: this run's mark (a random id).
MARK_ENV = "FEDSPLIT_RUN_MARK"
#: How often the watchdog notes the descendants of the groups it watches (one pass over /proc:
#: ~70 ms for 160 processes on the loaded 2-core machine, so not every second).
SNAPSHOT_S = 5.0
#: How often it checks that the run is still its parent (when no line arrives).
POLL_S = 1.0
#: How long processes get between SIGTERM and SIGKILL once the run is gone.
GRACE_S = 3.0
PROC = Path("/proc")


# --- the parent's side -------------------------------------------------------------------


class Watchdog:
    """The parent's handle on its watchdog process: `watch` and `forget` process groups."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex
        self.owner = os.getpid()
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fedsplit.orchestration.watchdog", str(self.owner), self.mark],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={k: v for k, v in os.environ.items() if k != MARK_ENV})

    def _send(self, line: str) -> None:
        stdin = self._proc.stdin
        with self._lock, contextlib.suppress(OSError, ValueError):  # a dead watchdog: nothing to do
            if stdin is not None:
                stdin.write(f"{line}\n".encode())
                stdin.flush()

    def watch(self, pgid: int) -> None:
        """Stop process group ``pgid`` (and its descendants) if this process dies."""
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        """Process group ``pgid`` was stopped by this process: leave it alone."""
        self._send(f"-{pgid}")


_current: Watchdog | None = None
_current_lock = threading.Lock()


def ensure() -> Watchdog:
    """This process's watchdog, started on first use (again in a forked child)."""
    global _current
    with _current_lock:
        if _current is None or _current.owner != os.getpid():
            _current = Watchdog()
        return _current


def current() -> Watchdog | None:
    """This process's watchdog if it started one (None: nothing to forget)."""
    return _current if _current is not None and _current.owner == os.getpid() else None


# --- the watchdog's side -----------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, pgid, session, start time) of ``pid`` from /proc, None if it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def _table() -> dict[int, tuple[int, int, int, int]]:
    """Every live process: pid -> (ppid, pgid, session, start time)."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(PROC):
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                found[int(entry.name)] = stat
    return found


def _descendants(roots: Iterable[int], table: dict[int, tuple[int, int, int, int]]) -> set[int]:
    """Every member of the process groups ``roots`` and every process below one of them."""
    groups = set(roots)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _pgid, _sid, _start) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_p, pgid, _s, _t) in table.items() if pgid in groups}
    todo = list(groups | found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _marked(mark: str) -> set[int]:
    """Processes whose environment carries this run's mark (unreadable ones are skipped)."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(PROC):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if needle in (PROC / entry.name / "environ").read_bytes():
                        found.add(int(entry.name))
    return found


class _Reaper:
    """What the watchdog knows of the run: its groups and their noted descendants."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self.groups: set[int] = set()
        self.noted: dict[int, int] = {}  # pid -> start time

    def take(self, line: str) -> None:
        with contextlib.suppress(ValueError):
            if line.startswith("+"):
                self.groups.add(int(line[1:]))
            elif line.startswith("-"):
                pgid = int(line[1:])
                self.groups.discard(pgid)
                table = _table()  # its members are stopped: no longer ours to stop
                self.noted = {p: t for p, t in self.noted.items()
                              if p in table and table[p][3] == t and table[p][1] != pgid}

    def snapshot(self) -> None:
        table = _table()
        self.noted = {p: t for p, t in self.noted.items() if p in table and table[p][3] == t}
        for pid in _descendants(self.groups, table):
            self.noted.setdefault(pid, table[pid][3])

    def targets(self) -> set[int]:
        """The run's live processes, this one excluded."""
        table = _table()
        found = {p for p, t in self.noted.items() if p in table and table[p][3] == t}
        found |= _descendants(self.groups, table) | _marked(self.mark)
        found |= {pgid for pgid in self.groups if pgid in table}
        found.discard(os.getpid())
        return found

    def signal_all(self, sig: int) -> set[int]:
        """Send ``sig`` to the run's groups and processes; return the processes signalled."""
        for pgid in self.groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, sig)
        hit = self.targets()
        for pid in hit:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        return hit

    def stop_everything(self, grace: float = GRACE_S) -> None:
        self.snapshot()
        if not self.signal_all(signal.SIGTERM):
            return
        deadline = time.monotonic() + grace
        while self.targets() and time.monotonic() < deadline:
            time.sleep(0.1)
        settle = time.monotonic() + 5.0  # SIGKILL until nothing is left (bounded)
        while self.signal_all(signal.SIGKILL) and time.monotonic() < settle:
            time.sleep(0.2)


def main(parent: int, mark: str) -> None:
    """Watch ``parent`` (the run) until it exits or dies; then stop what it left running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle, not ours
    reaper = _Reaper(mark)
    stdin = sys.stdin.buffer.raw  # type: ignore[attr-defined]
    pending = b""
    next_snapshot = time.monotonic() + SNAPSHOT_S
    while True:
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready:
            data = os.read(stdin.fileno(), 65536)
            if not data:
                break  # the run exited or was killed: the kernel closed its end
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                reaper.take(line.decode(errors="replace").strip())
        if os.getppid() != parent:
            break
        if time.monotonic() >= next_snapshot and reaper.groups:
            reaper.snapshot()
            next_snapshot = time.monotonic() + SNAPSHOT_S
    reaper.stop_everything()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])

"""Benchmark: large weight files through the admin API (issue 43): time, memory and disk per upload.

Starts `fedsplit admin serve` on 127.0.0.1 (random port, temporary data directory, the server's
code from ``--repo``: this checkout by default, or e.g. a ``git worktree`` of an older commit to
compare), writes one weight file of PARAMS float32 values (default 100M: 400 MB) in 12 layers,
and uploads it FILES times, one hospital after another, to one round. Per upload it prints:

- ``s``: seconds from the first byte sent to the receipt;
- ``peak_rss_mb``: the highest resident memory of the server's process tree (server, sandbox
  zygote and parser), sampled every 0.1 s during the upload, and ``server_hwm_mb``: the server
  process's own peak (VmHWM) so far;
- ``written``: bytes the server's process tree wrote to storage for it (``/proc/PID/io``
  write_bytes less cancelled_write_bytes of every process in it, the short-lived parser
  processes included, sampled every 0.1 s: a parser's last 0.1 s may be missed), against the
  file's size;
- ``peak_disk``: the most bytes the files directory held above its size before the upload, while
  it ran (sampled every 0.1 s), and ``kept``: what it holds after, both against the file's size.

    .venv/bin/python bench/admin_large_upload.py --files 5 --params 100000000
    git worktree add /tmp/before <commit>; .venv/bin/python bench/admin_large_upload.py --repo /tmp/before
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedsplit.orchestration.upload_client import upload_file  # noqa: E402
from fedsplit.protocol import Update, write_weights  # noqa: E402
from fedsplit.server.admin.store import add_site  # noqa: E402

TOKEN = "bench-admin-token-0123456789abcdef"
SERVE = (
    "import sys; from fedsplit.cli.admin import admin_app; from fedsplit.cli.errors import run_guarded; "
    "sys.exit(run_guarded(admin_app, sys.argv[1:]))"
)
MB = 1024 * 1024


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_bytes()
            except OSError:
                continue
            children.setdefault(int(raw[raw.rfind(b")") + 2:].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def proc_value(pid: int, name: str, key: str) -> int:
    """A number from /proc/PID/NAME (``status``: kB; ``io``: bytes); 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def io_written(pid: int) -> int:
    """Bytes process ``pid`` has sent to storage (0 if gone)."""
    return proc_value(pid, "io", "write_bytes") - proc_value(pid, "io", "cancelled_write_bytes")


def disk_bytes(root: Path) -> int:
    """Bytes of the files under ``root``."""
    total = 0
    for path in root.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            continue
    return total


class Sampler:
    """Samples the server tree's RSS, each of its processes' bytes written and the files
    directory's size every 0.1 s."""

    def __init__(self, pid: int, files: Path) -> None:
        self.pid, self.files = pid, files
        self.rss_kb = 0
        self.disk = 0
        self.start_io = {p: io_written(p) for p in tree(pid)}
        self.io = dict(self.start_io)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        pids = tree(self.pid)
        self.rss_kb = max(self.rss_kb, sum(proc_value(p, "status", "VmRSS") for p in pids))
        for p in pids:
            self.io[p] = max(self.io.get(p, 0), io_written(p))
        self.disk = max(self.disk, disk_bytes(self.files))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.1)

    @property
    def written(self) -> int:
        """Bytes the tree's processes wrote while sampled."""
        return sum(self.io.values()) - sum(self.start_io.values())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()


def make_file(path: Path, params: int) -> Path:
    """A weight file of ``params`` float32 values in 12 layers."""
    rng = np.random.default_rng(0)
    per = params // 12
    arrays = {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(12)}
    return write_weights(Update(arrays=arrays, num_examples=100), path)


@contextlib.contextmanager
def admin_server(repo: Path, data: Path, extra: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`fedsplit admin serve` with ``repo``'s code on a free port, once /healthz answers: (process,
    URL); SIGTERM on leaving (SIGKILL after 30 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FEDSPLIT_ADMIN_TOKEN": TOKEN, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--data-dir", str(data),
                             "--port", str(port), *extra], env=env, cwd=repo)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
            if time.monotonic() > deadline:
                raise RuntimeError("the admin API did not start within 90 s")
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    """Run the benchmark and print one line per upload, then the medians."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=3, help="uploads (one hospital each)")
    parser.add_argument("--params", type=int, default=100_000_000, help="float32 values per file")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose server code runs")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `admin serve` argument (repeat), e.g. --serve-arg=--max-model-mb=1024")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedsplit-bench-upload-"))
    data = work / "data"
    t0 = time.perf_counter()
    source = make_file(work / "model.h5", args.params)
    size = source.stat().st_size
    print(f"file: {args.params} float32 values, {size / MB:.0f} MiB, written in "
          f"{time.perf_counter() - t0:.1f} s; server code: {args.repo}", flush=True)
    rows = []
    try:
        with admin_server(args.repo, data, args.serve_arg) as (proc, url):
            admin = {"Authorization": f"Bearer {TOKEN}"}
            rnd = httpx.post(f"{url}/api/v1/rounds", json={"min_uploads": 1}, headers=admin).json()
            for i in range(args.files):
                token = add_site(data_dir=data, name=f"site{i}")
                before_disk = disk_bytes(data / "files")
                with Sampler(proc.pid, data / "files") as sampler:
                    started = time.perf_counter()
                    upload_file(source, url, rnd["id"], token=token, timeout=600)
                    seconds = time.perf_counter() - started
                row = {
                    "s": seconds,
                    "peak_rss_mb": sampler.rss_kb / 1024,
                    "server_hwm_mb": proc_value(proc.pid, "status", "VmHWM") / 1024,
                    "written": sampler.written / size,
                    "peak_disk": (sampler.disk - before_disk) / size,
                    "kept": (disk_bytes(data / "files") - before_disk) / size,
                }
                rows.append(row)
                print(f"upload {i + 1}: {row['s']:.1f} s, peak RSS (server tree) "
                      f"{row['peak_rss_mb']:.0f} MiB, server VmHWM {row['server_hwm_mb']:.0f} MiB, "
                      f"written {row['written']:.2f}x, peak disk {row['peak_disk']:.2f}x, "
                      f"kept {row['kept']:.2f}x the file", flush=True)
            med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
            print(f"median of {len(rows)}: {med['s']:.1f} s per upload, peak RSS "
                  f"{med['peak_rss_mb']:.0f} MiB, written {med['written']:.2f}x, peak disk "
                  f"{med['peak_disk']:.2f}x, kept {med['kept']:.2f}x ({size / MB:.0f} MiB file)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

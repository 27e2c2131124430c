"""Benchmark: peak memory of the admin API while it aggregates N uploaded files of a large model.

Starts `fedsplit admin serve` on 127.0.0.1 (random port, temporary data directory), registers N
sites, uploads a weight file of PARAMS float32 values from each over HTTP, resets the server
process's peak-RSS counter (Linux /proc/PID/clear_refs), aggregates with fedavg, and prints the
server's idle RSS, its peak RSS during aggregation, and the difference.

    .venv/bin/python bench/admin_aggregate_memory.py --files 100 --params 11700000
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from admin_large_upload import TOKEN, admin_server  # noqa: E402  (bench/ is on sys.path)
from fedsplit.protocol import Update, write_weights  # noqa: E402
from fedsplit.server.admin.store import add_site  # noqa: E402


def status_kb(pid: int, key: str) -> int:
    """A /proc/PID/status value in kB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def make_file(path: Path, params: int, seed: int) -> Path:
    """A weight file of ``params`` float32 values in 12 layers."""
    rng = np.random.default_rng(seed)
    per, layers = params // 12, 12
    arrays = {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(layers)}
    return write_weights(Update(arrays=arrays, num_examples=100 + seed), path)


def main() -> None:
    """Run the benchmark and print the numbers."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--params", type=int, default=11_700_000)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedsplit-bench-"))
    data = work / "data"
    try:
        with admin_server(REPO, data, ["--max-upload-mb", "100"]) as (proc, url):
            admin = {"Authorization": f"Bearer {TOKEN}"}
            rnd = httpx.post(f"{url}/api/v1/rounds", json={"min_uploads": args.files}, headers=admin).json()
            sources = [make_file(work / f"src{i}.h5", args.params, i) for i in range(4)]
            size_mb = sources[0].stat().st_size / 2**20
            tokens = [add_site(data_dir=data, name=f"site{i}") for i in range(args.files)]

            def send(i: int) -> None:
                with open(sources[i % 4], "rb") as fh:
                    r = httpx.post(
                        f"{url}/api/v1/rounds/{rnd['id']}/uploads",
                        files={"file": (f"s{i}.h5", fh)},
                        headers={"Authorization": f"Bearer {tokens[i]}"},
                        timeout=600,
                    )
                r.raise_for_status()

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.parallel) as pool:
                list(pool.map(send, range(args.files)))
            upload_s = time.perf_counter() - t0
            time.sleep(1)
            idle_kb = status_kb(proc.pid, "VmRSS")
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/api/v1/rounds/{rnd['id']}/aggregate", headers=admin, timeout=3600)
            r.raise_for_status()
            agg_s = time.perf_counter() - t0
            peak_kb = status_kb(proc.pid, "VmHWM")
            print(
                f"files={args.files} params={args.params} file_mb={size_mb:.1f} upload_s={upload_s:.1f} "
                f"aggregate_s={agg_s:.1f} idle_rss_mb={idle_kb / 1024:.0f} peak_rss_mb={peak_kb / 1024:.0f} "
                f"peak_above_idle_mb={(peak_kb - idle_kb) / 1024:.0f}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    main()

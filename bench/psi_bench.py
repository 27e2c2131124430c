"""Time private ID alignment (protocol.vertical.psi) of N x N IDs between two parties on two cores.

Each party runs in its own process (one core each), as the label holder and a feature site
would, and they exchange encrypted points through pipes. Measures the whole alignment: both
parties encrypt their own IDs, re-encrypt the other's, and find the shared rows in agreed order.

    .venv/bin/python bench/psi_bench.py --n 1000000 --overlap 0.5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import Connection


def _exchange(conn: Connection, blob: bytes) -> bytes:
    """Send ``blob`` and receive the other party's, without both blocking on a full pipe."""
    sender = threading.Thread(target=conn.send_bytes, args=(blob,))
    sender.start()
    got = conn.recv_bytes()
    sender.join()
    return got


def _split(blob: bytes) -> list[bytes]:
    return [blob[i:i + 33] for i in range(0, len(blob), 33)]


def _party(name: str, ids: list[str], conn: Connection, out: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from fedsplit.protocol.vertical.psi import PsiSession

    t0 = time.perf_counter()
    session = PsiSession(ids)
    mine_single = session.outgoing()
    t_encrypt = time.perf_counter() - t0
    theirs_single = _split(_exchange(conn, b"".join(mine_single)))
    t1 = time.perf_counter()
    theirs_double = session.answer(theirs_single)
    t_reencrypt = time.perf_counter() - t1
    mine_double = _split(_exchange(conn, b"".join(theirs_double)))
    t2 = time.perf_counter()
    alignment, points = session.finish(mine_double, theirs_single, theirs_double)
    t_match = time.perf_counter() - t2
    first = [ids[r] for r in alignment.rows[:3]]
    out.put({"party": name, "shared": alignment.size, "encrypt_s": round(t_encrypt, 1),
             "reencrypt_s": round(t_reencrypt, 1), "match_s": round(t_match, 1),
             "first_shared": first, "first_points": [p.hex()[:16] for p in points[:2]]})


def main() -> None:
    """Run the benchmark and print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1_000_000, help="IDs per party")
    ap.add_argument("--overlap", type=float, default=0.5, help="share of IDs both hold")
    args = ap.parse_args()
    n, shared = args.n, int(args.n * args.overlap)
    a_ids = [f"patient-{i:09d}" for i in range(n)]
    b_ids = [f"patient-{i:09d}" for i in range(n - shared, 2 * n - shared)]
    ctx = mp.get_context("spawn")
    a_end, b_end = ctx.Pipe()
    results: mp.Queue = ctx.Queue()
    start = time.perf_counter()
    procs = [ctx.Process(target=_party, args=("label-holder", a_ids, a_end, results)),
             ctx.Process(target=_party, args=("site", b_ids, b_end, results))]
    for p in procs:
        p.start()
    got = [results.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(60)
    wall = time.perf_counter() - start
    ok = all(g["shared"] == shared for g in got) and got[0]["first_shared"] == got[1]["first_shared"] \
        and got[0]["first_points"] == got[1]["first_points"]
    print(json.dumps({"n": n, "expected_shared": shared, "wall_s": round(wall, 1),
                      "agreed": ok, "cpus": os.cpu_count(), "parties": got}))


if __name__ == "__main__":
    main()

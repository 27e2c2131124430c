"""Round time of secure aggregation vs plain FedAvg in a real Flower simulation (issue 13).

For each number of hospitals N, two runs of ``fedsplit simulate`` (Flower's simulation engine,
Ray, one CPU per virtual hospital, as `orchestration.flower_runtime.simulation` starts it) on
the same data and seed, one plain and one with ``--secure-aggregation on``; the round times come
from the coordinator's history (``federation/history.json``, ``seconds`` per round). Round 1
includes Ray's start and each worker's imports (about 30 s whatever the mode), so the table
reports the mean of rounds 2..R; the secure run's stage times (setup, share-keys, unmask) come
from the same history.

Data: a generated ``sklearn.datasets.make_classification`` table (30 features, 2 classes, nothing
downloaded) split into N CSV files of ``--rows`` rows, one per hospital (``--site``). Model:
``--hidden 300-300`` (about 100k parameters, the size of the issue's reference measurement).

    .venv/bin/python bench/secure_aggregation_flower.py --hospitals 10,20,100 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedsplit.protocol.record.common import HISTORY_FILE, SUMMARY_FILE
from fedsplit.protocol.record.horizontal import RoundEntry, RunRecord
from fedsplit.protocol.record.summary import RunSummary

ROOT = Path(__file__).resolve().parents[1]


def write_sites(folder: Path, hospitals: int, rows: int, seed: int) -> list[Path]:
    """N CSV tables of ``rows`` rows (30 features, column ``target``) from one generated set."""
    import numpy as np
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=hospitals * rows, n_features=30, n_informative=10,
                               random_state=seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    header = ",".join([f"f{j}" for j in range(30)] + ["target"])
    for i in range(hospitals):
        path = folder / f"h{i:03d}.csv"
        block = np.c_[x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]]
        np.savetxt(path, block, delimiter=",", header=header, comments="",
                   fmt=["%.6f"] * 30 + ["%d"])
        paths.append(path)
    return paths


def simulate(sites: list[Path], out: Path, args: argparse.Namespace, secure: bool
             ) -> dict[str, Any]:
    """Run ``fedsplit simulate``; return its history and summary and the wall seconds."""
    cmd = [str(Path(sys.executable).parent / "fedsplit"), "simulate", "--out", str(out),
           "--rounds", str(args.rounds), "--hidden", args.hidden, "--local-steps",
           str(args.steps), "--seed", str(args.seed)]
    for site in sites:
        cmd += ["--site", str(site)]
    if secure:
        cmd += ["--secure-aggregation", args.secure]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "COLUMNS": "120"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    (out / "bench.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "bench.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"fedsplit simulate failed (exit {proc.returncode}); see {out}/bench.log")
    history = RunRecord.load(out / "federation" / HISTORY_FILE)
    summary = RunSummary.load(out / SUMMARY_FILE)
    return {"history": history, "summary": summary, "wall": wall}


def round_seconds(history: RunRecord) -> list[float]:
    """Each round's seconds as the coordinator recorded them."""
    return [float(r.seconds or 0.0) for r in history.rounds]


def secure_details(entry: RoundEntry) -> dict[str, Any]:
    """The secure-aggregation details of a round's aggregation report."""
    return entry.aggregation.details["secure_aggregation"] if entry.aggregation else {}


def stage_seconds(history: RunRecord) -> dict[str, float]:
    """Mean secure stage seconds over rounds 2..R (setup, share-keys, unmask)."""
    rows = [secure_details(r)["stage_seconds"] for r in history.rounds[1:]]
    return {k: sum(row[k] for row in rows) / len(rows) for k in rows[0]} if rows else {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (shared with `bench/secure_aggregation.py`)."""
    parser.add_argument("--rounds", type=int, default=3, help="at least 2 (round 1 is start-up)")
    parser.add_argument("--rows", type=int, default=400, help="rows per hospital")
    parser.add_argument("--hidden", default="300-300", help="MLP widths (300-300: ~100k params)")
    parser.add_argument("--steps", type=int, default=10, help="local mini-batches per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--secure", default="on", help="the --secure-aggregation spec")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON")


def table(hospitals: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run plain and secure simulations for each N; print and return one row per N."""
    if args.rounds < 2:
        raise SystemExit(f"--rounds must be >= 2 (round 1 holds Ray's start-up). Received: "
                         f"{args.rounds}")
    work = args.out or Path(tempfile.mkdtemp(prefix="fedsplit-secagg-bench-"))
    print(f"Flower simulation: cpus {os.cpu_count()}; load average before "
          f"{os.getloadavg()[0]:.2f}; unmasking workers "
          f"{os.environ.get('FEDSPLIT_SECAGG_WORKERS', 'default')}; runs in {work}")
    print(f"{'N':>4} {'K':>3} {'T':>3} {'plain s':>8} {'secure s':>9} {'ratio':>6} "
          f"{'setup':>6} {'shares':>7} {'unmask':>7} {'acc plain':>9} {'acc secure':>10} "
          f"{'load':>5}", flush=True)
    rows = []
    for n in hospitals:
        sites = write_sites(work / f"data-{n}", n, args.rows, args.seed)
        plain = simulate(sites, work / f"plain-{n}", args, secure=False)
        secure = simulate(sites, work / f"secure-{n}", args, secure=True)
        p, s = round_seconds(plain["history"])[1:], round_seconds(secure["history"])[1:]
        p_mean, s_mean = sum(p) / len(p), sum(s) / len(s)
        details = secure_details(secure["history"].rounds[-1])
        stages = stage_seconds(secure["history"])
        acc = [r["summary"].federated.mean_per_site["accuracy"] for r in (plain, secure)]
        load = os.getloadavg()[0]
        row = {"hospitals": n, "share_num": details["share_num"],
               "threshold": details["threshold"], "plain_s": p_mean, "secure_s": s_mean,
               "ratio": s_mean / p_mean, "stages": stages, "accuracy": acc, "load": load,
               "plain_rounds": round_seconds(plain["history"]),
               "secure_rounds": round_seconds(secure["history"]),
               "wall": [plain["wall"], secure["wall"]]}
        rows.append(row)
        print(f"{n:>4} {row['share_num']:>3} {row['threshold']:>3} {p_mean:>8.2f} {s_mean:>9.2f} "
              f"{row['ratio']:>6.2f} {stages.get('setup', 0):>6.2f} "
              f"{stages.get('share-keys', 0):>7.2f} {stages.get('unmask', 0):>7.2f} "
              f"{acc[0]:>9.4f} {acc[1]:>10.4f} {load:>5.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hospitals", default="10,20,100")
    add_arguments(parser)
    args = parser.parse_args()
    table([int(h) for h in args.hospitals.split(",")], args)


if __name__ == "__main__":
    main()

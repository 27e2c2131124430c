"""Deployment round time: fedsplit up against a bare Flower app of the same shape (issue 32).

Both sides run Flower 1.42's deployment runtime on 127.0.0.1 with the same topology: a SuperLink
(``--isolation process``) and a SuperExec running the ServerApp, N SuperNodes (``--isolation
subprocess``: one ClientApp process per message), the same breast-cancer rows split over N
hospitals. The bare side is ``bench/deploy_bare`` (Flower's FedAvg; its ClientApp imports torch
like fedsplit's agent; train and evaluate every round, or train only with ``--bare-train-only``);
the fedsplit side is ``fedsplit up --sites N --rounds R`` (set-up exchanges, one message per
hospital per round, the closing evaluation, history and models written).

Runs alternate (bare, fedsplit, fedsplit, bare, ...) and every run prints the load average
before it. Per round: the bare app's times are noted by its ServerApp at the end of each round
(round 1 from the ServerApp's start); fedsplit's are history.json's ``seconds`` (round 1 from
the coordinator's start, set-up included; the last round includes the closing evaluation).
Printed: per run the rounds, the first round, the median of rounds 2..R, the wall time of the
whole command (runtime start-up included); then medians over runs and the ratios
fedsplit / bare for the median round, the first round and the total, and fedsplit's first
round over its own median round.

    .venv/bin/python bench/deploy_rounds.py --sites 3 --rounds 5 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from fedsplit.orchestration.flower_runtime import (
    CONNECTION,
    flower_env,
    free_port,
    health_url,
    spawn,
    stop,
    superexec_command,
    superlink_command,
    supernode_command,
    tool,
    wait_http,
    write_connection,
)
from fedsplit.protocol.record.horizontal import RunRecord

BARE_APP = Path(__file__).resolve().parent / "deploy_bare"


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def hospital_files(work: Path, sites: int) -> list[Path]:
    """The breast-cancer rows in ``sites`` shuffled equal parts, one CSV each (label last)."""
    import numpy as np
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    order = np.random.default_rng(0).permutation(len(data.target))
    files = []
    for k, part in enumerate(np.array_split(order, sites)):
        path = work / f"hospital-{k + 1}.csv"
        rows = np.column_stack([data.data[part], data.target[part]])
        np.savetxt(path, rows, delimiter=",", header=",".join(["f"] * 30 + ["y"]), comments="")
        files.append(path)
    return files


def bare_env(home: Path) -> dict[str, str]:
    """A Flower process of the bare side: fedsplit's isolation (FLWR_HOME, no phoning home, no
    runtime installs) but Flower's own SuperExec poll interval."""
    env = flower_env(home)
    env.pop("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", None)
    return env


@contextlib.contextmanager
def bare_federation(work: Path, nodes: Sequence[tuple[str, Path]], *,
                    env_of: Callable[[Path], dict[str, str]] = bare_env,
                    database: Path | None = None) -> Iterator[dict[str, str]]:
    """Flower's deployment runtime on 127.0.0.1, stopped on leaving: a SuperLink (``--isolation
    process``; ``database``: its ``--database``), a SuperExec for the ServerApp, a SuperNode per
    (name, data path); yields the environment of a ``flwr`` CLI connected to it. Each process
    gets ``env_of(its own FLWR_HOME)``."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs = []
    try:
        link = spawn(superlink_command(port, isolation="process", database=database),
                     env_of(work / "link"), work / "superlink.log")
        procs.append(link)
        wait_http(health_url(address, False), 60, link)
        procs.append(spawn(superexec_command(address), env_of(work / "exec"),
                           work / "superexec.log"))
        for name, path in nodes:
            procs.append(spawn(supernode_command(address, data_path=path, site_name=name,
                                                 port=free_port()),
                               env_of(work / name), work / f"{name}.log"))
        write_connection(work / "cli", address)
        yield env_of(work / "cli")
    finally:
        for proc in reversed(procs):
            stop(proc)


def run_bare(work: Path, sites: int, rounds: int, evaluate: bool) -> dict:
    """One run of the bare app; its round times and the command's wall time."""
    work.mkdir(parents=True)
    files = hospital_files(work, sites)
    times = work / "times.jsonl"
    start = time.monotonic()
    nodes = [(f"h{k}", path) for k, path in enumerate(files, start=1)]
    with bare_federation(work, nodes) as cli_env:
        config = (f"num-server-rounds={rounds} min-nodes={sites} evaluate={int(evaluate)} "
                  f"times-file='{times}'")
        app = work / "app"
        shutil.copytree(BARE_APP, app, ignore=shutil.ignore_patterns("__pycache__"))
        done = subprocess.run([tool("flwr"), "run", str(app), CONNECTION, "--stream",
                               "--run-config", config], env=cli_env,
                              capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - start
        if done.returncode != 0:
            raise RuntimeError(f"bare run failed (exit {done.returncode}): {done.stdout[-800:]}")
    notes = [json.loads(line) for line in times.read_text().splitlines()]
    t0 = next(n["t"] for n in notes if n.get("start"))
    ends = [n["t"] for n in notes if "round" in n]
    seconds = [b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)]
    return {"round_seconds": seconds, "wall": wall}


def run_fedsplit(work: Path, sites: int, rounds: int) -> dict:
    """One ``fedsplit up`` run; history.json's round times and the command's wall time."""
    start = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "fedsplit"), "up", "--sites",
                           str(sites), "--rounds", str(rounds), "--work", str(work)],
                          capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"fedsplit up failed (exit {done.returncode}): {done.stdout[-800:]}"
                           f"{done.stderr[-800:]}")
    history = RunRecord.load(work / "out" / "history.json")
    seconds = [float(r.seconds or math.nan) for r in sorted(history.rounds, key=lambda r: r.round)]
    return {"round_seconds": seconds, "wall": wall}


def summary(run: dict) -> dict:
    rounds = run["round_seconds"]
    return {"first": rounds[0], "median": statistics.median(rounds[1:]), "total": sum(rounds),
            "wall": run["wall"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("--bare-train-only", action="store_true",
                        help="the bare app without its evaluate phase")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="deploy-rounds-"))
    results: dict[str, list[dict]] = {"bare": [], "fedsplit": []}
    order = []
    for i in range(args.repeats):  # bare, fedsplit, fedsplit, bare, ...
        order += ["bare", "fedsplit"] if i % 2 == 0 else ["fedsplit", "bare"]
    for n, side in enumerate(order):
        before = load()
        if side == "bare":
            run = run_bare(work / f"{n}-bare", args.sites, args.rounds, not args.bare_train_only)
        else:
            run = run_fedsplit(work / f"{n}-fedsplit", args.sites, args.rounds)
        run["load"] = f"{before} -> {load()}"
        results[side].append(run)
        s = summary(run)
        times = ", ".join(f"{x:.1f}" for x in run["round_seconds"])
        print(f"{side:9s} run {n + 1}: rounds {times} s | "
              f"first {s['first']:.1f} s, median 2..{args.rounds} {s['median']:.1f} s, "
              f"rounds total {s['total']:.1f} s, wall {s['wall']:.1f} s | load (1/5 min) "
              f"{run['load']}", flush=True)

    def med(side: str, key: str) -> float:
        return statistics.median(summary(r)[key] for r in results[side])

    print(f"\nmedians over runs ({args.sites} hospitals, {args.rounds} rounds, bare "
          f"{'train only' if args.bare_train_only else 'train + evaluate'}):")
    for key in ("first", "median", "total", "wall"):
        b, f = med("bare", key), med("fedsplit", key)
        print(f"  {key:7s} bare {b:6.1f} s   fedsplit {f:6.1f} s   ratio {f / b:.2f}")
    print(f"  fedsplit first round / its median round: "
          f"{med('fedsplit', 'first') / med('fedsplit', 'median'):.2f}")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"raw: {work / 'results.json'}")


if __name__ == "__main__":
    main()

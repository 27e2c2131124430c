"""`fedsplit up` against bare Flower's deployment runtime as the model grows: round time and
memory per role (issue 43).

Both sides run Flower 1.42's deployment runtime on 127.0.0.1: a SuperLink (``--isolation
process``), a SuperExec running the ServerApp, one SuperNode per hospital (``--isolation
subprocess``: a ClientApp process per message). The hospitals are bench/scale.py's synthetic
tables (8 features); the model is the built-in MLP with ``--hidden`` (10000-10000: 100.1M
parameters). The bare side is bench/bare_flower_app.py (Flower's FedAvg, train and evaluate
every round, the same data loading, model and local steps as fedsplit's agent); the fedsplit
side is ``fedsplit up --site ... --hidden ...`` (set-up, the model check, one message per
hospital per round with its evaluation, the closing evaluation, history and models written).

Memory is each role's summed RSS, sampled every 0.25 s, at its peak (every sample of a run is
kept in its work folder as ``memory-timeline.json``): *superlink*; *serverapp* =
the SuperExec that runs the ServerApp and the ServerApp's process; *coordinator* = the two
together (the peak of their sum, not the sum of their peaks); *hospitals* = the
agents, SuperNodes and ClientApp processes. Each model size is run next to a tiny one (``--idle``
hidden widths, 8 by default) on the same side, so *above idle* is what the model itself costs
the coordinator; printed as a multiple of the model's float32 bytes.

    .venv/bin/python bench/scale_deploy.py --hidden 10000-10000 --rounds 3
    .venv/bin/python bench/scale_deploy.py --hidden 10000-10000 --rounds 3 --database
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from deploy_rounds import bare_federation  # noqa: E402
from fedsplit.orchestration.flower_runtime import (  # noqa: E402
    CONNECTION,
    flower_env,
    run_config_path,
    stage_app,
    tool,
)
from fedsplit.protocol.config import RunConfig  # noqa: E402
from scale import (  # noqa: E402
    FEATURES,
    PeakTree,
    bare_round_seconds,
    fedsplit_round_seconds,
    hospitals_data,
    mlp_model_id,
    mlp_parameters,
)

#: deployment roles by command line, first match wins (a hospital's processes name "clientapp"
#: or "site run"; the coordinator's SuperExec is `fedsplit superexec` or, bare, flower-superexec)
ROLES = (("hospitals", ("site run", "flower-supernode", "clientapp")),
         ("superlink", ("flower-superlink",)),
         ("serverapp", ("superexec", "flwr-serverapp")))
#: the coordinator: the SuperLink and the ServerApp's processes, summed as sampled together
COMBINED = {"coordinator": ("superlink", "serverapp")}


def widths(hidden: str) -> tuple[int, ...]:
    """``--hidden`` read as the run config reads it."""
    return RunConfig(hidden=hidden).hidden_widths


def run_bare(work: Path, files: list[tuple[str, Path, Path]], hidden: str, rounds: int,
             database: bool) -> list[float]:
    """The bare app on its own SuperLink, SuperExec and SuperNodes; its round seconds."""
    work.mkdir(parents=True)
    (work / "model-id.txt").write_text(mlp_model_id(widths(hidden)))
    cfg = RunConfig(num_server_rounds=rounds, min_nodes=len(files), seed=0,
                    out_dir=str(work / "out"), initial_weights=str(work / "model-id.txt"),
                    round_timeout=1800)
    app = stage_app(work / "app", cfg, components=("bare_flower_app:server",
                                                   "bare_flower_app:client"),
                    extra_modules=[BENCH / "bare_flower_app.py"])
    nodes = [(name, train) for name, train, _ in files]
    with bare_federation(work, nodes, env_of=flower_env,
                         database=work / "superlink.db" if database else None) as cli_env:
        done = subprocess.run([tool("flwr"), "run", str(app), CONNECTION, "--stream",
                               "--run-config", str(run_config_path(app))],
                              env=cli_env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"bare run failed ({done.returncode}): {done.stdout[-800:]}")
    return bare_round_seconds(work / "out" / "history.json")


def run_fedsplit(work: Path, files: list[tuple[str, Path, Path]], hidden: str,
                 rounds: int, database: bool) -> list[float]:
    """``fedsplit up`` over the same files; history.json's round seconds."""
    cmd = [str(Path(sys.executable).parent / "fedsplit"), "up", "--work", str(work), "--no-admin",
           "--rounds", str(rounds), "--hidden", hidden, "--seed", "0", "--round-timeout", "1800"]
    for name, train, _ in files:
        cmd += ["--site", f"{name}={train}"]
    if database:
        cmd += ["--superlink-database", str(work / "superlink.db")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"fedsplit up failed ({done.returncode}): "
                           f"{(done.stdout + done.stderr)[-1500:]}")
    return fedsplit_round_seconds(work / "out" / "history.json")


def measured(side: str, work: Path, files: list[tuple[str, Path, Path]], hidden: str,
             rounds: int, database: bool) -> dict:
    run = run_bare if side == "bare" else run_fedsplit
    load = os.getloadavg()[0]
    start = time.monotonic()
    with PeakTree(os.getpid(), skip_root=True, roles=ROLES, combined=COMBINED,
                  every=0.25) as peak:
        seconds = run(work, files, hidden, rounds, database)
    (work / "memory-timeline.json").write_text(json.dumps(peak.timeline))
    return {"side": side, "hidden": hidden, "rounds": seconds, "wall": time.monotonic() - start,
            "load": load, "peak_mib": peak.role_peak_mib, "tree_mib": peak.peak_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="10000-10000", help="the model's hidden widths")
    parser.add_argument("--idle", default="8", help="hidden widths of the tiny model beside it")
    parser.add_argument("--hospitals", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--sides", default="bare,fedsplit")
    parser.add_argument("--database", action="store_true",
                        help="both SuperLinks keep their state and messages in a SQLite file "
                             "(Flower's --database; fedsplit up --superlink-database)")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="scale-deploy-"))
    files = hospitals_data(work / "data", args.hospitals, args.rows, 0)
    params = mlp_parameters(widths(args.hidden))
    model_mib = params * 4 / 2**20
    print(f"model: MLP {FEATURES}-{args.hidden}-2, {params:,} parameters ({model_mib:.0f} MiB as "
          f"float32); {args.hospitals} hospitals, {args.rounds} rounds; SuperLink state "
          f"{'in SQLite' if args.database else 'in memory'}", flush=True)
    results = []
    for side in args.sides.split(","):
        for hidden in (args.idle, args.hidden):
            out = measured(side, work / f"{side}-{hidden}", files, hidden, args.rounds,
                           args.database)
            results.append(out)
            roles = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(out["peak_mib"].items()))
            print(f"{side:8s} hidden {hidden:12s}: rounds "
                  f"{', '.join(f'{s:.1f}' for s in out['rounds'])} s, wall {out['wall']:.1f} s, "
                  f"peak MiB {roles} (load {out['load']:.1f})", flush=True)
    print()
    by = {(r["side"], r["hidden"]): r for r in results}
    for side in args.sides.split(","):
        big, idle = by[(side, args.hidden)], by[(side, args.idle)]
        above = big["peak_mib"].get("coordinator", 0) - idle["peak_mib"].get("coordinator", 0)
        print(f"{side:8s}: coordinator {big['peak_mib'].get('coordinator', 0):,.0f} MiB, above "
              f"idle {above:,.0f} MiB = {above / model_mib:.1f}x the model; hospitals "
              f"{big['peak_mib'].get('hospitals', 0):,.0f} MiB "
              f"({big['peak_mib'].get('hospitals', 0) / args.hospitals:,.0f} per hospital); "
              f"median round {statistics.median(big['rounds']):.1f} s")
    if {"bare", "fedsplit"} <= set(args.sides.split(",")):
        b, f = by[("bare", args.hidden)], by[("fedsplit", args.hidden)]
        print(f"fedsplit / bare: median round "
              f"{statistics.median(f['rounds']) / statistics.median(b['rounds']):.2f}, "
              f"rounds total {sum(f['rounds']) / sum(b['rounds']):.2f}, wall "
              f"{f['wall'] / b['wall']:.2f}")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"raw: {work / 'results.json'}")


if __name__ == "__main__":
    main()

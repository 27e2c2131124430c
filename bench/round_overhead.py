"""Per-round time of fedsplit's coordinator vs a bare Flower FedAvg app, in one run.

Both run in Flower's simulation engine (a SuperLink in simulation mode, `flwr run`), on the
same hospitals' files, the same model, the same local training. Round 1 includes start-up
(and fedsplit's stats/init exchange), so the ratio is taken over rounds 2..R. Runs alternate
(bare, fedsplit, bare, fedsplit, ...) so machine load affects both alike.

    .venv/bin/python bench/round_overhead.py --dataset digits --rounds 8 --repeats 2

Target: fedsplit adds no more than 10% per round (ratio <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Run as a script, bench/ comes first on sys.path and bench/aggregation.py would shadow the
# aggregation package: put the repository root first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsplit.client.models import ModelSpec
from fedsplit.orchestration.experiment import Experiment, prepare_sites, write_site
from fedsplit.orchestration.flower_runtime import (
    flower_env,
    run_app,
    simulation_superlink,
    stage_app,
    write_connection,
)
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.horizontal import RunRecord

BENCH = Path(__file__).resolve().parent


def one_run(kind: str, cfg: RunConfig, sites: int, work: Path) -> list[float]:
    """Run one federation; return per-round seconds."""
    flwr_home = work / "flwr-home"
    env = flower_env(flwr_home)
    if kind == "bare":
        app = stage_app(work / "app", cfg, components=("bare_flower_app:server", "bare_flower_app:client"),
                        extra_modules=[BENCH / "bare_flower_app.py"])
    else:
        app = stage_app(work / "app", cfg)
    with simulation_superlink(work, env) as address:
        write_connection(flwr_home, address)
        history = RunRecord.from_json(run_app(
            app, env, work / "flower.log", Path(cfg.out_dir) / HISTORY_FILE,
            federation_config=f"num-supernodes={sites} client-resources-num-cpus=1"))
    return [r.seconds for r in history.rounds if r.seconds is not None]


def main() -> None:
    """Measure and print the per-round ratio."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="fedsplit-bench-") as tmp:
        root = Path(tmp)
        base = RunConfig(num_server_rounds=args.rounds, min_nodes=args.sites, data_dir=str(root / "sites"))
        site_data, _ = prepare_sites(Experiment(cfg=base, out=root, dataset=args.dataset,
                                                num_sites=args.sites))
        for i, site in enumerate(site_data):
            write_site(site, root / "sites" / f"site-{i}", base.target)
        first = site_data[0]
        model_id = ModelSpec(kind=first.kind, task=first.task, input_shape=tuple(first.x.shape[1:]),
                             num_outputs=int(max(s.y.max() for s in site_data)) + 1,
                             hidden=base.hidden_widths).to_id()
        (root / "model-id.txt").write_text(model_id)

        per_round: dict[str, list[float]] = {"bare": [], "fedsplit": []}
        wall: dict[str, list[float]] = {"bare": [], "fedsplit": []}
        for rep in range(args.repeats):
            for kind in ("bare", "fedsplit"):
                work = root / f"{kind}-{rep}"
                cfg = base.model_copy(update={
                    "out_dir": str(work / "out"),
                    "initial_weights": str(root / "model-id.txt") if kind == "bare" else "",
                })
                start = time.monotonic()
                seconds = one_run(kind, cfg, args.sites, work)
                wall[kind].append(time.monotonic() - start)
                per_round[kind].extend(seconds[1:])  # round 1 includes start-up
                print(f"{kind:9s} run {rep + 1}: rounds 2..{len(seconds)} "
                      f"mean {statistics.mean(seconds[1:]):.3f} s/round, wall {wall[kind][-1]:.1f} s")

    bare = statistics.mean(per_round["bare"])
    ours = statistics.mean(per_round["fedsplit"])
    print(json.dumps({
        "dataset": args.dataset, "sites": args.sites, "rounds": args.rounds, "repeats": args.repeats,
        "model_id": model_id,
        "bare_flower_s_per_round": round(bare, 4), "fedsplit_s_per_round": round(ours, 4),
        "ratio_fedsplit_over_bare": round(ours / bare, 3),
        "bare_wall_s": [round(w, 1) for w in wall["bare"]],
        "fedsplit_wall_s": [round(w, 1) for w in wall["fedsplit"]],
    }, indent=2))


if __name__ == "__main__":
    main()

"""FLamby's Fed-TCGA-BRCA protocol on fedsplit: 6 regions, Harrell's C-index per region.

    .venv/bin/python bench/flamby_tcga.py                    # exact federated Cox, penalizer 0.01
    .venv/bin/python bench/flamby_tcga.py --secure           # the same under secure aggregation
    .venv/bin/python bench/flamby_tcga.py --penalizer 0.1

The data: FLamby's Fed-TCGA-BRCA as fedsplit bundles it (`client/survival/tcga.py`): 1,088
patients in FLamby's 6 regions with FLamby's static split (866 training, 222 test patients).
The exact federated Cox model (``fedsplit cox``: Newton-Raphson on the regions' summed
gradients and Hessians, stratified by region, lifelines' penalizer convention) is fitted to the
training rows in Flower's simulation engine; its linear predictor is then scored as FLamby
scores (``lifelines.utils.concordance_index(T, -risk, E)``) on each region's test patients:
their mean over regions (FLamby's number) and the pooled test patients (in brackets). The same
model fitted by lifelines to the pooled training rows (``CoxPHFitter(strata=[region],
penalizer=P)``) is printed beside it (the two must agree), and FLamby's published table.

The fit is deterministic: FLamby's 5 seeds change nothing here (they seed its SGD training).

``--strategies fedavg,fedadam,fedyogi`` also runs FLamby's linear Cox model through
``fedsplit simulate --dataset tcga-brca --hidden none`` (task survival: the Cox recipe,
``client/survival/recipe.py``), each region a hospital with FLamby's test patients, scored as
FLamby scores. Which path runs (docs/survival.md, `protocol.survival_exact`):

- ``fedavg``: the exact federated Newton fit (the recipe's ``solver=auto`` under plain FedAvg),
  which no seed changes: run once (seed 0), printed as such;
- ``fedavg-sgd`` (``solver=sgd``), ``fedadam``, ``fedyogi``, ``fedadagrad``: rounds of local
  steps (torchsurv's Cox loss, Adam locally; each step on the region's whole training rows, the
  full risk sets: `client.train.step_batch_size`), one run per seed (``--seeds``, FLamby: 5),
  the last round's model (``--keep last``, FLamby's protocol). FedAdam and FedYogi are FedAvg
  with a server optimizer on the pseudo-gradient (``--server-lr``).

    .venv/bin/python bench/flamby_tcga.py --strategies fedavg,fedadam --seeds 5 --rounds 10

The recipe's ridge penalty is the exact fit's (``--penalizer``, lifelines' convention) unless
``--recipe-penalizer`` says otherwise (0: FLamby's unpenalized model).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from fedsplit.client.survival.tcga import DATASET, EVENT, ID, REGIONS, TIME, load_tcga_brca  # noqa: E402
from fedsplit.orchestration.datasets import table_keys  # noqa: E402
from fedsplit.orchestration.experiment import Experiment, run_experiment  # noqa: E402
from fedsplit.orchestration.survival.run import run_survival  # noqa: E402
from fedsplit.protocol.config import RunConfig  # noqa: E402
from fedsplit.protocol.record.common import HISTORY_FILE  # noqa: E402
from fedsplit.protocol.record.horizontal import RunRecord  # noqa: E402
from fedsplit.protocol.record.survival import CoxDocument  # noqa: E402
from fedsplit.protocol.survival import SurvivalRun  # noqa: E402
from fedsplit.protocol.tasks import SURVIVAL  # noqa: E402
from lifelines import CoxPHFitter  # noqa: E402
from lifelines.utils import concordance_index  # noqa: E402

#: FLamby's published results (SOURCE.md): mean per-region C-index over 5 seeds (pooled test)
FLAMBY = [("FedAdam", 0.815, 0.842), ("FedYogi", 0.815, 0.842), ("FedAdagrad", 0.813, 0.834),
          ("FedAvg", 0.732, 0.735), ("FedProx", 0.729, 0.717), ("Scaffold", 0.687, 0.699),
          ("Cyclic", 0.658, 0.661), ("pooled training", 0.676, 0.704)]
FLAMBY_ALONE = dict(zip(REGIONS, (0.728, 0.750, 0.498, 0.656, 0.712, 0.691), strict=True))


def scores(coef: pd.Series, data: dict) -> tuple[dict[str, float], float]:
    """Per-region test C-index and the pooled test C-index of the linear predictor x'coef."""
    per_region, pooled = {}, []
    for region, (_, test) in data.items():
        x = test[list(coef.index)].astype(float).values
        t, e = test[TIME].astype(float).values, test[EVENT].astype(float).values
        risk = x @ coef.values
        per_region[region] = concordance_index(t, -risk, e)
        pooled.append((t, e, risk))
    t, e, risk = (np.concatenate(parts) for parts in zip(*pooled, strict=True))
    return per_region, concordance_index(t, -risk, e)


SERVER_OPT = {"fedavg": "none", "fedavg-sgd": "none", "fedadam": "adam", "fedyogi": "yogi",
              "fedadagrad": "adagrad"}
#: the strategies fitted by the exact Newton path: deterministic, so one seed
EXACT = ("fedavg",)


def federated_runs(args: argparse.Namespace, out: Path) -> dict[str, list[dict]]:
    """The linear Cox model trained by ``fedsplit simulate --dataset tcga-brca``'s experiment
    (task survival: the Cox recipe), per strategy and seed."""
    runs: dict[str, list[dict]] = {}
    for strategy in [s for s in args.strategies.split(",") if s]:
        if strategy not in SERVER_OPT:
            raise SystemExit(f"--strategies: one of {sorted(SERVER_OPT)}. Received: {strategy!r}")
        for seed in range(1 if strategy in EXACT else args.seeds):
            keys = table_keys(DATASET, hidden="none", penalizer=args.recipe_penalizer)
            if strategy == "fedavg-sgd":  # the recipe's solver=sgd: local steps under FedAvg
                keys = {**keys, "recipe": SURVIVAL.recipe, "recipe_params": json.dumps(
                    {"hidden": [], "penalizer": args.recipe_penalizer, "solver": "sgd"})}
            cfg = RunConfig(**keys, seed=seed, resume=False,
                            num_server_rounds=args.rounds, lr=args.lr, keep="last",
                            server_opt=SERVER_OPT[strategy],
                            server_lr=args.server_lr if SERVER_OPT[strategy] != "none" else 0.0)
            began = time.monotonic()
            summary = run_experiment(Experiment(
                cfg=cfg, out=out / strategy / f"seed-{seed}", dataset=DATASET))
            fed = summary.federated
            assert fed is not None
            history = RunRecord.load(out / strategy / f"seed-{seed}" / "federation" / HISTORY_FILE)
            exact = any(r.aggregation is not None and r.aggregation.strategy == "newton-cox"
                        for r in history.rounds)
            runs.setdefault(strategy, []).append({
                "seed": seed, "seconds": time.monotonic() - began,
                "path": f"exact Newton, {len(history.rounds)} rounds" if exact else
                f"local steps, {len(history.rounds)} rounds",
                "per_site": {k: v["c_index"] for k, v in fed.per_site.items()},
                "mean": fed.mean_per_site["c_index"], "pooled": fed.metrics["c_index"]})
            print(f"  {strategy} seed {seed}: mean per region {runs[strategy][-1]['mean']:.3f}, "
                  f"pooled {runs[strategy][-1]['pooled']:.3f} "
                  f"({runs[strategy][-1]['path']}; {runs[strategy][-1]['seconds']:.0f} s)",
                  flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--penalizer", type=float, default=0.01)
    parser.add_argument("--secure", action="store_true", help="secure aggregation on")
    parser.add_argument("--out", type=Path, default=None, help="keep the run here")
    parser.add_argument("--strategies", default="", help="also train the linear Cox model by "
                        "simulate: fedavg,fedadam,fedyogi,fedadagrad")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per strategy")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01, help="local Adam learning rate")
    parser.add_argument("--server-lr", type=float, default=0.03, help="FedAdam/FedYogi server lr")
    parser.add_argument("--recipe-penalizer", type=float, default=None,
                        help="the recipe's ridge penalty (lifelines' convention; default: "
                             "--penalizer, the exact fit's)")
    args = parser.parse_args()
    if args.recipe_penalizer is None:
        args.recipe_penalizer = args.penalizer
    data = load_tcga_brca()
    out = args.out or Path(tempfile.mkdtemp(prefix="flamby-tcga-"))
    run = SurvivalRun(mode="cox", time=TIME, event=EVENT, out_dir="", id_column=ID,
                      penalizer=args.penalizer, secure_aggregation="on" if args.secure else "")
    started = time.monotonic()
    doc = run_survival(run, CoxDocument, dataset="tcga-brca", site_files=[], out=out)
    seconds = time.monotonic() - started
    names = list(doc.covariates)
    fed = pd.Series([doc.covariates[n].coef for n in names], index=names)

    pooled = pd.concat([train[[*names, TIME, EVENT]].astype(float).assign(region=k)
                        for k, (train, _) in enumerate(data.values())], ignore_index=True)
    t0 = time.monotonic()
    ref = CoxPHFitter(penalizer=args.penalizer).fit(pooled, TIME, EVENT, strata=["region"])
    ref_seconds = time.monotonic() - t0
    tight = CoxPHFitter(penalizer=args.penalizer).fit(
        pooled, TIME, EVENT, strata=["region"],
        fit_options={"precision": 1e-12, "r_precision": 1e-14})
    se = pd.Series([doc.covariates[n].se for n in names], index=names)

    fed_runs = federated_runs(args, out) if args.strategies else {}
    fed_regions, fed_pooled = scores(fed, data)
    ref_regions, ref_pooled = scores(ref.params_[names], data)
    print(f"Fed-TCGA-BRCA, FLamby's split: {doc.rows} training patients ({doc.events} "
          f"events) in {len(REGIONS)} regions; penalizer {args.penalizer}, secure aggregation "
          f"{doc.secure_aggregation}")
    print(f"exact federated Cox: {doc.newton_rounds} Newton rounds, {doc.secure_sums} "
          f"summed vectors, {seconds:.1f} s end to end (Flower simulation, {doc.seconds:.1f} s "
          f"inside the coordinator); lifelines on the pooled rows {ref_seconds:.2f} s")
    for label, model in (("lifelines defaults", ref), ("lifelines to its maximum", tight)):
        rel_c = float(np.max(np.abs(fed / model.params_[names] - 1)))
        rel_se = float(np.max(np.abs(se / model.standard_errors_[names] - 1)))
        print(f"  vs {label}: max relative difference coef {rel_c:.2e}, SE {rel_se:.2e}")
    print()
    header = f"{'model':<34}" + "".join(f"{r[:9]:>10}" for r in REGIONS) + f"{'mean':>8}{'pooled':>8}"
    print(header)
    print("-" * len(header))

    def row(label: str, regions: dict[str, float] | None, mean: float, pool: float | None) -> None:
        cells = "".join(f"{regions[r]:>10.3f}" for r in REGIONS) if regions else " " * 60
        print(f"{label:<34}{cells}{mean:>8.3f}" + (f"{pool:>8.3f}" if pool is not None else ""))

    row("fedsplit exact federated Cox", fed_regions, float(np.mean(list(fed_regions.values()))),
        fed_pooled)
    row("lifelines pooled, stratified", ref_regions, float(np.mean(list(ref_regions.values()))),
        ref_pooled)
    for strategy, results in fed_runs.items():
        means = [r["mean"] for r in results]
        per_region = {k: float(np.mean([r["per_site"][k] for r in results])) for k in REGIONS}
        row(f"fedsplit {strategy} ({len(results)} seed{'s' if len(results) > 1 else ''})",
            per_region, float(np.mean(means)), float(np.mean([r["pooled"] for r in results])))
        print(f"{'':<34}path: {results[0]['path']}; ratio of the mean to the exact federated "
              f"Cox measured above: {float(np.mean(means)) / float(np.mean(list(fed_regions.values()))):.4f}")
        print(f"{'':<34}spread over seeds (max - min of the mean): {max(means) - min(means):.3f}")
    for name, mean, pool in FLAMBY:
        row(f"FLamby {name} (5 seeds)", None, mean, pool)
    row("FLamby each region alone", FLAMBY_ALONE, float(np.mean(list(FLAMBY_ALONE.values()))),
        None)
    print(f"\nrun kept in {out}")


if __name__ == "__main__":
    main()

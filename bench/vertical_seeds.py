"""Fused vs each site alone vs centralized over several seeds (split and initial weights).

Every model, fused and baselines (each site alone, centralized: the federation's steps), keeps
the round that scores best on the same validation rows cut from the label holder's training
rows (``orchestration.vertical.local.train_kept``, the rule ``fedsplit vertical simulate``
follows); each row also shows the rounds they kept and the fused and centralized models after
the last round.

In-process runs of the same coordinator and site code `fedsplit vertical simulate` runs in Flower
(same numbers for the same seed). One held-out split of a few hundred rows moves by a row's worth
(0.5-1 point) from seed to seed, so the mean over seeds is the comparison to read.

    .venv/bin/python -m bench.vertical_seeds --titanic ../shared/data/titanic/train.csv --seeds 5
    .venv/bin/python -m bench.vertical_seeds --dataset digits --sites 2 --embedding-dim 32
    .venv/bin/python -m bench.vertical_seeds --dataset diabetes --sites 2     # regression: r2
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    """Print one JSON line per seed and one with the means."""
    import torch
    from fedsplit.orchestration.vertical.datasets import write_bundled, write_titanic
    from fedsplit.orchestration.vertical.local import baselines, train_kept
    from fedsplit.protocol.selection import selection_metric
    from fedsplit.protocol.vertical.config import FusionParams
    from fedsplit.server.vertical.coordinator import read_label_file

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--titanic", type=Path, help="Kaggle Titanic train.csv (seed lecture's groups)")
    ap.add_argument("--dataset", help="breast-cancer, digits or diabetes")
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--overlap", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--embedding-dim", type=int, default=16)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            files = (write_titanic(args.titanic, Path(tmp) / "t") if args.titanic else
                     write_bundled(args.dataset, args.sites, Path(tmp) / f"d{seed}", overlap=args.overlap,
                                   seed=seed))
            labels = read_label_file(str(files.labels), files.id_column, files.target, None)
            params = FusionParams(embedding_dim=args.embedding_dim)
            fused = train_kept(labels, files.sites, files.id_column, params, args.rounds, seed=seed)
            base = baselines(labels, files.sites, files.id_column, params, args.rounds, seed=seed)
            key = selection_metric(labels.task)
            central = base.centralized
            row = {"seed": seed, "metric": key, "fused": fused.metrics[key],
                   "centralized": central.metrics[key],
                   "alone": [s.metrics[key] for s in base.local_only],
                   "rounds_kept": {"fused": fused.rounds_kept,
                                   "centralized": central.rounds_kept,
                                   "alone": [s.rounds_kept for s in base.local_only]},
                   "fused_last_round": (fused.final_metrics or {})[key],
                   "centralized_last_round": (central.final_metrics or {})[key]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    mean = {k: float(np.mean([r[k] for r in rows]))
            for k in ("fused", "centralized", "fused_last_round", "centralized_last_round")}
    mean["alone"] = [float(v) for v in np.mean([r["alone"] for r in rows], axis=0)]
    print(json.dumps({"mean_over_seeds": args.seeds, **mean}))


if __name__ == "__main__":
    main()

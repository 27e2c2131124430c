"""Samples per second of each in-site parallel mode against ``none``, in one run.

Trains the same model from the same start on the same batches in every mode and prints, per
mode, the training-loop throughput (samples / s, process start-up excluded), the whole call's
wall time (start-up included), the ratio to ``none``, and the largest weight difference from
``none`` (the modes must agree: that is the correctness check).

On a 2-core CPU box the parallel modes cannot be faster: the "devices" are the same two cores
(shared with everything else), and gloo adds an all-reduce per step (data) or a send/recv per
micro-batch and stage (pipeline). Only correctness is expected there. On a multi-GPU site pass
``--devices cuda`` to give replica/stage i the GPU cuda:i.

    OMP_NUM_THREADS=1 .venv/bin/python bench/site_parallel.py --dataset digits --epochs 3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from fedsplit.client.data import load_bundled
from fedsplit.client.models import ModelSpec, build_model
from fedsplit.client.parallel import ParallelFit, fit_parallel
from fedsplit.client.train import set_statistics
from rich.console import Console
from rich.table import Table


def main() -> None:
    """Run every mode once and print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits", choices=["digits", "breast-cancer", "wine"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--devices", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: every stage/replica on the CPU; cuda: stage/replica i on cuda:i")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode; the fastest is kept")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = load_bundled(args.dataset)
    spec = ModelSpec(data.kind, data.task, tuple(data.x.shape[1:]), data.num_classes)
    start = build_model(spec, seed=0)
    flat = data.x.reshape(len(data.x), -1) if data.kind == "mlp" else data.x.reshape(-1, 1)
    set_statistics(start, flat.mean(0), flat.std(0))
    state = {k: v.clone() for k, v in start.state_dict().items()}

    n, s = args.replicas, args.stages
    place = (lambda k: f",devices={'+'.join(['cpu'] * k)}") if args.devices == "cpu" else (lambda k: "")
    modes = [
        "none",
        f"data:replicas={n}" + place(n),
        f"model:stages={s}" + place(s),
        f"pipeline:stages={s},microbatches={args.microbatches}" + place(s),
    ]
    results: list[tuple[str, ParallelFit, float]] = []
    reference: dict[str, torch.Tensor] | None = None
    fit_parallel(build_model(spec), data.x, data.y, epochs=1, lr=args.lr,  # warm-up, not timed
                 batch_size=args.batch_size, seed=0)
    for mode in modes:
        best: ParallelFit | None = None
        for _ in range(max(1, args.repeats)):
            model = build_model(spec)
            model.load_state_dict(state)
            result = fit_parallel(model, data.x, data.y, epochs=args.epochs, lr=args.lr,
                                  batch_size=args.batch_size, seed=0, parallel=mode,
                                  device=torch.device("cuda" if args.devices == "cuda" else "cpu"))
            if best is None or result.samples_per_second > best.samples_per_second:
                best = result
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        reference = reference or weights
        diff = max(float((weights[k] - reference[k]).abs().max()) for k in weights)
        results.append((mode, best, diff))

    base = results[0][1].samples_per_second
    table = Table(title=f"{args.dataset} ({spec.to_id()}), {len(data.x)} rows x {args.epochs} epochs, "
                        f"batch {args.batch_size}, best of {args.repeats}, torch {torch.__version__}, "
                        f"{os.cpu_count()} CPU(s)")
    for col in ("mode", "device map", "samples/s", "x none", "loop s", "call s", "loss",
                "max |w - w_none|"):
        table.add_column(col, justify="left" if col in ("mode", "device map") else "right")
    for mode, res, diff in results:
        cfg = res.config.split("map=")[1].split(",")[0] if "map=" in res.config else "-"
        table.add_row(mode.split(",devices")[0], cfg, f"{res.samples_per_second:,.0f}",
                      f"{res.samples_per_second / base:.2f}", f"{res.train_seconds:.2f}",
                      f"{res.total_seconds:.2f}", f"{res.loss:.5f}", f"{diff:.1e}")
    Console(width=150).print(table)
    print("ratios = samples/s of the mode / samples/s of none (training loop only; 'call s' adds "
          "process start-up). On a 2-core CPU only correctness is expected: the modes share the "
          "same cores and pay gloo communication per step.")
    worst = max(d for _, _, d in results)
    print(f"largest weight difference from none: {worst:.1e} "
          f"({'OK' if worst < 1e-3 else 'MODES DISAGREE'}; float summation order and Adam)")
    if worst >= 1e-3:
        raise SystemExit(1)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()

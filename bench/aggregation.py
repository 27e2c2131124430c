"""Aggregation benchmark: fedsplit's strategies vs Flower's reference functions, one run.

For each rule it times ours and ``flwr.server.strategy.aggregate``'s (none for
geometric-median) on the same N in-memory updates of a ResNet-18-shaped model, and prints
time, throughput (input GB/s), peak extra memory (tracemalloc: numpy reports its buffers) and
the ratios. FedAvg is also compared with
the machine's memory read bandwidth: the fastest of several read-only passes (numpy's sum,
BLAS's dot, torch's sum; one thread and one per core) over the same updates. ``--files`` adds
the whole-process comparison (`bench/aggregation_process.py`): the same updates written as
weight files, ``fedsplit aggregate`` over them as a subprocess vs a subprocess that reads them
with h5py and runs Flower's function, plus start-up (imports) and HDF5 block-read rate vs a
plain read of the same bytes. The backends in use are printed (``FEDSPLIT_AGG_BACKEND``).

Quick default (about 15 s on 2 cores)::

    .venv/bin/python bench/aggregation.py

The issue's sizes (N=50 x 11.7M parameters; several GB of RAM, about 6 minutes, most of it Flower)::

    .venv/bin/python bench/aggregation.py --n 50 --params 11.7M
    .venv/bin/python bench/aggregation.py --n 100 --params 11.7M --no-flower   # budget held
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.protocol import Update, write_weights

from fedsplit import aggregation

RESNET18_PARAMS = 11_689_512


def resnet18_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """ResNet-18's parameter shapes (conv, batch-norm, fc) with channel widths times ``scale``."""

    def c(ch: int) -> int:
        return max(1, round(ch * scale))

    shapes: list[tuple[int, ...]] = [(c(64), 3, 7, 7), (c(64),), (c(64),)]
    cin = 64
    for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        for block in range(2):
            first_in = cin if block == 0 else cout
            shapes += [(c(cout), c(first_in), 3, 3), (c(cout),), (c(cout),)]
            shapes += [(c(cout), c(cout), 3, 3), (c(cout),), (c(cout),)]
            if block == 0 and (stride != 1 or cin != cout):
                shapes += [(c(cout), c(cin), 1, 1), (c(cout),), (c(cout),)]
        cin = cout
    shapes += [(1000, c(512)), (1000,)]
    return shapes


def shapes_for(params: int) -> list[tuple[int, ...]]:
    """ResNet-18 layout scaled so the model has about ``params`` parameters."""
    scale = math.sqrt(params / RESNET18_PARAMS)
    for _ in range(30):
        total = sum(math.prod(s) for s in resnet18_shapes(scale))
        if abs(total - params) / params < 0.01:
            break
        scale *= math.sqrt(params / total)
    return resnet18_shapes(scale)


def make_updates(n: int, shapes: list[tuple[int, ...]], seed: int = 0) -> list[Update]:
    """n float32 updates: a shared model plus a small, different perturbation each."""
    rng = np.random.default_rng(seed)
    size = sum(math.prod(s) for s in shapes)
    base = rng.standard_normal(size, dtype=np.float32)
    pool = rng.standard_normal(size + 1009 * n, dtype=np.float32)
    updates = []
    for k in range(n):
        flat = base + 0.05 * pool[1009 * k : 1009 * k + size]
        arrays, pos = {}, 0
        for i, s in enumerate(shapes):
            m = math.prod(s)
            arrays[f"layer{i}"] = flat[pos : pos + m].reshape(s)
            pos += m
        updates.append(Update(arrays=arrays, num_examples=int(rng.integers(100, 1000)),
                              site=f"site{k}"))
    return updates


def measure(fn: Callable[[], Any], repeat: int, trace: bool = True) -> tuple[float, int, Any]:
    """Best wall time over ``repeat`` untraced runs, and the peak memory of one traced run.

    tracemalloc hooks every allocation, which slows Python-level loops far more than numpy
    calls, so no timed run is traced: the traced run (skipped with ``trace=False``, peak 0)
    comes first and only measures memory.
    """
    peak, out = 0, None
    if trace:
        gc.collect()
        tracemalloc.start()
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    best = math.inf
    for _ in range(repeat):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, peak, out


def _read_kernels() -> dict[str, Callable[[np.ndarray], Any]]:
    """Read-only passes over a float32 array: numpy's sum, BLAS's dot, and torch's sum."""
    ones: dict[int, np.ndarray] = {}

    def blas_dot(a: np.ndarray) -> Any:
        flat = a.reshape(-1)
        if flat.size not in ones:
            ones[flat.size] = np.ones(flat.size, dtype=flat.dtype)
        return np.dot(flat, ones[flat.size])

    kernels: dict[str, Callable[[np.ndarray], Any]] = {
        "numpy sum": lambda a: np.add.reduce(a, axis=None),
        "BLAS dot": blas_dot,
    }
    try:
        import torch

        torch.set_num_threads(1)
        kernels["torch sum"] = lambda a: torch.from_numpy(a).sum()
    except ImportError:  # pragma: no cover - torch is a fedsplit dependency
        pass
    return kernels


def read_bandwidth(updates: list[Update]) -> tuple[float, str]:
    """The machine's memory read bandwidth over the updates' arrays, and how it was reached.

    Every read kernel of `_read_kernels` runs on one thread and on one thread per core (each
    reading its share of the arrays); the fastest of all (best of 3 runs) is the reference, so
    the FedAvg ratio is against the best read speed we could find, not a slow one.
    """
    from concurrent.futures import ThreadPoolExecutor

    arrays = [a for u in updates for a in u.arrays.values()]
    nbytes = sum(a.nbytes for a in arrays)
    cores = os.cpu_count() or 1
    best, how = 0.0, ""
    for name, kernel in _read_kernels().items():
        for threads in sorted({1, cores}):
            parts = [arrays[j::threads] for j in range(threads)]

            def read(part: list[np.ndarray], kernel: Callable[[np.ndarray], Any] = kernel) -> None:
                for a in part:
                    kernel(a)

            with ThreadPoolExecutor(threads) as pool:
                for _ in range(3):
                    t0 = time.perf_counter()
                    list(pool.map(read, parts))
                    speed = nbytes / (time.perf_counter() - t0)
                    if speed > best:
                        best, how = speed, f"{name}, {threads} thread(s)"
    return best, how


def flower_functions(n: int, f: int, m: int, beta: float) -> dict[str, Callable[[list], Any]]:
    """Flower's reference function for each rule (legacy ``aggregate`` module)."""
    from flwr.server.strategy.aggregate import (
        aggregate,
        aggregate_krum,
        aggregate_median,
        aggregate_trimmed_avg,
    )

    return {
        "fedavg": aggregate,
        "median": aggregate_median,
        "trimmed-mean": lambda r: aggregate_trimmed_avg(r, beta),
        "krum": lambda r: aggregate_krum(r, f, 0),
        "multi-krum": lambda r: aggregate_krum(r, f, m),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table; optionally save JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20, help="number of updates (default 20)")
    p.add_argument("--params", default="1M",
                   help="model size, e.g. 1M or 11.7M (ResNet-18 layout scaled; default 1M)")
    p.add_argument("--strategies",
                   default="fedavg,median,trimmed-mean,krum,multi-krum,geometric-median")
    p.add_argument("--beta", type=float, default=0.2, help="trimmed-mean beta (default 0.2)")
    p.add_argument("--f", type=int, default=2, help="Krum's f (default 2)")
    p.add_argument("--memory-budget", default="512MB", help="our working-memory budget")
    p.add_argument("--repeat", type=int, default=2, help="runs of ours; best time kept")
    p.add_argument("--no-flower", action="store_true", help="skip Flower's reference functions")
    p.add_argument("--files", action="store_true",
                   help="also compare whole processes over weight files: `fedsplit aggregate` "
                        "vs Flower + h5py (bench/aggregation_process.py)")
    p.add_argument("--files-only", action="store_true",
                   help="only the whole-process comparison (skips the in-memory table)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    from fedsplit.cli.aggregate import parse_bytes

    budget = parse_bytes(args.memory_budget) if args.memory_budget else DEFAULT_MEMORY_BUDGET
    params = int(float(args.params.rstrip("Mm")) * 1e6) if args.params[-1] in "Mm" else int(
        args.params)
    shapes = shapes_for(params)
    n = args.n
    m = n - args.f
    updates = make_updates(n, shapes)
    size = sum(math.prod(s) for s in shapes)
    input_bytes = n * size * 4
    bw, bw_how = read_bandwidth(updates)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"numpy {np.__version__}; N={n} updates x {size / 1e6:.2f}M float32 parameters "
          f"({input_bytes / 1e9:.2f} GB in); memory read bandwidth {bw / 1e9:.1f} GB/s "
          f"({bw_how}); "
          f"our budget {budget / 2**20:.0f} MiB; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    params_of = {"trimmed-mean": {"beta": args.beta}, "krum": {"f": args.f},
                 "multi-krum": {"f": args.f, "m": m}}
    flower = {} if args.no_flower else flower_functions(n, args.f, m, args.beta)
    results: dict[str, Any] = {
        "n": n, "params": size, "input_bytes": input_bytes, "read_bandwidth": bw,
        "read_bandwidth_kernel": bw_how,
        "memory_budget": budget, "cpu_count": os.cpu_count(), "rules": {},
    }
    header = (f"{'rule':<17}{'ours s':>9}{'GB/s':>7}{'peak MB':>9}{'e2e s':>8}"
              f"{'flower s':>10}{'peak MB':>9}{'speedup':>9}{'mem ratio':>10}")
    print(header, flush=True)
    from dataclasses import replace

    from fedsplit.aggregation import _compiled

    settings = aggregation.BackendSettings.from_environ(os.environ)  # once, as a command does
    stacked = settings.select("trimmed_mean", 1 << 30)
    streamed = settings.select("weighted_sum", 1 << 30)
    c_kernels = _compiled.c_kernels() if streamed.name == "compiled" else None
    numba_kernels = _compiled.numba_kernels() if stacked.name == "compiled" else None
    print(f"# backends (FEDSPLIT_AGG_BACKEND={settings.mode}): stacked passes "
          f"{'numba ' + numba_kernels.numba.__version__ if numba_kernels else stacked.name}, "
          f"streamed passes {'C (cffi, ' + c_kernels.path.name + ')' if c_kernels else streamed.name}"
          f", threads: {settings.threads}", flush=True)
    if numba_kernels is not None:  # compile (or load from the cache) outside the timed runs
        small = make_updates(max(5, 2 * args.f + 3), shapes_for(20_000), seed=1)
        for name in args.strategies.split(","):
            warm = params_of.get(name, {}) if name != "multi-krum" else {"f": args.f}
            aggregation.aggregate_updates(aggregation.get_strategy(name, warm), small,  # under
                                          settings=replace(settings, mode="compiled"))  # auto's cut
    rules = [] if args.files_only else args.strategies.split(",")
    for name in rules:
        strat = aggregation.get_strategy(name, params_of.get(name, {}))
        t_ours, peak_ours, res = measure(
            lambda s=strat: s.aggregate(updates, memory_budget=budget, settings=settings),
            args.repeat)
        t_e2e, _, res_e2e = measure(
            lambda s=strat: aggregation.aggregate_updates(s, updates, memory_budget=budget,
                                                          settings=settings), 1, trace=False)
        row: dict[str, Any] = {
            "ours_s": t_ours, "ours_peak_bytes": peak_ours, "ours_gbps": input_bytes / t_ours / 1e9,
            "end_to_end_s": t_e2e, "working_bytes": res.report.working_bytes,
            "details": res.report.details,
        }
        del res_e2e
        line = (f"{name:<17}{t_ours:>9.2f}{input_bytes / t_ours / 1e9:>7.2f}"
                f"{peak_ours / 2**20:>9.0f}{t_e2e:>8.2f}")
        if name in flower:
            pairs = [(list(u.arrays.values()), u.num_examples) for u in updates]
            t_fl, peak_fl, ref = measure(lambda fn=flower[name], pr=pairs: fn(pr), 1)
            diff = max(float(np.max(np.abs(np.asarray(r, np.float64) - res.arrays[k])))
                       for r, k in zip(ref, res.arrays, strict=True))
            del ref, pairs
            row.update(flower_s=t_fl, flower_peak_bytes=peak_fl, speedup=t_fl / t_ours,
                       memory_ratio=peak_fl / max(peak_ours, 1), max_abs_diff=diff)
            line += (f"{t_fl:>10.2f}{peak_fl / 2**20:>9.0f}{t_fl / t_ours:>8.1f}x"
                     f"{peak_fl / max(peak_ours, 1):>9.1f}x  (max |ours-flower| {diff:.1e})")
        if "iterations" in res.report.details:  # geometric-median: no Flower reference
            line += f"  ({res.report.details['iterations']} Weiszfeld iterations)"
        if name == "fedavg":
            row["fraction_of_read_bandwidth"] = input_bytes / t_ours / bw
            line += f"  [{100 * input_bytes / t_ours / bw:.0f}% of read bandwidth]"
        row["load_average"] = os.getloadavg()[0]
        line += f"  load {row['load_average']:.1f}"
        del res
        results["rules"][name] = row
        print(line, flush=True)
    if rules:
        print("ours s: strategy only (best of --repeat); e2e s: aggregate_updates = guard + "
              "strategy + per-site report; peak MB: extra memory during the call, output "
              "included.", flush=True)
    if args.files or args.files_only:
        from aggregation_process import report

        with tempfile.TemporaryDirectory() as tmp:
            paths = [write_weights(u, Path(tmp) / f"{u.site}.h5") for u in updates]
            del updates
            gc.collect()
            whole = [r for r in args.strategies.split(",") if r != "geometric-median"]
            results["files"] = report(paths, whole, flower=not args.no_flower)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole-process aggregation bench: ``fedsplit aggregate`` over weight files vs Flower + h5py.

Used by ``bench/aggregation.py --files`` (and runnable alone). For each rule, in the same run
and on the same files (page cache warm: every file is read once first):

- ours: ``fedsplit aggregate FILES -o OUT --strategy RULE`` as a subprocess (interpreter
  start-up, imports, input checks, the rule, writing the model and the report);
- Flower: a subprocess that imports Flower, reads every file with h5py into numpy arrays, runs
  Flower's reference function and writes the result with h5py.

fedsplit's packages are compiled to bytecode first, as an install has them, and the streamed
passes' C kernels built, as ``make setup`` does (`compile_bytecode`).
It also measures start-up (the interpreter alone, ``import fedsplit.cli.app``,
``import fedsplit.cli.aggregate``, the whole ``fedsplit aggregate --help`` process and which heavy
packages it imported, and the compiled kernels' start) and the read rate of block-wise reads
(`aggregation._blocks`'s reader,
as a stack fill reads: positional reads at each value's offset in the file, and through HDF5
calls with ``FEDSPLIT_MMAP=0``) against a plain sequential ``read()`` of the same bytes. (The
streamed passes' C kernels issue the same positional reads themselves; the stacked kernels read
the memory-mapped pages in place.)

    .venv/bin/python bench/aggregation_process.py --n 30 --params 10M
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLOWER_SCRIPT = """
import sys, h5py, numpy as np
from flwr.server.strategy.aggregate import (aggregate, aggregate_krum, aggregate_median,
                                            aggregate_trimmed_avg)
rule, out, *paths = sys.argv[1:]
results = []
for p in paths:
    with h5py.File(p, "r") as f:
        names = [n.decode() if isinstance(n, bytes) else n for n in f["arrays"].attrs["order"]]
        results.append(([f["arrays"][n][()] for n in names], int(f.attrs["num_examples"])))
fn = {"fedavg": aggregate, "median": aggregate_median,
      "trimmed-mean": lambda r: aggregate_trimmed_avg(r, 0.2),
      "krum": lambda r: aggregate_krum(r, 2, 0),
      "multi-krum": lambda r: aggregate_krum(r, 2, len(r) - 2)}[rule]
agg = fn(results)
with h5py.File(out, "w") as f:
    for n, a in zip(names, agg):
        f.create_dataset(n, data=a)
"""

RULE_ARGS = {
    "fedavg": [],
    "median": [],
    "trimmed-mean": ["--param", "beta=0.2"],
    "krum": ["--param", "f=2"],
    "multi-krum": ["--param", "f=2", "--param", "m={m}"],
}


def _timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    return _run(cmd, env)[0]


def _run(cmd: list[str], env: dict[str, str] | None = None,
         cwd: Path = ROOT) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, all threads) of the subprocess ``cmd``, run
    in ``cwd`` (first on its ``sys.path``: the checkout whose fedsplit ``python -c`` imports)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} in {cwd} failed ({done.returncode}): {done.stderr[-1500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def _best(cmd: list[str], env: dict[str, str], repeat: int) -> tuple[float, float]:
    """Best wall time and best CPU time over ``repeat`` runs."""
    runs = [_run(cmd, env) for _ in range(repeat)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


KERNEL_START = """
import time, numpy as np
from fedsplit.aggregation import _compiled
wall, cpu = time.perf_counter(), time.process_time()
kernels = _compiled.numba_kernels()
x = np.ones((2, 8), np.float32)
kernels.center_columns(x, 0, 8)
print(time.perf_counter() - wall, time.process_time() - cpu)
"""

HEAVY = ("torch", "flwr", "pandas", "fastapi", "sklearn", "numba")


def startup() -> dict[str, Any]:
    """Best of 3 each: the interpreter alone, ``import fedsplit.cli.app``,
    ``import fedsplit.cli.aggregate``, the whole ``fedsplit aggregate --help`` process (what every
    aggregation pays before its first file), and the compiled kernels' start (``import numba`` and
    loading one cached kernel,
    which robust rules pay on large passes); plus which heavy packages the command imported."""
    py = sys.executable
    cmd = [py, "-c", "import sys; from fedsplit.cli.app import main; sys.argv[0] = 'fedsplit'; main()",
           "aggregate", "--help"]
    out: dict[str, Any] = {
        "python_s": min(_timed([py, "-c", "pass"]) for _ in range(3)),
        "import_cli_app_s": min(_timed([py, "-c", "import fedsplit.cli.app"]) for _ in range(3)),
        "import_cli_aggregate_s": min(_timed([py, "-c", "import fedsplit.cli.aggregate"]) for _ in range(3)),
    }
    runs = [_run(cmd) for _ in range(3)]
    out["aggregate_help_s"] = min(r[0] for r in runs)
    out["aggregate_help_cpu_s"] = min(r[1] for r in runs)
    kernel = []
    for _ in range(3):
        done = subprocess.run([py, "-c", KERNEL_START], cwd=ROOT, capture_output=True, text=True)
        if done.returncode == 0:
            kernel.append(tuple(float(v) for v in done.stdout.split()))
    out["kernels_start_s"] = min(k[0] for k in kernel) if kernel else None
    out["kernels_start_cpu_s"] = min(k[1] for k in kernel) if kernel else None
    probe = ("import sys, io, contextlib; from fedsplit.cli.app import app; from fedsplit.cli.errors import "
             "run_guarded\nwith contextlib.redirect_stdout(io.StringIO()): run_guarded(app, "
             "['aggregate', '--help'])\nprint(' '.join(m for m in " + repr(HEAVY) +
             " if m in sys.modules))")
    loaded = subprocess.run([py, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    out["heavy_imported"] = loaded.stdout.split()
    return out


def read_rates(paths: list[Path]) -> dict[str, float]:
    """GB/s of block-wise reads (`BlockReader.read`, as a stack fill reads: positional reads at
    each value's offset, then through HDF5 calls) and of a plain read of the same files."""
    nbytes = 0
    start = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(64 * 2**20):
                nbytes += len(chunk)
    plain = nbytes / (time.perf_counter() - start) / 1e9
    rates = {"plain_read_gbps": plain, "file_bytes": nbytes}
    from fedsplit.aggregation._filereads import ReadSettings

    for key, mmap in (("positional_block_read_gbps", True), ("hdf5_block_read_gbps", False)):
        rates[key] = _block_rate(paths, ReadSettings(mmap=mmap))  # FEDSPLIT_MMAP=1 / 0
    return rates


def _block_rate(paths: list[Path], reads: Any) -> float:
    """GB/s of reading every block of ``paths`` into one buffer, as a stacked pass does."""
    from fedsplit.aggregation._blocks import BLOCK_CAP_BYTES, BlockReader, plan_blocks
    from fedsplit.aggregation._filereads import reads_of
    from fedsplit.protocol import open_weights

    files = [open_weights(p) for p in paths]
    try:
        specs = files[0].header.specs
        values = max(1, BLOCK_CAP_BYTES // (len(files) * 4))
        buf = np.empty(values, dtype=np.float32)
        for f in files:
            reads_of(f, reads)  # each file's engine, made with these settings
        readers = [BlockReader(f) for f in files]
        payload = 0
        start = time.perf_counter()
        for block in plan_blocks(specs, values):
            for r in readers:
                r.read(block, buf[: block.size])
                payload += block.size * 4
        return payload / (time.perf_counter() - start) / 1e9
    finally:
        for f in files:
            f.close()


def whole_process(
    paths: list[Path], rules: list[str], *, flower: bool = True, repeat: int = 1
) -> dict[str, dict[str, float]]:
    """Time ``fedsplit aggregate`` and (optionally) Flower + h5py on ``paths`` per rule.

    Each row is printed as soon as it is measured, with the CPU time of both processes
    (user + system, all threads; steadier than wall time on a shared machine) and the load
    average when it was taken."""
    fedsplit = [sys.executable, "-c", "import sys; from fedsplit.cli.app import main; sys.argv[0] = "
                "'fedsplit'; main()"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.h5"
        for rule in rules:
            args = [a.format(m=len(paths) - 2) for a in RULE_ARGS[rule]]
            cmd = [*fedsplit, "aggregate", *map(str, paths), "-o", str(out), "--strategy", rule,
                   *args]
            row: dict[str, float] = {}
            row["ours_s"], row["ours_cpu_s"] = _best(cmd, env, repeat)
            line = f"  {rule:<14}ours {row['ours_s']:6.2f} s ({row['ours_cpu_s']:5.2f} s CPU)"
            if flower:
                fl = [sys.executable, "-c", FLOWER_SCRIPT, rule, str(out), *map(str, paths)]
                row["flower_s"], row["flower_cpu_s"] = _best(fl, env, repeat)
                row["speedup"] = row["flower_s"] / row["ours_s"]
                row["cpu_ratio"] = row["flower_cpu_s"] / row["ours_cpu_s"]
                line += (f"   Flower {row['flower_s']:6.2f} s ({row['flower_cpu_s']:5.2f} s CPU)"
                         f"   {row['speedup']:5.1f}x (CPU {row['cpu_ratio']:4.1f}x)")
            row["load_average"] = os.getloadavg()[0]
            print(f"{line}   load {row['load_average']:.1f}", flush=True)
            results[rule] = row
    return results


def main(argv: list[str] | None = None) -> int:
    """Write N weight files, then print start-up, read rates and whole-process times."""
    import importlib.util

    from fedsplit.protocol import write_weights

    spec = importlib.util.spec_from_file_location("bench_aggregation", ROOT / "bench/aggregation.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    make_updates, shapes_for = bench.make_updates, bench.shapes_for

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--params", default="10M")
    p.add_argument("--strategies", default="fedavg,median,trimmed-mean,krum,multi-krum")
    p.add_argument("--no-flower", action="store_true")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    params = int(float(args.params.rstrip("Mm")) * 1e6) if args.params[-1] in "Mm" else int(
        args.params)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_weights(u, Path(tmp) / f"{u.site}.h5")
                 for u in make_updates(args.n, shapes_for(params))]
        report(paths, args.strategies.split(","), flower=not args.no_flower, repeat=args.repeat)
    return 0


#: fedsplit's packages the ``fedsplit aggregate`` process imports
PACKAGES = ("cli", "aggregation", "protocol")


def compile_bytecode() -> str:
    """Compile fedsplit's packages to bytecode (``__pycache__``), as installing them does.

    Flower, numpy and every other installed package are timed from their compiled bytecode
    (pip compiles at install); a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` (as on the
    bench machine) never writes fedsplit's, so every ``fedsplit`` process would compile its
    ~30 modules from source again (about 0.07 s) and the comparison would time that too.
    Sources edited later are recompiled by Python as usual (stale bytecode is never used).
    """
    import compileall

    ok = all(compileall.compile_dir(str(ROOT / pkg), quiet=1) for pkg in PACKAGES)
    if not ok:
        raise RuntimeError(f"could not compile {', '.join(PACKAGES)} (see above)")
    flag = os.environ.get("PYTHONDONTWRITEBYTECODE")
    from fedsplit.aggregation import _ckernels  # built now (as `make setup` does), not in a timed run

    built = _ckernels.load()
    streamed = f"C kernels {built.path.name}" if built else f"no C kernels ({_ckernels.failure()})"
    return (f"compiled {', '.join(PACKAGES)} (PYTHONDONTWRITEBYTECODE={flag or 'unset'}); "
            f"streamed passes: {streamed}")


def report(paths: list[Path], rules: list[str], *, flower: bool, repeat: int = 1) -> dict:
    """Print and return start-up, read rates and whole-process times for ``paths``."""
    print(f"bytecode: {compile_bytecode()}, as an install has it", flush=True)
    up = startup()
    kernels = ("numba not installed" if up["kernels_start_s"] is None else
               f"{up['kernels_start_s']:.3f} s ({up['kernels_start_cpu_s']:.3f} s CPU)")
    print(f"start-up: python {up['python_s']:.3f} s; import fedsplit.cli.app "
          f"{up['import_cli_app_s'] - up['python_s']:+.3f} s; import fedsplit.cli.aggregate "
          f"{up['import_cli_aggregate_s'] - up['python_s']:+.3f} s; whole `fedsplit aggregate "
          f"--help` {up['aggregate_help_s']:.3f} s ({up['aggregate_help_cpu_s']:.3f} s CPU), "
          f"heavy packages imported: {', '.join(up['heavy_imported']) or 'none'} (of "
          f"{', '.join(HEAVY)}); compiled kernels' start (import numba, one cached kernel): "
          f"{kernels}", flush=True)
    rates = read_rates(paths)  # first pass warms the page cache
    rates = read_rates(paths)
    print(f"reading {rates['file_bytes'] / 1e9:.2f} GB of weight files (page cache): plain "
          f"sequential read {rates['plain_read_gbps']:.1f} GB/s, block reads "
          f"{rates['positional_block_read_gbps']:.1f} GB/s by positional reads "
          f"({100 * rates['positional_block_read_gbps'] / rates['plain_read_gbps']:.0f}%), "
          f"{rates['hdf5_block_read_gbps']:.1f} GB/s through HDF5 calls (FEDSPLIT_MMAP=0)",
          flush=True)
    print(f"whole process over {len(paths)} files: `fedsplit aggregate` vs Flower reading them "
          f"with h5py + its reference function (both write the model)", flush=True)
    rows = whole_process(paths, rules, flower=flower, repeat=repeat)
    return {"startup": up, "read": rates, "whole_process": rows, "n": len(paths)}


if __name__ == "__main__":
    sys.exit(main())

"""Is ``fedsplit aggregate`` slower than at an earlier commit? Paired runs on the same files.

``bench/aggregation_process.py`` gives each rule's speed-up over Flower + h5py in one run. Two
such runs (one per commit) differ by far more than 5% on a shared machine, mostly because
Flower's own time moves. Flower's code is the same for both commits, so this bench shares it:
for each rule, round after round, it times the earlier checkout's ``fedsplit aggregate`` and this
checkout's (their order alternating), and Flower in the first rounds, all on the same files.

- ratio before = median Flower time / median time of the earlier checkout; ratio after alike;
- change = ratio after / ratio before - 1 = median before / median after - 1 (the Flower time
  cancels), printed with the spread of the per-round pairs (each round's before / after).

A negative change is a slowdown. Wall and CPU (user + system, all threads) are both printed.
Both checkouts run with their own folder as the working directory and first on ``sys.path``;
each run prints which ``fedsplit.aggregation`` it imported. Their bytecode is compiled and their
compiled kernels built before anything is timed, as an install has them.

    git worktree add /tmp/before 72d42db
    .venv/bin/python bench/aggregation_before_after.py --before /tmp/before --rounds 5
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN_FEDSPLIT = "import sys; from fedsplit.cli.app import main; sys.argv[0] = 'fedsplit'; main()"
WHERE = "import fedsplit.aggregation as a; print(a.__file__)"
BUILD = ("from fedsplit.aggregation import _ckernels; k = _ckernels.load(); "
         "print(k.path.name if k else 'no C kernels: ' + str(_ckernels.failure()))")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(tree: Path) -> dict[str, str]:
    """The environment that makes ``tree``'s fedsplit the one imported."""
    return {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": "1"}


def prepare(tree: Path, packages: tuple[str, ...]) -> str:
    """Compile ``tree``'s packages, build its C kernels; return where fedsplit.aggregation is."""
    for pkg in packages:
        if (tree / pkg).is_dir() and not compileall.compile_dir(str(tree / pkg), quiet=1):
            raise RuntimeError(f"could not compile {tree / pkg}")
    said = []
    for code in (BUILD, WHERE):
        done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=_env(tree),
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{tree}: {done.stderr[-1500:]}")
        said.append(done.stdout.strip())
    return f"{said[1]} ({said[0]})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True,
                   help="a checkout of the earlier commit (e.g. a git worktree)")
    p.add_argument("--n", type=int, default=30, help="weight files (hospitals)")
    p.add_argument("--params", default="10M", help="parameters per file (10M = 10 million)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per rule (before and after)")
    p.add_argument("--flower-rounds", type=int, default=3,
                   help="rounds that also time Flower (its median gives the ratios; the change "
                        "needs only before and after)")
    p.add_argument("--strategies", default="fedavg,median,trimmed-mean,krum,multi-krum")
    args = p.parse_args(argv)
    before = args.before.resolve()
    if not (before / "aggregation").is_dir() or not (before / "fedsplit").is_dir():
        p.error(f"--before must be a fedsplit checkout with aggregation/ and fedsplit/. "
                f"Received: {before}")
    if args.rounds < 1 or not 1 <= args.flower_rounds <= args.rounds:
        p.error(f"--rounds must be at least 1 and --flower-rounds between 1 and --rounds. "
                f"Received: --rounds {args.rounds} --flower-rounds {args.flower_rounds}")
    process, bench = _load("aggregation_process"), _load("aggregation")
    scale = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6}.get(args.params[-1:], 1)
    try:
        params = int(float(args.params.rstrip("kKmM")) * scale)
    except ValueError:
        p.error(f"--params takes a count such as 10M, 500k or 100000. Received: {args.params!r}")
    rules = args.strategies.split(",")
    unknown = sorted(set(rules) - set(process.RULE_ARGS))
    if unknown:
        p.error(f"--strategies takes {', '.join(process.RULE_ARGS)}. Received: {unknown}")
    trees = {"before": before, "after": ROOT}
    packages = (*process.PACKAGES, "fedsplit")
    for name, tree in trees.items():
        print(f"{name}: {prepare(tree, packages)}", flush=True)
    print(f"load average at the start: {os.getloadavg()[0]:.1f}", flush=True)

    from fedsplit.protocol import write_weights

    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_weights(u, Path(tmp) / f"{u.site}.h5")
                 for u in bench.make_updates(args.n, bench.shapes_for(params))]
        process.read_rates(paths)  # every file read once: the page cache is warm for all
        out = Path(tmp) / "out.h5"
        print(f"{args.n} files x {params:,} float32 parameters; medians of {args.rounds} rounds "
              f"(Flower: of the first {args.flower_rounds}), before/after order alternating",
              flush=True)
        print(f"{'rule':<17} {'Flower':>7} {'before':>7} {'after':>7} {'ratio before':>13} "
              f"{'ratio after':>12} {'change':>7}  per-round before/after (min..max)", flush=True)
        for rule in rules:
            extra = [a.format(m=len(paths) - 2) for a in process.RULE_ARGS[rule]]
            ours = [*map(str, paths), "-o", str(out), "--strategy", rule, *extra]
            commands = {
                "flower": ([sys.executable, "-c", process.FLOWER_SCRIPT, rule, str(out),
                            *map(str, paths)], ROOT, {**os.environ, "OPENBLAS_NUM_THREADS": "1"}),
                "before": ([sys.executable, "-c", RUN_FEDSPLIT, "aggregate", *ours], before,
                           _env(before)),
                "after": ([sys.executable, "-c", RUN_FEDSPLIT, "aggregate", *ours], ROOT,
                          _env(ROOT)),
            }
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in commands}
            for r in range(args.rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                if r < args.flower_rounds:
                    order.insert(r % 3, "flower")
                for key in order:
                    cmd, cwd, env = commands[key]
                    times[key].append(process._run(cmd, env, cwd))
            for i, kind in enumerate(("wall", "cpu")):
                med = {k: statistics.median(t[i] for t in v) for k, v in times.items()}
                pairs = [b[i] / a[i] for b, a in zip(times["before"], times["after"], strict=True)]
                change = med["before"] / med["after"] - 1
                print(f"{rule + ' ' + kind:<17} {med['flower']:6.2f}s {med['before']:6.2f}s "
                      f"{med['after']:6.2f}s {med['flower'] / med['before']:12.2f}x "
                      f"{med['flower'] / med['after']:11.2f}x {100 * change:+6.1f}%  "
                      f"{min(pairs):.3f}..{max(pairs):.3f}", flush=True)
        print(f"load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

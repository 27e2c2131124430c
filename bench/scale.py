"""`fedsplit simulate` against bare Flower as the hospitals grow: wall time and peak memory.

For each number of hospitals (default 10, 100, 1000) one synthetic table per hospital (8
features, a binary label, ``--rows`` training and a quarter as many test rows) trains the
built-in MLP (``--hidden``, default 64-32: 2,722 parameters; 5000-5000 is 25M, 10000-10000
100M) for ``--rounds`` rounds, three ways, alternating in the same run so the machine's load
falls on each alike:

- ``bare``: a minimal FedAvg ServerApp and ClientApp (bench/bare_flower_app.py, as
  bench/round_overhead.py stages it): the same data loading, model and local training, no
  fedsplit coordinator, no closing analyses;
- ``fedsplit``: ``fedsplit simulate --site NAME=TRAIN:TEST ...`` with its default closing
  analyses (the baselines, per-round scoring, summary, per_site.csv, plot);
- ``fedsplit-nobase``: the same with ``--baselines none``.

Wall time is each run's, start to exit; memory is the peak of the summed RSS of the whole
process tree (sampled every 0.5 s from /proc: the SuperLink, Flower's simulation process and
Ray's processes; for fedsplit also the ``fedsplit simulate`` process itself, which runs the
closing analyses; for bare the bench process, which only waits, is left out).

With ``--idle 8`` each kind also runs once with a tiny model (hidden 8) first, and the
coordinator's peak above that run's is printed as a multiple of the model's bytes (issue 43's
coordinator target).

    .venv/bin/python bench/scale.py --hospitals 10,100 --repeats 1
    .venv/bin/python bench/scale.py --hospitals 3 --hidden 10000-10000 --rounds 3
    .venv/bin/python bench/scale.py --hospitals 3 --hidden 10000-10000 --kinds bare,fedsplit-nobase --idle 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
# Run as a script, bench/ comes first on sys.path and bench/aggregation.py would shadow the
# aggregation package: put the repository root first (bench/ stays, for the helpers below).
sys.path.insert(0, str(BENCH.parent))

from admin_large_upload import proc_value, tree  # noqa: E402
from fedsplit.client.data import Dataset  # noqa: E402
from fedsplit.client.models import ModelSpec  # noqa: E402
from fedsplit.orchestration.experiment import write_site  # noqa: E402
from fedsplit.orchestration.flower_runtime import (  # noqa: E402
    flower_env,
    run_app,
    simulation_superlink,
    stage_app,
    write_connection,
)
from fedsplit.protocol.config import RunConfig  # noqa: E402
from fedsplit.protocol.record.horizontal import RunRecord  # noqa: E402

FEATURES = 8
KINDS = ("bare", "fedsplit", "fedsplit-nobase")


#: process roles, by what their command line holds (first match wins): the coordinator is the
#: SuperLink and the process that runs the ServerApp (Flower's simulation process, which is also
#: Ray's driver); the hospitals are Ray's ClientApp actors; the rest of Ray is its own row
ROLES = (("coordinator", ("flower-superlink", "flwr-simulation", "flwr-serverapp")),
         ("hospitals", ("ClientAppActor", "ray::", "flwr-clientapp")),
         ("ray", ("raylet", "gcs_server", "ray/", "dashboard")),
         ("fedsplit-cli", ("fedsplit simulate", "bin/fedsplit")))


def role_of(pid: int, roles: tuple[tuple[str, tuple[str, ...]], ...] = ROLES) -> str:
    """The role (``roles``) of process ``pid`` by its command line; "other" if none matches."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    return next((role for role, marks in roles if any(m in line for m in marks)), "other")


class PeakTree:
    """The peak summed RSS (MiB) of ``pid``'s process tree, sampled every ``every`` s, in all
    and per role (``roles``, default `ROLES`: each role's peak of its own summed RSS); each of
    ``combined`` (name -> roles) is the peak of those roles' summed RSS, sampled together."""

    def __init__(self, pid: int, *, skip_root: bool = False, every: float = 0.5,
                 roles: tuple[tuple[str, tuple[str, ...]], ...] = ROLES,
                 combined: dict[str, tuple[str, ...]] | None = None) -> None:
        self.pid, self.skip_root, self.every, self.roles = pid, skip_root, every, roles
        self.combined = combined or {}
        self.peak_mib = 0.0
        self.role_peak_mib: dict[str, float] = {}
        #: each role's peak of its processes' RSS less their shared memory (RssShmem: Ray's
        #: object store, mapped into the processes that write or read objects in it)
        self.private_peak_mib: dict[str, float] = {}
        #: each role's peak of its processes' shared memory (RssShmem)
        self.shared_peak_mib: dict[str, float] = {}
        #: every sample: (seconds since start, MiB per role), for a run's memory over time
        self.timeline: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            pids = tree(self.pid)[1:] if self.skip_root else tree(self.pid)
            by_role: dict[str, float] = {}
            shared: dict[str, float] = {}
            for p in pids:
                role = role_of(p, self.roles)  # read each time: a process's title changes after exec
                rss, shmem = (proc_value(p, "status", key) for key in ("VmRSS", "RssShmem"))
                by_role[role] = by_role.get(role, 0.0) + rss / 1024
                shared[role] = shared.get(role, 0.0) + shmem / 1024
            for role, mib in shared.items():
                self.shared_peak_mib[role] = max(self.shared_peak_mib.get(role, 0.0), mib)
                self.private_peak_mib[role] = max(self.private_peak_mib.get(role, 0.0),
                                                  by_role[role] - mib)
            self.peak_mib = max(self.peak_mib, sum(by_role.values()))
            self.timeline.append((round(time.monotonic() - start, 2),
                                  {k: round(v, 1) for k, v in by_role.items()}))
            for role, mib in by_role.items():
                self.role_peak_mib[role] = max(self.role_peak_mib.get(role, 0.0), mib)
            for name, parts in self.combined.items():
                mib = sum(by_role.get(part, 0.0) for part in parts)
                self.role_peak_mib[name] = max(self.role_peak_mib.get(name, 0.0), mib)
            self._stop.wait(self.every)

    def __enter__(self) -> PeakTree:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def mlp_model_id(hidden: tuple[int, ...]) -> str:
    """The built-in MLP over the synthetic tables (`FEATURES` in, 2 classes out)."""
    return ModelSpec(kind="mlp", task="classification", input_shape=(FEATURES,), num_outputs=2,
                     hidden=hidden).to_id()


def mlp_parameters(hidden: tuple[int, ...]) -> int:
    """`mlp_model_id`'s parameter count (weights and biases), without building it."""
    widths = (FEATURES, *hidden, 2)
    return sum(a * b + b for a, b in itertools.pairwise(widths))


def hospitals_data(root: Path, count: int, rows: int, seed: int) -> list[tuple[str, Path, Path]]:
    """Each hospital's training file (root/sites/site-i/data.csv, where the bare app reads it)
    and test file; one linear rule with noise, each hospital's features shifted a little."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=FEATURES)
    names = [f"f{j}" for j in range(FEATURES)]
    out = []
    for i in range(count):
        shift = rng.normal(scale=0.3, size=FEATURES)

        def draw(n: int, shift: np.ndarray = shift) -> Dataset:
            x = (rng.normal(size=(n, FEATURES)) + shift).astype(np.float32)
            y = ((x @ weights + rng.normal(scale=0.5, size=n)) > 0).astype(np.int64)
            return Dataset(x, y, "classification", "mlp", names)

        train = write_site(draw(rows), root / "sites" / f"site-{i}", "target")
        test = write_site(draw(max(rows // 4, 2)), root / "tests" / f"site-{i}", "target")
        out.append((f"site-{i}", train, test))
    return out


def bare_round_seconds(history: Path) -> list[float]:
    """The bare app's round seconds, from its own status file (bench/bare_flower_app.py: the
    time between two of Flower's evaluate_fn calls, a round's train and evaluate phases)."""
    return [float(r["seconds"]) for r in json.loads(history.read_text())["rounds"]]


def fedsplit_round_seconds(history: Path) -> list[float]:
    """fedsplit's round seconds, from its run record (a round's training and the scoring of
    model r-1; the last round's include the closing evaluation)."""
    record = RunRecord.load(history)
    return [float(r.seconds or 0.0) for r in sorted(record.rounds, key=lambda r: r.round)]


def bare_run(cfg: RunConfig, hospitals: int, work: Path) -> tuple[float, list[float]]:
    """The bare Flower app over the hospitals' files; its wall seconds and round seconds."""
    flwr_home = work / "flwr-home"
    env = flower_env(flwr_home)
    app = stage_app(work / "app", cfg, components=("bare_flower_app:server",
                                                   "bare_flower_app:client"),
                    extra_modules=[BENCH / "bare_flower_app.py"])
    start = time.monotonic()
    with simulation_superlink(work, env) as address:
        write_connection(flwr_home, address)
        history = run_app(app, env, work / "flower.log", Path(cfg.out_dir) / "history.json",
                          federation_config=f"num-supernodes={hospitals} "
                                            f"client-resources-num-cpus=1")
    if history.get("status") != "finished":
        raise RuntimeError(f"bare run did not finish: see {work / 'flower.log'}")
    return time.monotonic() - start, bare_round_seconds(Path(cfg.out_dir) / "history.json")


def fedsplit_run(files: list[tuple[str, Path, Path]], rounds: int, seed: int, work: Path,
                 *extra: str) -> tuple[float, list[float]]:
    """``fedsplit simulate`` over the hospitals' files; its wall seconds and round seconds."""
    cmd = [str(Path(sys.executable).parent / "fedsplit"), "simulate", "--rounds", str(rounds),
           "--seed", str(seed), "--out", str(work), "--no-resume", *extra]
    for name, train, test in files:
        cmd += ["--site", f"{name}={train}:{test}"]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fedsplit simulate failed ({done.returncode}): "
                           f"{(done.stdout + done.stderr)[-2000:]}")
    return time.monotonic() - start, fedsplit_round_seconds(work / "federation" / "history.json")


def run_kind(kind: str, hidden: str, hospitals: int, root: Path,
             files: list[tuple[str, Path, Path]], work: Path, args: argparse.Namespace
             ) -> tuple[float, list[float], PeakTree]:
    """One run of ``kind`` with the MLP of ``hidden`` widths: wall seconds, round seconds and
    its memory (the bench process itself left out)."""
    if kind == "bare":
        model_file = root / f"model-id-{hidden}.txt"
        model_file.write_text(mlp_model_id(RunConfig(hidden=hidden).hidden_widths))
        cfg = RunConfig(num_server_rounds=args.rounds, min_nodes=hospitals, seed=args.seed,
                        data_dir=str(root / "sites"), out_dir=str(work / "out"),
                        initial_weights=str(model_file))
        with PeakTree(os.getpid(), skip_root=True) as peak:
            wall, rounds = bare_run(cfg, hospitals, work)
        return wall, rounds, peak
    extra = ("--baselines", "none") if kind == "fedsplit-nobase" else ()
    with PeakTree(os.getpid(), skip_root=True) as peak:
        wall, rounds = fedsplit_run(files, args.rounds, args.seed, work, "--hidden", hidden,
                                    *extra)
    return wall, rounds, peak


def main() -> None:
    """Run every size and kind, alternating; print a table and the numbers as JSON."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hospitals", default="10,100,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=40, help="training rows per hospital")
    parser.add_argument("--hidden", default="64-32", help="the MLP's hidden widths, as --hidden")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"which of {', '.join(KINDS)} to run (bare always first)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle", default=None,
                        help="also run each kind once with this tiny model's hidden widths "
                             "(e.g. 8) and print the coordinator's peak above it as a "
                             "multiple of the model's bytes")
    args = parser.parse_args()
    sizes = [int(n) for n in args.hospitals.split(",")]
    kinds = tuple(k for k in KINDS if k in args.kinds.split(","))
    if "bare" not in kinds or set(args.kinds.split(",")) - set(KINDS):
        parser.error(f"--kinds takes bare and any of {', '.join(KINDS[1:])}. "
                     f"Received: {args.kinds}")
    hidden = RunConfig(hidden=args.hidden).hidden_widths
    params = mlp_parameters(hidden)
    print(f"model: MLP {FEATURES}-{'-'.join(map(str, hidden))}-2, {params:,} parameters "
          f"({params * 4 / 2**20:.0f} MiB as float32)", flush=True)
    results: dict[int, dict[str, list[tuple[float, float]]]] = {}
    round_times: dict[int, dict[str, list[float]]] = {}
    roles: dict[int, dict[str, dict[str, float]]] = {}
    idle: dict[int, dict[str, float]] = {}  # the coordinator's peak with the --idle model
    idle_private: dict[int, dict[str, float]] = {}  # the same less its shared memory
    private: dict[int, dict[str, float]] = {}  # the coordinator's peak less its shared memory
    shared: dict[int, dict[str, float]] = {}  # the coordinator's peak shared memory
    with tempfile.TemporaryDirectory(prefix="fedsplit-scale-") as tmp:
        for hospitals in sizes:
            root = Path(tmp) / f"n{hospitals}"
            files = hospitals_data(root, hospitals, args.rows, args.seed)
            idle[hospitals], idle_private[hospitals] = {}, {}
            private[hospitals], shared[hospitals] = {}, {}
            results[hospitals] = {kind: [] for kind in kinds}
            round_times[hospitals] = {kind: [] for kind in kinds}
            roles[hospitals] = {kind: {} for kind in kinds}
            if args.idle:
                for kind in kinds:
                    _, _, peak = run_kind(kind, args.idle, hospitals, root, files,
                                          root / f"{kind}-idle", args)
                    idle[hospitals][kind] = peak.role_peak_mib.get("coordinator", 0.0)
                    idle_private[hospitals][kind] = peak.private_peak_mib.get("coordinator", 0.0)
                    print(f"{hospitals:5d} hospitals  {kind:16s} idle ({args.idle}): "
                          f"coordinator {idle[hospitals][kind]:.0f} MiB", flush=True)
            for rep in range(args.repeats):
                for kind in kinds:
                    wall, rounds, peak = run_kind(kind, args.hidden, hospitals, root, files,
                                                  root / f"{kind}-{rep}", args)
                    results[hospitals][kind].append((wall, peak.peak_mib))
                    for into, got in ((private, peak.private_peak_mib),
                                      (shared, peak.shared_peak_mib)):
                        into[hospitals][kind] = max(into[hospitals].get(kind, 0.0),
                                                    got.get("coordinator", 0.0))
                    round_times[hospitals][kind].extend(rounds)
                    roles[hospitals][kind] = {
                        r: max(roles[hospitals][kind].get(r, 0.0), m)
                        for r, m in {**roles[hospitals][kind], **peak.role_peak_mib}.items()}
                    per_role = ", ".join(f"{r} {m:.0f}" for r, m in sorted(peak.role_peak_mib.items()))
                    print(f"{hospitals:5d} hospitals  {kind:16s} run {rep + 1}: {wall:7.1f} s, "
                          f"rounds {', '.join(f'{x:.1f}' for x in rounds)} s, "
                          f"tree peak {peak.peak_mib:7.0f} MiB ({per_role})", flush=True)
    others = [k for k in kinds if k != "bare"]
    print(f"\n| hospitals | {' | '.join(f'{k} s' for k in kinds)} | "
          f"{' | '.join(f'{k} MiB' for k in kinds)} | "
          f"{' | '.join(f'{k} / bare' for k in others)} | "
          f"{' | '.join(f'{k} median round / bare' for k in others)} |")
    print("|" + "---|" * (2 * len(kinds) + 2 * len(others) + 1))
    summary = {}
    for hospitals, runs in results.items():
        wall = {k: statistics.median(w for w, _ in runs[k]) for k in kinds}
        mem = {k: max(m for _, m in runs[k]) for k in kinds}
        median_round = {k: statistics.median(round_times[hospitals][k])
                        if round_times[hospitals][k] else float("nan") for k in kinds}
        bare_round = median_round["bare"]
        summary[hospitals] = {"wall_s": wall, "peak_tree_mib": mem,
                              "peak_role_mib": roles[hospitals],
                              "round_s": round_times[hospitals]}
        print(f"| {hospitals} | {' | '.join(f'{wall[k]:.1f}' for k in kinds)} | "
              f"{' | '.join(f'{mem[k]:.0f}' for k in kinds)} | "
              f"{' | '.join(f'{ratio:.2f}x' for ratio in (wall[k] / wall['bare'] for k in others))} | "
              f"{' | '.join(f'{median_round[k] / bare_round:.2f}x' for k in others)} |")
    model_mib = params * 4 / 2**20
    for hospitals, by_kind in idle.items():
        for kind, base in by_kind.items():
            peak = roles[hospitals][kind].get("coordinator", 0.0)
            own = private[hospitals][kind] - idle_private[hospitals][kind]
            print(f"{hospitals} hospitals, {kind}: coordinator {peak:,.0f} MiB, above idle "
                  f"{peak - base:,.0f} MiB = {(peak - base) / model_mib:.1f}x the model; "
                  f"less shared memory (Ray's object store) {own:,.0f} MiB = "
                  f"{own / model_mib:.1f}x, shared {shared[hospitals][kind]:,.0f} MiB")
    print(json.dumps({"rounds": args.rounds, "rows": args.rows, "repeats": args.repeats,
                      "parameters": params, "model_id": mlp_model_id(hidden),
                      "idle_coordinator_mib": idle,
                      "idle_coordinator_private_mib": idle_private,
                      "coordinator_private_mib": private, "coordinator_shared_mib": shared,
                      "results": summary}, indent=2))


if __name__ == "__main__":
    main()

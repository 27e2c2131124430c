"""A simulated federation end to end: data, sites, Flower run, baselines, summary, plot.

`run_experiment` is what ``fedsplit simulate`` (and ``compare-strategies``) call: it cuts a
held-out test split from the union of the data (for scoring only), writes each simulated
hospital's rows to its own folder and their fingerprint into the run config (`stage_sites`:
resuming an unfinished run on other data is refused before Flower starts), runs the federation
in Flower's simulation engine, trains the same model centrally and at each site alone for the
same total epochs, and scores all of them on the test split.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from client.data import (
    Dataset,
    dataset_from_frame,
    load_bundled,
    load_site_file,
    partition,
    read_table,
    split_indices,
)
from client.models import ModelSpec, SiteModel, build_model, load_model
from client.site import split_site
from client.train import fit, score, set_statistics
from orchestration.certs import site_names
from orchestration.fingerprint import data_fingerprint
from orchestration.flower_runtime import simulation
from orchestration.plots import plot_rounds
from protocol.atomic import write_json_atomic
from protocol.config import RunConfig
from protocol.errors import ConfigError
from protocol.stats import combine_moments, moments
from server.history import find_resume_point


@dataclass
class Experiment:
    """What to simulate; `RunConfig` holds the federation's own knobs."""

    cfg: RunConfig
    out: Path
    dataset: str | None = None
    site_files: Sequence[Path] = ()
    num_sites: int = 3
    partition: str = "iid"
    test_fraction: float = 0.2
    leave_out: Sequence[int] = ()
    summary_extra: dict[str, Any] = field(default_factory=dict)


def _concat(parts: Sequence[Dataset]) -> Dataset:
    ref = parts[0]
    return Dataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                   ref.task, ref.kind, ref.feature_names)


def _site_tables(files: Sequence[Path], target: str, task: str | None) -> list[Dataset]:
    """Load hospitals' own files; encode non-numeric class labels with one shared mapping."""
    import pandas as pd

    if not files:
        raise ConfigError("Give --dataset NAME or at least one --site FILE. Received: neither")
    frames = []
    for path in files:
        if path.suffix.lower() == ".npz":
            frames.append(None)
            continue
        frames.append(read_table(path))
    if any(f is None for f in frames):
        return [load_site_file(p, target=target, task=task) for p in files]
    columns = [list(f.columns) for f in frames]
    for path, cols in zip(files[1:], columns[1:], strict=True):
        if sorted(cols) != sorted(columns[0]):
            raise ConfigError(
                f"{path} does not have the same columns as {files[0]}: horizontal federation needs "
                f"one schema. Sites holding different columns need `fedsplit vertical simulate`. "
                f"Received: {sorted(set(cols) ^ set(columns[0]))}"
            )
    has_target = all(target in f.columns for f in frames)
    labels = pd.concat([f[target] for f in frames]) if has_target else None
    if labels is not None and labels.dtype.kind not in "iufb":
        mapping = {v: i for i, v in enumerate(sorted(labels.dropna().astype(str).unique()))}
        for f in frames:
            f[target] = f[target].astype(str).map(mapping)
    return [
        dataset_from_frame(frame[columns[0]], target=target, task=task, source=path)
        for path, frame in zip(files, frames, strict=True)
    ]


def prepare_sites(exp: Experiment) -> tuple[list[Dataset], Dataset]:
    """Return (per-site rows, held-out test rows), reproducibly from the seed."""
    cfg = exp.cfg
    task = None if cfg.task == "auto" else cfg.task
    if exp.dataset:
        data = load_bundled(exp.dataset)
        keep, test = split_indices(len(data), exp.test_fraction, cfg.seed)
        pool = data.subset(keep)
        parts = partition(pool.y, exp.num_sites, exp.partition, cfg.seed)
        return [pool.subset(p) for p in parts], data.subset(test)
    sites = _site_tables(list(exp.site_files), cfg.target, task)
    kept, tests = [], []
    for i, site in enumerate(sites):
        keep, test = split_indices(len(site), exp.test_fraction, cfg.seed + i)
        kept.append(site.subset(keep))
        tests.append(site.subset(test))
    return kept, _concat(tests)


def write_site(site: Dataset, folder: Path, target: str) -> Path:
    """Write one simulated hospital's rows where only its agent reads them."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("data.*"):  # a previous run's file of the other kind: one file per site
        stale.unlink()
    if site.kind == "cnn":
        path = folder / "data.npz"
        np.savez(path, x=site.x, y=site.y)
    else:
        frame = pd.DataFrame(site.x, columns=site.feature_names)
        frame[target] = site.y
        path = folder / "data.csv"
        frame.to_csv(path, index=False)
    return path


def _fresh_model(train: Dataset, num_outputs: int, cfg: RunConfig) -> SiteModel:
    spec = ModelSpec(kind=train.kind, task=train.task, input_shape=tuple(train.x.shape[1:]),
                     num_outputs=num_outputs, hidden=cfg.hidden_widths, norm=cfg.norm)
    model = build_model(spec, seed=cfg.seed)
    flat = train.x.reshape(len(train.x), -1)
    mean, std = combine_moments([moments(flat.reshape(-1, 1) if train.kind == "cnn" else flat)])
    y = train.y.astype(np.float64)
    set_statistics(model, mean, std, float(y.mean()), float(y.std()))
    return model


def train_baseline(train: Dataset, test: Dataset, num_outputs: int, cfg: RunConfig) -> dict[str, float]:
    """Train the federation's model on ``train`` alone for rounds x local epochs; score on ``test``."""
    model = _fresh_model(train, num_outputs, cfg)
    fit(model, train.x, train.y, epochs=cfg.num_server_rounds * cfg.local_epochs, lr=cfg.lr,
        batch_size=cfg.batch_size, seed=cfg.seed)
    return score(model, test.x, test.y)


def check_attack(attack: str, attackers: int, num_sites: int) -> list[int]:
    """Validate --attack/--attackers together; return the hostile site indices."""
    from client.attacks import hostile_sites, parse_attack

    parsed = parse_attack(attack)
    hostile = hostile_sites(num_sites, attackers)
    if (parsed is None) != (not hostile):
        raise ConfigError(
            "--attack and --attackers go together: name the attack and how many sites play it "
            f"(e.g. --attack signflip --attackers 1). Received: --attack {attack} --attackers {attackers}"
        )
    return hostile


def stage_sites(exp: Experiment) -> tuple[RunConfig, list[Dataset], Dataset]:
    """Write each site's rows under OUT/sites; return the run config (with their fingerprint),
    the sites that join and the held-out test rows.

    With ``resume`` on, an unfinished run in OUT/federation whose configuration or site data
    differ is refused here (`ResumeMismatchError`), before any Flower process starts.
    """
    out = exp.out.resolve()
    sites, test = prepare_sites(exp)
    bad = [k for k in exp.leave_out if not 0 <= k < len(sites)]
    if bad or len(set(exp.leave_out)) >= len(sites):
        raise ConfigError(
            f"--leave-out names sites 0..{len(sites) - 1} to partition but not run, and at least "
            f"one site must remain. Received: {list(exp.leave_out)}"
        )
    # Left-out sites keep their share of the partition (the others' rows are unchanged) but
    # do not join: the federation as it would have been without them.
    sites = [s for k, s in enumerate(sites) if k not in set(exp.leave_out)]
    if exp.cfg.norm != "none" and sites[0].kind != "mlp":
        raise ConfigError(f"--norm {exp.cfg.norm} adds BatchNorm after the MLP's hidden layers; this "
                          f"data trains the {sites[0].kind}, which has none. Use --norm none. "
                          f"Received: norm={exp.cfg.norm!r}, model {sites[0].kind}")
    files = {f"site-{i}": write_site(site, out / "sites" / f"site-{i}", exp.cfg.target)
             for i, site in enumerate(sites)}
    cfg = exp.cfg.model_copy(update={
        "data_dir": str(out / "sites"), "out_dir": str(out / "federation"),
        # every simulated hospital is connected before round 1; a round then needs one usable
        # update (the strategy enforces its own minimum, e.g. Krum's 2f+3), so an excluded
        # hostile site does not void the round
        "min_nodes": len(sites), "quorum": exp.cfg.quorum or 1,
        "data_fingerprint": data_fingerprint(files),
    })
    if cfg.resume:
        find_resume_point(Path(cfg.out_dir), cfg.to_flower())
    return cfg, sites, test


def run_experiment(
    exp: Experiment,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the federation and the baselines; write summary.json and rounds.png into ``exp.out``."""
    stage = on_stage or (lambda _msg: None)
    out = exp.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg, sites, test = stage_sites(exp)
    stage(f"federation: {len(sites)} hospitals, {cfg.strategy}, {cfg.num_server_rounds} rounds")
    history = simulation(cfg, len(sites), out / "flower", on_progress=on_progress)

    stage("scoring the federated model per round on the held-out test split")
    rounds = []
    for entry in history["rounds"]:
        if "model" not in entry:
            continue
        model = load_model(out / "federation" / entry["model"])
        rounds.append({"round": entry["round"],
                       "metrics": score(model, test.x, test.y),
                       "site_evaluation": entry.get("evaluate", {}).get("metrics", {})})
    if not rounds:
        raise ConfigError("The federation produced no global model (every round failed); see "
                          f"{out / 'federation' / 'history.json'}. Received: 0 models")
    final = load_model(out / "federation" / "global.h5")
    num_outputs = final.spec.num_outputs

    stage("baselines: centralized and each hospital alone (same model, same total epochs)")
    trains = [split_site(s, cfg.val_fraction, cfg.seed)[0] for s in sites]
    centralized = train_baseline(_concat(trains), test, num_outputs, cfg)
    local_only = [
        {"site": f"site-{i}", "num_examples": len(t),
         "metrics": train_baseline(t, test, num_outputs, cfg)}
        for i, t in enumerate(trains)
    ]
    hostile = [f"site-{i}" for i in range(len(sites))][len(sites) - cfg.attackers:] if cfg.attackers else []
    summary = {
        "task": final.spec.task,
        "attack": {"kind": cfg.attack, "hostile_sites": hostile} if hostile else None,
        "dataset": exp.dataset or [str(p) for p in exp.site_files],
        "strategy": cfg.strategy,
        "strategy_params": cfg.params,
        "sites": len(sites),
        "partition": exp.partition if exp.dataset else "files",
        "left_out": list(exp.leave_out),
        "model_id": final.spec.to_id(),
        "test_examples": len(test),
        "config": cfg.to_flower(),
        "centralized": {"num_examples": sum(len(t) for t in trains), "metrics": centralized},
        "local_only": local_only,
        "federated": {"metrics": score(final, test.x, test.y),
                      # rows behind the final model: excluded (e.g. hostile) sites do not count
                      "num_examples": next(e["aggregation"]["num_examples"]
                                           for e in reversed(history["rounds"]) if "aggregation" in e),
                      "model": str(out / "federation" / "global.h5")},
        "rounds": rounds,
        **exp.summary_extra,
    }
    write_json_atomic(out / "summary.json", summary)
    plot_rounds(summary, out / "rounds.png")
    return summary


def load_summary(path: Path) -> dict[str, Any]:
    """Read a summary.json written by `run_experiment`."""
    return json.loads(Path(path).read_text())


def prepare_partitions(out: Path, dataset: str, sites: int, partition: str = "iid",
                       seed: int = 0) -> dict[str, Path]:
    """Write hospital-i/data.* under ``out`` (each folder holds one hospital's rows only).

    Returns hospital name -> its data file (for `orchestration.fingerprint.data_fingerprint`).
    """
    cfg = RunConfig(seed=seed)
    parts, _test = prepare_sites(Experiment(cfg=cfg, out=out, dataset=dataset, num_sites=sites,
                                            partition=partition))
    return {name: write_site(part, out / name, cfg.target)
            for name, part in zip(site_names(sites), parts, strict=True)}

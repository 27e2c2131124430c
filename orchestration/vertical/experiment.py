"""A simulated vertical federation end to end, and the fill comparison.

`run_vertical` is what ``fedsplit vertical simulate`` calls: it resolves the site and label
files (bundled data is cut by columns first), runs PSI alignment and split training in Flower's
simulation engine (one ClientApp per site), trains the baselines in-process with the same steps
(each site alone, one centralized model on all columns) and writes ``summary.json`` and
``rounds.png``. Every model, fused or baseline, keeps the round that scores best on validation
rows the label holder cut from its training rows (`protocol.selection`) and reports it
(``rounds_kept``, ``val_metric``); ``keep="last"`` keeps the fused model's last round instead
(protocols that fix the round count), the baselines still keeping theirs by validation.
`compare_fills` runs every fill on the same split in-process
(``fedsplit vertical compare-fills``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsplit.orchestration.flower_runtime import VERTICAL_COMPONENTS, simulation
from fedsplit.orchestration.plots import plot_vertical
from fedsplit.orchestration.vertical.datasets import write_bundled
from fedsplit.orchestration.vertical.local import Baselines, baselines, train_local
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.common import HISTORY_FILE, SUMMARY_FILE
from fedsplit.protocol.record.vertical import (
    VerticalFills,
    VerticalRunRecord,
    VerticalScores,
    VerticalSummary,
    VerticalSummaryRound,
)
from fedsplit.protocol.vertical.config import FusionParams, VerticalConfig
from fedsplit.server.vertical.coordinator import LabelTable, read_label_file

FILLS = ("nearest", "mean", "zero", "drop")


@dataclass
class VerticalInputs:
    """The site files (one per site, in order) and the label holder's file."""

    sites: list[Path]
    labels: Path
    id_column: str
    target: str


def resolve_inputs(*, dataset: str | None, site_files: Sequence[Path], labels: Path | None,
                   num_sites: int, overlap: float, out: Path, seed: int, id_column: str,
                   target: str) -> VerticalInputs:
    """Bundled ``dataset`` cut into OUT/data/site-i.csv + labels.csv, or the given files."""
    if bool(dataset) == bool(site_files):
        raise ConfigError("Give either --dataset NAME --sites N, or one --site FILE per site with "
                          f"--labels FILE. Received: dataset={dataset!r}, {len(site_files)} --site")
    if dataset:
        files = write_bundled(dataset, num_sites, out / "data", overlap=overlap, seed=seed)
        return VerticalInputs(files.sites, files.labels, files.id_column, files.target)
    if labels is None:
        raise ConfigError("--labels FILE (ID column + target, held by the coordinator) is needed "
                          "with --site files. Received: no --labels")
    return VerticalInputs([Path(p).resolve() for p in site_files], labels.resolve(), id_column, target)


def run_flower(cfg: VerticalConfig, num_sites: int, work: Path,
               timeout: float = 3600) -> VerticalRunRecord:
    """Run the vertical app in Flower's simulation engine with ``num_sites`` site nodes; its
    finished run record."""
    path = Path(cfg.out_dir) / HISTORY_FILE
    return VerticalRunRecord.from_json(
        simulation(cfg, num_sites, work, timeout=timeout, components=VERTICAL_COMPONENTS),
        source=str(path))


def summarize(history: VerticalRunRecord, federation: Path, *, params: FusionParams,
              dataset: str | list[str], sites: int, base: Baselines,
              seconds: float) -> VerticalSummary:
    """``summary.json`` from the federation's finished record (``federation``: its output
    folder) and the baselines: the fused model's kept round beside the centralized model and
    each site alone, every round, the overlap and the message inventory."""
    chosen, final = history.selection, history.kept_round()
    if chosen is None or final is None or not history.rounds:
        raise ConfigError(f"The vertical federation finished without a kept round; its record "
                          f"{federation / HISTORY_FILE} has no selection. Received: "
                          f"{len(history.rounds)} rounds")
    federated = VerticalScores(
        metrics=dict(final.metrics), num_examples=final.num_examples,
        model=str(federation / "head"), site_models=history.site_models,
        last_model=str(federation / "last" / "head"), last_site_models=history.last_site_models,
        keep=chosen.keep, rounds_kept=chosen.rounds_kept, val_metric=list(chosen.val_metric),
        val_rows=history.val_rows, final_metrics=dict(history.rounds[-1].metrics),
        seconds=round(seconds, 1), messages=history.messages)
    if final.metrics_complete_rows is not None:
        federated.metrics_complete_rows = final.metrics_complete_rows
    return VerticalSummary(
        task=history.task, params=params.model_dump(), dataset=dataset, sites=sites,
        fill=params.fill, overlap=list(history.overlap or []), psi_seconds=history.psi_seconds,
        train_rows=history.train_rows, test_examples=history.test_rows,
        centralized=base.centralized, local_only=base.local_only, federated=federated,
        keep=chosen.keep,
        rounds=[VerticalSummaryRound(round=r.round, metrics=r.metrics, train_loss=r.train_loss,
                                     steps=r.steps, val_metrics=r.val_metrics)
                for r in history.rounds],
        inventory=dict(history.inventory or {}))


def run_vertical(
    inputs: VerticalInputs,
    params: FusionParams,
    out: Path,
    *,
    rounds: int,
    task: str = "auto",
    seed: int = 0,
    test_fraction: float = 0.2,
    dataset: str | None = None,
    on_stage: Callable[[str], None] | None = None,
    keep: str = "best-val",
) -> VerticalSummary:
    """Run the federation in Flower and the baselines in-process; write summary.json and rounds.png."""
    stage = on_stage or (lambda _msg: None)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = inputs.sites
    label_table = read_label_file(str(inputs.labels), inputs.id_column, inputs.target,
                                  None if task == "auto" else task)
    cfg = VerticalConfig(
        num_server_rounds=rounds, fusion_params=json.dumps(params.model_dump()),
        id_column=inputs.id_column, target=inputs.target, labels_path=str(inputs.labels), task=task,
        site_files=json.dumps([str(p) for p in files]),
        site_out_dirs=json.dumps([str(out / "sites" / f"site-{i}") for i in range(len(files))]),
        seed=seed, test_fraction=test_fraction, out_dir=str(out / "federation"), min_nodes=len(files),
        keep=keep)
    stage(f"federation: {len(files)} sites, fill={params.fill}, {rounds} rounds x "
          f"{params.steps_per_round} steps (Flower simulation)")
    t0 = time.monotonic()
    history = run_flower(cfg, len(files), out / "flower")
    fed_seconds = time.monotonic() - t0
    stage("baselines: each site alone and centralized (same steps, in-process)")
    base = baselines(label_table, files, inputs.id_column, params, rounds, seed=seed,
                     test_fraction=test_fraction)
    summary = summarize(history, out / "federation", params=params,
                        dataset=dataset or [str(p) for p in files], sites=len(files), base=base,
                        seconds=fed_seconds)
    summary.save(out / SUMMARY_FILE)
    plot_vertical(summary.to_json(), out / "rounds.png")
    return summary


def compare_fills(labels: LabelTable, files: Sequence[Path], id_column: str, rounds: int,
                  params: FusionParams, seed: int) -> VerticalFills:
    """Run every fill on the same split (in-process); return their held-out metrics."""
    return VerticalFills(fills=[
        train_local(labels, files, id_column, params.model_copy(update={"fill": fill}), rounds,
                    seed=seed)
        for fill in FILLS])


def run_compare_fills(inputs: VerticalInputs, params: FusionParams, out: Path, *, rounds: int,
                      seed: int) -> tuple[VerticalFills, str]:
    """``fedsplit vertical compare-fills``: every fill on the same split (`compare_fills`),
    written to OUT/fills.json; returns (the results, the label holder's task)."""
    label_table = read_label_file(str(inputs.labels), inputs.id_column, inputs.target, None)
    results = compare_fills(label_table, inputs.sites, inputs.id_column, rounds, params, seed)
    results.save(out / "fills.json")
    return results, label_table.task

"""``fedsplit cox`` and ``fedsplit km``: the survival Flower app run in Flower's simulation engine.

Each hospital is a ``--site NAME=PATH`` table (``NAME=TRAIN:TEST``: the TRAIN file is used) or
a region of the bundled Fed-TCGA-BRCA (FLamby's training rows). Before any Flower process
starts, every hospital's time and event columns are read (`protocol.survival.check_hospitals`:
one error listing each hospital's problems and the fix) and the schema merge the hospitals will
run is checked. Each hospital's rows are written, as they came, under ``OUT/sites/site-i/``
(only its agent reads them); the coordinator (`server.survival.app`) writes ``OUT/cox.json`` or
``OUT/km.json``; here the forest plot (``cox.png``) or the curve (``km.png``) is drawn from it.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from fedsplit.client.data import read_table
from fedsplit.client.survival.tcga import DATASET, EVENT, ID, TIME, load_tcga_brca
from fedsplit.orchestration.flower_runtime import simulation
from fedsplit.orchestration.plots import figure
from fedsplit.orchestration.site_files import check_site_files
from fedsplit.orchestration.survival_summary import km_plot
from fedsplit.protocol import survival as sv
from fedsplit.protocol.column_sets import check_table_columns
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.survival import CoxDocument, KMDocument
from fedsplit.protocol.schema import column_report, merge_reports

#: the document a survival analysis writes: `KMDocument` or `CoxDocument`
D = TypeVar("D", KMDocument, CoxDocument)
#: the survival app's (serverapp, clientapp)
SURVIVAL_COMPONENTS = ("fedsplit.server.survival.app:app", "fedsplit.client.survival.app:app")
DATASETS = (DATASET,)


def survival_tables(dataset: str | None, site_files: Sequence[str]) -> dict[str, Any]:
    """Hospital name -> its rows as read (a DataFrame)."""
    if bool(dataset) == bool(site_files):
        raise ConfigError(f"Give either --dataset {DATASET} or one --site FILE per hospital, not "
                          f"both or neither. Received: dataset={dataset!r}, "
                          f"{len(site_files)} --site")
    if dataset:
        if dataset != DATASET:
            raise ConfigError(f"Survival datasets: {', '.join(DATASETS)}. Received: {dataset!r}")
        return {name: train for name, (train, _test) in load_tcga_brca().items()}
    sources = check_site_files(site_files)  # every file present: one line naming each hospital
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"Every hospital needs its own name; name them with --site NAME=PATH. "
                          f"Received: {names}")
    if len(sources) < 2:
        raise ConfigError(f"A federation needs at least 2 hospitals. Received: {names}")
    out = {}
    for s in sources:
        if s.train.suffix.lower() not in (".csv", ".parquet", ".pq"):
            raise ConfigError(f"Survival sites are CSV or Parquet tables. Received: {s.train}")
        out[s.name] = read_table(s.train)
    return out


def dataset_columns(dataset: str | None, time_col: str | None, event_col: str | None,
                    id_column: str) -> tuple[str, str, str]:
    """(time, event, id) columns: the dataset's own, or the ones given for --site tables."""
    if dataset == DATASET:
        for given, own, flag in ((time_col, TIME, "--time"), (event_col, EVENT, "--event")):
            if given not in (None, own):
                raise ConfigError(f"--dataset {DATASET} has time column {TIME!r} and event column "
                                  f"{EVENT!r}; leave {flag} unset. Received: {given!r}")
        return TIME, EVENT, id_column or ID
    if not time_col or not event_col:
        raise ConfigError("--site tables need --time COLUMN and --event COLUMN (the follow-up "
                          f"time and 1/0 event). Received: time={time_col!r}, event={event_col!r}")
    return time_col, event_col, id_column


def stage(run: sv.SurvivalRun, tables: dict[str, Any], out: Path) -> sv.SurvivalRun:
    """Check every hospital's survival columns and the schema merge; write each hospital's rows."""
    if run.mode == "cox":  # hospitals whose columns differ: the odd one(s) and both sides named
        check_table_columns({n: list(f.columns) for n, f in tables.items()},
                            run.table_settings)
    sv.check_hospitals(tables, run.time, run.event, run.missing_markers)
    if run.mode == "cox":
        settings = run.table_settings
        merged = merge_reports([column_report(n, f, settings) for n, f in tables.items()],
                               settings, task="regression")
        if not sv.cox_columns(merged.schema)[0]:
            raise ConfigError("No covariate is left for the Cox model: every column is the time, "
                              "the event, the ID or ignored. Received: 0 covariates")
    for i, frame in enumerate(tables.values()):
        folder = out / "sites" / f"site-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():  # a simulated hospital is made anew: its state too
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        frame.to_csv(folder / "data.csv", index=False)
    return sv.SurvivalRun(**{**run.model_dump(), "data_dir": str(out / "sites"),
                             "out_dir": str(out), "site_names": list(tables),
                             "min_nodes": len(tables)})


def run_survival(run: sv.SurvivalRun, document: type[D], *, dataset: str | None,
                 site_files: Sequence[str], out: Path, timeout: float = 1800) -> D:
    """Run ``run.mode`` ("cox" or "km") end to end; return its document (``cox.json`` or
    ``km.json``) read through ``document``, the mode's model (`CoxDocument` / `KMDocument`),
    with ``wall_seconds`` added."""
    if document.mode != run.mode:
        raise ConfigError(f"A {run.mode} run writes {run.mode}.json, not {document.file_name()}. "
                          f"Received: mode={run.mode!r}")
    out = out.resolve()
    tables = survival_tables(dataset, site_files)
    run = stage(run, tables, out)
    started = time.monotonic()
    simulation(run, len(tables), out / "flower", components=SURVIVAL_COMPONENTS,  # type: ignore[arg-type]
               timeout=timeout)
    doc = document.load(out / document.file_name())
    doc.wall_seconds = time.monotonic() - started
    doc.save(out / document.file_name())
    if isinstance(doc, CoxDocument):
        forest_plot(doc, out / "cox.png")
    else:
        km_plot(doc, out / "km.png")
    return doc


def forest_plot(doc: CoxDocument, path: Path) -> None:
    """Hazard ratios with their 95% intervals, one row per covariate (log scale); a covariate
    whose interval the fit could not give is drawn as its hazard ratio alone."""
    rows = list(doc.covariates.items())
    with figure(path, size=(7.5, 0.28 * len(rows) + 1.4), dpi=120) as ax:
        for i, (_, r) in enumerate(reversed(rows)):
            colour = "tab:red" if r.significant else "tab:blue"
            if r.hr_lower_95 is not None and r.hr_upper_95 is not None:
                lo, hi = max(r.hr_lower_95, 1e-6), min(r.hr_upper_95, 1e6)
                ax.plot([lo, hi], [i, i], color=colour, lw=1.5)
            ax.plot([r.hazard_ratio], [i], "s", color=colour, ms=4)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yticks(range(len(rows)), [n[:48] for n, _ in reversed(rows)], fontsize=7)
        ax.set_xlabel("hazard ratio (95% CI; red: p < 0.05)")
        c = doc.concordance
        ax.set_title(f"Federated Cox, stratified by hospital ({len(doc.hospitals)} hospitals, "
                     f"{doc.rows} patients, penalizer {doc.penalizer or 0.0:g}"
                     + (f", C = {c:.3f})" if c is not None and math.isfinite(c) else ")"),
                     fontsize=9)

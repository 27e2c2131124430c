"""The tables `fedsplit simulate` prints, laid out to read whole at 80 columns and in a pipe.

A federation is compared on two tables rather than one wide one:

- **per hospital**: a row per hospital (its test patients in brackets), then the mean over
  hospitals and the pooled test; a column per model as that hospital would use it: centralized,
  its own model alone, federated, and the personalized global model when there is one ("+ prior"
  or "+ tuned"). The width
  grows with the number of models, not with the number of hospitals.
- **models**: a row per model (centralized, each hospital alone, federated, personalized) with
  its training rows, the round it keeps and its validation score, and its mean per hospital and
  pooled score; each hospital-alone model's mean covers every hospital's test patients.
  Where the hospital-alone models were scored on their own test patients only (a federation of
  more than ``orchestration.experiment.CROSS_SCORED_SITES`` hospitals), they are one row, "each
  hospital alone": the mean of the hospitals' own scores.

Above `CONSOLE_SITES` hospitals the per-hospital table is not printed: `spread_table` (a row per
model: mean, min, median and max over the hospitals, and pooled) stands in for it, and
`write_site_table` writes every hospital's row to OUT/`SITE_TABLE_FILE` (written for every run).

Scores print with 3 decimals; every number is also in ``summary.json``, read here through
`protocol.record.summary.RunSummary` (a mapping is read through it first).
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsplit.orchestration.plots import metric_key
from fedsplit.protocol.record.summary import Baseline, FederatedScores, RunSummary, Scores
from rich import box
from rich.table import Table

__all__ = ["CONSOLE_SITES", "SITE_TABLE_FILE", "metric_key", "models_table",
           "per_hospital_table", "spread_table", "summary_tables", "write_site_table"]

_MISSING = "-"
#: Up to this many hospitals the console shows the per-hospital table (a row per hospital);
#: above, `spread_table`, and the rows are in OUT/`SITE_TABLE_FILE` only.
CONSOLE_SITES = 20
#: Every hospital's scores, a row per hospital and a column per model and metric (CSV).
SITE_TABLE_FILE = "per_site.csv"


def _summary(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    return summary if isinstance(summary, RunSummary) else RunSummary.from_json(dict(summary))


def _text(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else _MISSING


def _site_score(entry: Scores | None, site: str, key: str) -> str:
    return _text(entry.per_site.get(site, {}).get(key)) if entry is not None else _MISSING


def _federated_label(summary: RunSummary) -> str:
    opt = summary.server_opt
    return f"federated ({summary.strategy or 'fedavg'}{' + ' + opt.name if opt else ''})"


def _personalized_label(summary: RunSummary) -> str | None:
    tuned = summary.personalized
    if not tuned:
        return None
    return "federated + prior" if tuned.prior_test is not None else "federated + fine-tuned"


def _rounds_kept(entry: Scores, summary: RunSummary) -> str:
    """``KEPT of TOTAL``, TOTAL the rounds the model really had: the federated model's recorded
    rounds (an exact Newton fit takes its own number, not ``num-server-rounds``), a baseline's
    scored chunks (one for an exact fit), else the run config's rounds."""
    kept = getattr(entry, "rounds_kept", None)
    if kept is None:
        return _MISSING
    if isinstance(entry, Baseline) and entry.val_metric:
        total: Any = len(entry.val_metric)
    elif isinstance(entry, FederatedScores) and (entry.val_rounds or summary.rounds):
        total = max([*entry.val_rounds, *(r.round for r in summary.rounds)])
    else:
        total = summary.num_rounds
    return f"{kept} of {total}" if total else str(kept)


def _site_columns(summary: RunSummary) -> list[tuple[str, Scores | None]]:
    """The per-hospital models, labelled: centralized, alone (each hospital's own: None),
    federated, and the personalized model when there is one; a baseline not trained
    (``--baselines``) has no column."""
    columns: list[tuple[str, Scores | None]] = [
        *[("centralized", summary.centralized)] * (summary.centralized is not None),
        *[("alone", None)] * bool(summary.local_only), ("federated", summary.federated)]
    tuned_label = _personalized_label(summary)
    if tuned_label:
        columns.append((tuned_label.replace("federated + fine-tuned", "+ tuned")
                        .replace("federated ", ""), summary.personalized))
    return columns


def _site_scores(summary: RunSummary, label: str, entry: Scores | None
                 ) -> dict[str, dict[str, float]]:
    """A column's scores per hospital (``alone``: each hospital's own model on its rows)."""
    if label == "alone":
        return {str(b.site): b.per_site[str(b.site)] for b in summary.local_only
                if str(b.site) in b.per_site}
    return dict(entry.per_site) if entry is not None else {}


def write_site_table(summary: RunSummary | Mapping[str, Any], path: Path) -> Path:
    """Every hospital's test rows and scores, one row per hospital, a column ``MODEL:METRIC``
    per model of the per-hospital table and metric (empty where a model has no score); a
    federation of any size (the console shows it up to `CONSOLE_SITES` hospitals)."""
    summary = _summary(summary)
    columns = [(label, _site_scores(summary, label, entry))
               for label, entry in _site_columns(summary)]
    keys = sorted({k for _, scores in columns for m in scores.values() for k in m})
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["hospital", "test_patients",
                         *(f"{label}:{k}" for label, scores in columns if scores for k in keys)])
        for name, rows in summary.test_examples_per_site.items():
            writer.writerow([name, rows, *(scores.get(name, {}).get(k, "")
                                           for _, scores in columns if scores for k in keys)])
    return path


def spread_table(summary: RunSummary | Mapping[str, Any], path: Path | None = None) -> Table:
    """A row per model: its test score's mean, min, median and max over the hospitals' own test
    patients, and pooled; what the console shows instead of `per_hospital_table` for a
    federation of more than `CONSOLE_SITES` hospitals (``path``: where their rows are)."""
    summary = _summary(summary)
    key = metric_key(summary)
    hospitals = len(summary.test_examples_per_site)
    table = Table(title=f"Test {key} over {hospitals} hospitals' own test patients",
                  box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False,
                  caption=f"every hospital's row: {path}" if path else None,
                  caption_justify="left")
    table.add_column("model", no_wrap=True)
    for header in ("hospitals", "mean", "min", "median", "max", "pooled"):
        table.add_column(header, justify="right")
    for label, entry in _site_columns(summary):
        values = [m[key] for m in _site_scores(summary, label, entry).values() if key in m]
        if not values:
            continue
        table.add_row(label, str(len(values)), _text(statistics.fmean(values)),
                      _text(min(values)), _text(statistics.median(values)), _text(max(values)),
                      _text(entry.metrics.get(key)) if entry is not None else _MISSING)
    return table


def per_hospital_table(summary: RunSummary | Mapping[str, Any]) -> Table:
    """Hospitals as rows, models as columns: each hospital's own test patients."""
    summary = _summary(summary)
    key = metric_key(summary)
    per_site = summary.test_examples_per_site
    alone: dict[str, Baseline] = {str(entry.site): entry for entry in summary.local_only}
    table = Table(title=f"Test {key} on each hospital's own test patients", box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False)
    table.add_column("hospital (test patients)", no_wrap=True)
    columns = _site_columns(summary)
    for label, _ in columns:
        table.add_column(label, justify="right", overflow="fold")
    for name, rows in per_site.items():
        cells = []
        for label, entry in columns:
            source = alone.get(name) if label == "alone" else entry
            cells.append(_site_score(source, name, key))
        table.add_row(f"{name} ({rows})", *cells)
    mean_cells, pooled_cells = [], []
    for label, entry in columns:
        if label == "alone":
            own = [alone[n].per_site[n][key] for n in per_site
                   if n in alone and key in alone[n].per_site.get(n, {})]
            mean_cells.append(f"{sum(own) / len(own):.3f}" if own and len(own) == len(per_site)
                              else _MISSING)
            pooled_cells.append(_MISSING)
        else:
            mean_cells.append(_text(entry.mean_per_site.get(key)) if entry else _MISSING)
            pooled_cells.append(_text(entry.metrics.get(key)) if entry else _MISSING)
    table.add_section()
    table.add_row("mean per hospital", *mean_cells)
    pooled = summary.test_examples if summary.test_examples is not None else sum(per_site.values())
    table.add_row(f"pooled ({pooled})", *pooled_cells)
    return table


def models_table(summary: RunSummary | Mapping[str, Any]) -> Table:
    """Models as rows: training rows, kept round and validation score, mean and pooled test."""
    summary = _summary(summary)
    key = metric_key(summary)
    table = Table(title=f"Models (test {key})", box=box.SIMPLE_HEAD, title_justify="left",
                  pad_edge=False, caption=f"rows: training rows; kept: the round kept (by validation "
                  f"{key}, val); mean: over hospitals' own test patients; pooled: all test patients",
                  caption_justify="left")
    table.add_column("model", no_wrap=True)
    for header in ("rows", "kept", "val", "mean", "pooled"):
        table.add_column(header, justify="right", overflow="fold")

    def row(label: str, entry: Scores | None, style: str | None = None) -> None:
        if entry is None:
            return
        curve = getattr(entry, "val_metric", None) or []  # the validation curve
        kept = getattr(entry, "rounds_kept", None)
        numbers = getattr(entry, "val_rounds", None) or range(1, len(curve) + 1)  # its rounds
        val = dict(zip(numbers, curve, strict=False)).get(kept) if isinstance(kept, int) else None
        rows = getattr(entry, "num_examples", None)
        table.add_row(label, str(rows if rows is not None else _MISSING),
                      _rounds_kept(entry, summary), _text(val),
                      _text(entry.mean_per_site.get(key)), _text(entry.metrics.get(key)),
                      style=style)

    row("centralized (pooled data)", summary.centralized)
    own_only = len(summary.test_examples_per_site) > 1 and all(
        len(entry.per_site) == 1 for entry in summary.local_only)
    if own_only and summary.local_only:  # each scored on its own test patients: one row
        own = [m[key] for m in _site_scores(summary, "alone", None).values() if key in m]
        table.add_row(f"each hospital alone ({len(summary.local_only)}, own test)",
                      str(sum(entry.num_examples or 0 for entry in summary.local_only)),
                      _MISSING, _MISSING, _text(statistics.fmean(own) if own else None),
                      _MISSING)
    for entry in [] if own_only else summary.local_only:
        row(f"{entry.site} alone", entry)
    row(_federated_label(summary), summary.federated, style="bold")
    tuned_label = _personalized_label(summary)
    if tuned_label:
        row(tuned_label, summary.personalized, style="bold")
    return table


def summary_tables(summary: RunSummary | Mapping[str, Any], site_table: Path | None = None
                   ) -> list[Table]:
    """Both tables, in print order: the per-hospital one up to `CONSOLE_SITES` hospitals, else
    `spread_table` (``site_table``: the file with every hospital's row, named in its caption)."""
    summary = _summary(summary)
    many = len(summary.test_examples_per_site) > CONSOLE_SITES
    return [spread_table(summary, site_table) if many else per_hospital_table(summary),
            models_table(summary)]

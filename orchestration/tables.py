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

Scores print with 3 decimals; every number is also in ``summary.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.table import Table

__all__ = ["metric_key", "models_table", "per_hospital_table", "summary_tables"]

_MISSING = "-"


def metric_key(summary: Mapping[str, Any]) -> str:
    """The metric the tables show: the run's selection metric (accuracy, r2, c_index, ...)."""
    named = summary.get("selection_metric")
    if isinstance(named, str) and named:
        return named
    return "accuracy" if summary.get("task") == "classification" else "r2"


def _score(entry: Mapping[str, Any] | None, *path: str, key: str) -> str:
    node: Any = entry
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    value = node.get(key) if isinstance(node, Mapping) else None
    return f"{value:.3f}" if isinstance(value, int | float) else _MISSING


def _federated_label(summary: Mapping[str, Any]) -> str:
    opt = summary.get("server_opt")
    return f"federated ({summary.get('strategy', 'fedavg')}{' + ' + opt['name'] if opt else ''})"


def _personalized_label(summary: Mapping[str, Any]) -> str | None:
    tuned = summary.get("personalized")
    if not tuned:
        return None
    return "federated + prior" if "prior_test" in tuned else "federated + fine-tuned"


def _rounds_kept(entry: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    kept = entry.get("rounds_kept")
    if kept is None:
        return _MISSING
    total = summary.get("rounds") if isinstance(summary.get("rounds"), int) else None
    total = total or (summary.get("config") or {}).get("num-server-rounds")
    return f"{kept} of {total}" if total else str(kept)


def per_hospital_table(summary: Mapping[str, Any]) -> Table:
    """Hospitals as rows, models as columns: each hospital's own test patients."""
    key = metric_key(summary)
    per_site: Mapping[str, int] = summary["test_examples_per_site"]
    alone = {entry["site"]: entry for entry in summary.get("local_only", [])}
    tuned_label = _personalized_label(summary)
    table = Table(title=f"Test {key} on each hospital's own test patients", box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False)
    table.add_column("hospital (test patients)", no_wrap=True)
    columns = [("centralized", summary.get("centralized")), ("alone", None),
               ("federated", summary.get("federated"))]
    if tuned_label:
        columns.append((tuned_label.replace("federated + fine-tuned", "+ tuned")
                        .replace("federated ", ""), summary.get("personalized")))
    for label, _ in columns:
        table.add_column(label, justify="right", overflow="fold")
    for name, rows in per_site.items():
        cells = []
        for label, entry in columns:
            source = alone.get(name) if label == "alone" else entry
            cells.append(_score(source, "per_site", name, key=key))
        table.add_row(f"{name} ({rows})", *cells)
    mean_cells, pooled_cells = [], []
    for label, entry in columns:
        if label == "alone":
            own = [alone[n]["per_site"][n][key] for n in per_site
                   if n in alone and key in alone[n].get("per_site", {}).get(n, {})]
            mean_cells.append(f"{sum(own) / len(own):.3f}" if own and len(own) == len(per_site)
                              else _MISSING)
            pooled_cells.append(_MISSING)
        else:
            mean_cells.append(_score(entry, "mean_per_site", key=key))
            pooled_cells.append(_score(entry, "metrics", key=key))
    table.add_section()
    table.add_row("mean per hospital", *mean_cells)
    table.add_row(f"pooled ({summary.get('test_examples', sum(per_site.values()))})", *pooled_cells)
    return table


def models_table(summary: Mapping[str, Any]) -> Table:
    """Models as rows: training rows, kept round and validation score, mean and pooled test."""
    key = metric_key(summary)
    table = Table(title=f"Models (test {key})", box=box.SIMPLE_HEAD, title_justify="left",
                  pad_edge=False, caption=f"rows: training rows; kept: the round kept (by validation "
                  f"{key}, val); mean: over hospitals' own test patients; pooled: all test patients",
                  caption_justify="left")
    table.add_column("model", no_wrap=True)
    for header in ("rows", "kept", "val", "mean", "pooled"):
        table.add_column(header, justify="right", overflow="fold")

    def row(label: str, entry: Mapping[str, Any] | None, style: str | None = None) -> None:
        if not entry:
            return
        val = entry.get("val_metric")
        if isinstance(val, list):  # the validation curve: the kept round's score
            kept = entry.get("rounds_kept")
            val = val[kept - 1] if isinstance(kept, int) and 0 < kept <= len(val) else None
        val_text = f"{val:.3f}" if isinstance(val, int | float) else _MISSING
        table.add_row(label, str(entry.get("num_examples", _MISSING)), _rounds_kept(entry, summary),
                      val_text, _score(entry, "mean_per_site", key=key),
                      _score(entry, "metrics", key=key), style=style)

    row("centralized (pooled data)", summary.get("centralized"))
    for entry in summary.get("local_only", []):
        row(f"{entry['site']} alone", entry)
    row(_federated_label(summary), summary.get("federated"), style="bold")
    tuned_label = _personalized_label(summary)
    if tuned_label:
        row(tuned_label, summary.get("personalized"), style="bold")
    return table


def summary_tables(summary: Mapping[str, Any]) -> list[Table]:
    """Both tables, in print order."""
    return [per_hospital_table(summary), models_table(summary)]

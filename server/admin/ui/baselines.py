"""The per-hospital table of a run's ``summary.json``: each hospital's own test patients scored by
the centralized model, its own model alone, the federated model (and the fine-tuned copies), in
the run's metric (accuracy, r2, the C-index of a survival run, ...).

The same table `fedsplit simulate` prints (orchestration/tables.py, ``per_hospital_table``):
hospitals as rows, models as columns, then the mean over hospitals and the pooled test rows.
A hospital's token sees its own row without the centralized column (the view shows hospitals
no centralized baseline), and neither the mean nor the pooled row: with two hospitals, the
mean or the pooled count less its own would be the other hospital's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsplit.protocol.record.summary import RunSummary, Scores

#: How metric keys read on the page (any other key is shown as recorded).
METRIC_LABELS = {"c_index": "C-index"}


def metric_label(key: str | None) -> str:
    """A metric key as the page names it (``c_index`` -> ``C-index``)."""
    return METRIC_LABELS.get(key, key) if key else ""


@dataclass
class BaselineRow:
    """One line of the table: a hospital (with its test rows), the mean, or the pooled rows."""

    label: str
    examples: int | None
    cells: list[float | None]
    total: bool = False


@dataclass
class BaselineTable:
    """Columns (model names) and rows, in ``metric``."""

    metric: str
    columns: list[str]
    rows: list[BaselineRow]


def _score(entry: Scores | None, site: str, key: str) -> float | None:
    return entry.per_site.get(site, {}).get(key) if entry is not None else None


def baseline_table(summary: RunSummary | None, metric: str | None,
                   visible: set[str] | None = None) -> BaselineTable | None:
    """The table for ``metric``; ``visible``: the hospitals a token may see (None: the admin).
    None when the summary scores no hospital in ``metric``."""
    if summary is None or metric is None:
        return None
    admin = visible is None
    scored = [summary.centralized, summary.federated, summary.personalized, *summary.local_only]
    names = list(summary.test_examples_per_site) or sorted(
        {site for entry in scored if entry is not None for site in entry.per_site})
    alone = {str(entry.site): entry for entry in summary.local_only}
    columns: list[tuple[str, Scores | None]] = []
    if admin:
        columns.append(("centralized", summary.centralized))
    columns += [("alone", None), ("federated", summary.federated)]
    if summary.personalized is not None:
        columns.append(("federated + tuned", summary.personalized))
    rows = [BaselineRow(name, summary.test_examples_per_site.get(name),
                        [_score(alone.get(name) if label == "alone" else entry, name, metric)
                         for label, entry in columns])
            for name in names if admin or name in visible]  # type: ignore[operator]
    if not any(cell is not None for row in rows for cell in row.cells):
        return None
    if admin:
        mean: list[float | None] = []
        pooled: list[float | None] = []
        for label, entry in columns:
            if label == "alone":
                own = [alone[n].per_site[n][metric] for n in names
                       if n in alone and metric in alone[n].per_site.get(n, {})]
                mean.append(sum(own) / len(own) if own and len(own) == len(names) else None)
                pooled.append(None)
            else:
                mean.append(entry.mean_per_site.get(metric) if entry else None)
                pooled.append(entry.metrics.get(metric) if entry else None)
        total = summary.test_examples
        if total is None and summary.test_examples_per_site:
            total = sum(summary.test_examples_per_site.values())
        rows += [BaselineRow("mean per hospital", None, mean, total=True),
                 BaselineRow("pooled test rows", total, pooled, total=True)]
    return BaselineTable(metric=metric, columns=[label for label, _ in columns], rows=rows)

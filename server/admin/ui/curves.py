"""The curves of a Flower run: global metric against baselines, per hospital, privacy spent.

Differential privacy (documented in docs/web-view.md): a hospital's cumulative epsilon is read
from its training entry in ``history.json`` (`protocol.record.horizontal.SiteEntry.spent_epsilon`:
``rounds[].train.sites[].epsilon`` or ``rounds[].train.sites[].metrics.epsilon``); the budget
from ``summary.json``'s ``privacy.epsilon_budget`` or the run config's ``dp`` string
(``epsilon=E,delta=D,...``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsplit.protocol.horizontal_wire import TRAIN_LOSS
from fedsplit.protocol.recipe import model_selection
from fedsplit.protocol.record.privacy import SummaryPrivacy
from fedsplit.protocol.tasks import task_kind, task_names
from fedsplit.server.admin.ui.baselines import metric_label
from fedsplit.server.admin.ui.charts import Chart, Series, line_chart, survival_chart
from fedsplit.server.admin.ui.runs import FlowerRun


def preferred_metrics() -> tuple[str, ...]:
    """The metrics a run without a known selection metric is judged by, in order: every task
    kind's selection metric (`protocol.tasks`: accuracy, r2, c_index, ...), then their other
    metrics, then the loss."""
    kinds = [task_kind(name) for name in task_names()]
    return tuple(dict.fromkeys([k.selection for k in kinds] + [m for k in kinds for m in k.metrics]
                               + ["loss"]))


def primary_metric(run: FlowerRun) -> str | None:
    """The metric the run is judged by: its model's selection metric (its model id names it,
    `protocol.recipe`: a recipe's own, else its task kind's), else the first recorded of
    `preferred_metrics`, else the first one recorded."""
    keys: set[str] = set()
    for rnd in run.rounds:
        keys |= set(rnd.metrics) | set(rnd.test_metrics)
    if (selection := model_selection(run.model_id)) in keys:
        return selection
    return next((k for k in preferred_metrics() if k in keys), min(keys) if keys else None)


def epsilon_budget(run: FlowerRun, privacy: SummaryPrivacy | None = None) -> float | None:
    """The run's epsilon budget, when DP is on (see the module docstring)."""
    if privacy is not None and privacy.epsilon_budget is not None:
        return privacy.epsilon_budget
    dp = run.config.get("dp")
    if isinstance(dp, str):
        for part in dp.split(","):
            key, _, value = part.partition("=")
            if key.strip() == "epsilon":
                try:
                    return float(value)
                except ValueError:
                    return None
    return None


@dataclass
class Privacy:
    """Epsilon spent per hospital (latest round) and the budget, when DP is on."""

    spent: dict[str, float]
    budget: float | None

    @property
    def left(self) -> dict[str, float | None]:
        """Budget left per hospital (None when no budget is recorded)."""
        return {s: (self.budget - e if self.budget is not None else None) for s, e in self.spent.items()}


def privacy_of(run: FlowerRun, visible: set[str] | None = None) -> Privacy | None:
    """The privacy table, or None when no round records an epsilon."""
    spent: dict[str, float] = {}
    for rnd in run.rounds:
        for row in rnd.rows:
            if row.epsilon is not None and (visible is None or row.site in visible):
                spent[row.site] = row.epsilon
    if not spent:
        return None
    privacy = run.summary.privacy if run.summary else None
    return Privacy(spent=dict(sorted(spent.items())), budget=epsilon_budget(run, privacy))


def run_charts(run: FlowerRun, visible: set[str] | None = None) -> list[Chart]:
    """The run's charts; ``visible`` limits per-hospital lines (None: every hospital)."""
    charts: list[Chart] = []
    metric = primary_metric(run)
    first = min((r.number for r in run.rounds), default=1)
    last = max((r.number for r in run.rounds), default=1)
    if metric is not None:
        series = [
            Series("federated, held-out test split",
                   [(r.number, r.test_metrics[metric]) for r in run.rounds if metric in r.test_metrics]),
            Series("federated evaluation on the hospitals' held-out rows",
                   [(r.number, r.metrics[metric]) for r in run.rounds if metric in r.metrics]),
        ]
        baselines: list[Series] = []
        summary = run.summary
        central = summary.centralized if summary and visible is None else None
        if central is not None and metric in central.metrics:
            value = central.metrics[metric]
            baselines.append(Series("centralized (pooled data)",
                                    [(first, value), (last, value)], dashed=True))
        for local in summary.local_only if summary else []:
            if visible is not None and local.site not in visible:
                continue
            if (value := local.metrics.get(metric)) is not None:
                baselines.append(Series(f"{local.site} alone", [(first, value), (last, value)],
                                        dashed=True))
        chart = line_chart(f"Global {metric_label(metric)} per round", series, baselines=baselines)
        if chart is not None:
            charts.append(chart)
    sites = [s for s in run.sites if visible is None or s in visible]
    if metric is not None:
        per_site = [Series(site, [(r.number, row.eval_metrics[metric]) for r in run.rounds
                                  for row in r.rows if row.site == site and metric in row.eval_metrics])
                    for site in sites]
        chart = line_chart(f"Each hospital's {metric_label(metric)} on its own held-out rows", per_site)
        if chart is not None:
            charts.append(chart)
    losses = [Series(site, [(r.number, row.metrics[TRAIN_LOSS]) for r in run.rounds
                            for row in r.rows if row.site == site and TRAIN_LOSS in row.metrics])
              for site in sites]
    chart = line_chart("Each hospital's training loss", losses)
    if chart is not None:
        charts.append(chart)
    privacy = privacy_of(run, visible)
    if privacy is not None:
        eps = [Series(site, [(r.number, row.epsilon) for r in run.rounds for row in r.rows
                             if row.site == site and row.epsilon is not None])
               for site in sites]
        budget = ([Series("budget", [(first, privacy.budget), (last, privacy.budget)], dashed=True)]
                  if privacy.budget is not None else [])
        chart = line_chart("Privacy spent (epsilon) per hospital", eps, baselines=budget)
        if chart is not None:
            charts.append(chart)
    return charts


def km_chart(run: FlowerRun, visible: set[str] | None = None) -> Chart | None:
    """The pooled Kaplan-Meier curve of the run's ``km.json`` (None: none, or not readable).

    ``visible`` set (a hospital's token): no pooled count (patients, events, numbers at risk)
    in the title or the tooltips, as the view shows hospitals no aggregate count (with two
    hospitals, the pooled count less its own is the other's); the curve and its band stay."""
    if run.km is None or run.km.doc is None:
        return None
    doc = run.km.doc
    curve = doc.curve
    pairs = zip(curve.at_risk, curve.events, strict=True)
    if visible is not None:
        counts = None
        title = "Kaplan-Meier: pooled survival of every hospital's patients"
    else:
        title = f"Kaplan-Meier: pooled survival of {doc.rows:,} patients ({doc.events:,} events)"
        counts = ([f"{d} events since the previous point, {n} at risk at the first of them"
                   for n, d in pairs] if doc.min_count > 1
                  else [f"{n} at risk, {d} events" for n, d in pairs])
    return survival_chart(title, curve.time, curve.survival, curve.lower_95, curve.upper_95,
                          label="survival, every hospital's patients pooled", counts=counts,
                          x_label="time (the unit of the time column)")

"""``fedsplit cox``: the exact federated Cox model (stratified by hospital) with hazard ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.cli.options import (
    Event,
    IdColumn,
    IgnoreColumn,
    MinCategoryCount,
    NaValues,
    SecureAggregation,
    Time,
    split_values,
)
from fedsplit.cli.survival_options import SurvivalDataset, SurvivalSites, run_analysis
from rich.console import Console
from rich.table import Table

console = Console()


def cox(
    dataset: SurvivalDataset = None,
    site: SurvivalSites = None,
    time: Time = "",
    event: Event = "",
    id_column: IdColumn = "",
    ignore_column: IgnoreColumn = None,
    na_values: NaValues = None,
    min_category_count: MinCategoryCount = 5,
    penalizer: Annotated[float, typer.Option(min=0.0, help="Ridge penalty, lifelines' convention "
                                                           "(n * P * ||b||^2 / 2 on standardized "
                                                           "coefficients).")] = 0.0,
    secure_aggregation: SecureAggregation = "none",
    out: Annotated[Path, typer.Option(help="Output folder: cox.json, cox.png.")] = Path("runs/cox"),
) -> None:
    """Newton-Raphson on the hospitals' summed gradients and Hessians: the pooled stratified fit."""
    from fedsplit.orchestration.survival.run import dataset_columns
    from fedsplit.protocol.record.survival import COX_FILE, CoxDocument
    from fedsplit.protocol.survival import SurvivalRun

    time_col, event_col, id_col = dataset_columns(dataset, time or None, event or None, id_column)
    run = SurvivalRun(mode="cox", time=time_col, event=event_col, out_dir=str(out),
                      id_column=id_col, ignore_columns=tuple(split_values(ignore_column)),
                      na_values=tuple(split_values(na_values)), penalizer=penalizer,
                      min_category_count=min_category_count,
                      secure_aggregation=secure_aggregation)
    doc = run_analysis(run, CoxDocument, dataset=dataset, site=site, out=out, console=console,
                       doing="fitting the federated Cox model ...")
    table = Table(title=f"Cox model stratified by hospital: {len(doc.hospitals)} hospitals, "
                        f"{doc.rows} patients, {doc.events} events")
    for column in ("covariate", "coef", "HR", "95% CI", "p"):
        table.add_column(column, justify="left" if column == "covariate" else "right")
    for name, r in doc.covariates.items():
        table.add_row(name, f"{r.coef:.4f}", _number(r.hazard_ratio, ".3f"),
                      f"{_number(r.hr_lower_95, '.3f')}-{_number(r.hr_upper_95, '.3f')}",
                      _number(r.p, ".3g"))
    console.print(table)
    console.print(f"log-likelihood {_number(doc.log_likelihood, '.4f')} after {doc.newton_rounds} "
                  f"Newton rounds; concordance {_number(doc.concordance, '.4f')}; secure "
                  f"aggregation {doc.secure_aggregation}; {doc.wall_seconds or 0.0:.1f} s")
    console.print(f"wrote {out / COX_FILE} and {out / 'cox.png'}")


def _number(value: float | None, spec: str) -> str:
    """``value`` formatted, or n/a where the fit gave none."""
    return "n/a" if value is None else format(value, spec)

"""``fedsplit km``: the pooled Kaplan-Meier curve from the hospitals' summed counts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.cli.options import Event, NaValues, SecureAggregation, Time, split_values
from fedsplit.cli.survival_options import SurvivalDataset, SurvivalSites, run_analysis
from rich.console import Console

console = Console()


def km(
    dataset: SurvivalDataset = None,
    site: SurvivalSites = None,
    time: Time = "",
    event: Event = "",
    na_values: NaValues = None,
    min_count: Annotated[int, typer.Option(min=1, help="Minimum-count rule: each drop of the "
                                                       "published curve gathers at least this many "
                                                       "events and the curve stops where fewer "
                                                       "patients are at risk (1 = every event "
                                                       "time).")] = 5,
    secure_aggregation: SecureAggregation = "none",
    out: Annotated[Path, typer.Option(help="Output folder: km.json, km.png.")] = Path("runs/km"),
) -> None:
    """Each hospital shares its number at risk and its events per time point; nothing else."""
    from fedsplit.orchestration.survival.run import dataset_columns
    from fedsplit.protocol.record.survival import KM_FILE, KMDocument
    from fedsplit.protocol.survival import SurvivalRun

    time_col, event_col, _ = dataset_columns(dataset, time or None, event or None, "")
    run = SurvivalRun(mode="km", time=time_col, event=event_col, out_dir=str(out),
                      na_values=tuple(split_values(na_values)), min_count=min_count,
                      secure_aggregation=secure_aggregation)
    doc = run_analysis(run, KMDocument, dataset=dataset, site=site, out=out, console=console,
                       doing="pooling the Kaplan-Meier counts ...")
    curve = doc.curve
    console.print(f"Kaplan-Meier over {len(doc.hospitals)} hospitals: {doc.rows} patients, "
                  f"{doc.events} events, {len(curve.time)} published drops (min-count "
                  f"{doc.min_count}); secure aggregation {doc.secure_aggregation}; "
                  f"{doc.wall_seconds or 0.0:.1f} s")
    for q in (0.25, 0.5, 0.75):
        below = [t for t, s in zip(curve.time, curve.survival, strict=True) if s <= 1 - q]
        if below:
            console.print(f"  {int(q * 100)}% have had the event by time {below[0]:g}")
    console.print(f"wrote {out / KM_FILE} and {out / 'km.png'}; each hospital's own curve "
                  f"stays beside its data (sites/site-i/km-own.json)")

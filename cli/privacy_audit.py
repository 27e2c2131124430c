"""``fedsplit privacy-audit RUN_DIR``: membership inference against a simulated run's model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from fedsplit.protocol.record.privacy import MembershipGroup

console = Console()


def _row(table: Table, name: str, group: MembershipGroup) -> None:
    low, high = group.ci95
    table.add_row(name, group.attack, f"{group.auc:.3f} [{low:.3f}, {high:.3f}]",
                  f"{group.tpr_at_1pct_fpr:.3f}", f"{group.members} / {group.non_members}")


def privacy_audit(
    run_dir: Annotated[Path, typer.Argument(help="A `fedsplit simulate --out` folder.")],
    references: Annotated[
        int, typer.Option(min=2, help="Reference models per hospital for the calibrated attack "
                                      "(an even number: one per half of its training rows).")
    ] = 2,
) -> None:
    """Attack the run's global model per hospital and pooled (training vs held-out rows); write
    privacy.json."""
    import torch
    from fedsplit.orchestration.privacy_audit import privacy_audit as run_audit

    torch.set_num_threads(1)
    result = run_audit(run_dir, references=references)
    table = Table(title="Membership inference (AUC 0.5 = nothing learned; [95% CI])")
    for col in ("rows", "stronger attack", "AUC [95% CI]", "TPR at 1% FPR", "members / held-out"):
        table.add_column(col, justify="left" if col in ("rows", "stronger attack") else "right")
    for name, site in result.per_site.items():
        _row(table, name, site)
    fed, head, worst = result.federation, result.headline, result.worst_site
    if fed is not None:
        table.add_section()
        _row(table, "federation (all hospitals)", fed)
    console.print(table)
    if fed is not None and head is not None and worst is not None:
        console.print(f"membership AUC (federation, {head.attack}, the stronger of "
                      f"{len(fed.attacks)} attacks): [bold]{head.auc:.3f}[/] "
                      f"[{head.ci95[0]:.3f}, {head.ci95[1]:.3f}]; worst hospital {worst.site} "
                      f"{worst.auc:.3f} [{worst.ci95[0]:.3f}, {worst.ci95[1]:.3f}] (a maximum "
                      f"over hospitals and attacks, biased upwards)")
    console.print(f"wrote {run_dir / 'privacy.json'}, {run_dir / 'privacy-roc.png'}")

"""``fedsplit privacy-audit RUN_DIR``: membership inference against a simulated run's model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def privacy_audit(
    run_dir: Annotated[Path, typer.Argument(help="A `fedsplit simulate --out` folder.")],
    references: Annotated[
        int, typer.Option(min=1, help="Reference models per hospital for the calibrated attack.")
    ] = 2,
) -> None:
    """Attack the run's global model per hospital (training vs held-out rows); write privacy.json."""
    import torch

    from orchestration.privacy_audit import privacy_audit as run_audit

    torch.set_num_threads(1)
    result = run_audit(run_dir, references=references)
    table = Table(title="Membership inference (0.5 = nothing learned)")
    for col in ("hospital", "attack", "AUC", "TPR at 1% FPR", "members / held-out"):
        table.add_column(col, justify="left" if col in ("hospital", "attack") else "right")
    for name, site in result["per_site"].items():
        table.add_row(name, site["attack"], f"{site['auc']:.3f}", f"{site['tpr_at_1pct_fpr']:.3f}",
                      f"{site['members']} / {site['non_members']}")
    console.print(table)
    console.print(f"wrote {run_dir / 'privacy.json'}, {run_dir / 'privacy-roc.png'}")

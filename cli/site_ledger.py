"""``fedsplit site ledger``: what each of this hospital's data files has spent, from its own
privacy ledger (`client.privacy.ledger`; docs/privacy.md, "The hospital's privacy ledger")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def ledger(
    state_dir: Annotated[Path, typer.Option(help="The hospital's state folder (fedsplit site run "
                                                 "--state-dir; in fedsplit simulate, "
                                                 "OUT/sites/site-N/hospital-state).")],
    policy: Annotated[Path | None, typer.Option(help="The hospital's policy file: its dp_budget "
                                                     "(default: the budget recorded with each "
                                                     "file).")] = None,
) -> None:
    """Print, per data file: DP-SGD trainings, runs, epsilon spent (at the budget's delta), the
    budget and what is left, and the plain (non-DP) trainings."""
    from fedsplit.client.privacy.ledger import ledger_view
    from fedsplit.protocol.dp_ledger import LEDGER_FILE
    from fedsplit.protocol.site_policy import SitePolicy

    budget = SitePolicy.load(policy).dp_budget if policy is not None else None
    rows = ledger_view(state_dir, budget)
    typer.echo(f"Privacy ledger {state_dir / LEDGER_FILE}: {len(rows)} data file(s)")
    width = max([len("data file"), *(len(r.path) for r in rows)])
    typer.echo(f"{'data file':<{width}}  {'DP trainings':>12}  {'runs':>4}  {'epsilon':>8}  "
               f"{'delta':>7}  {'budget':>7}  {'left':>7}  {'plain trainings':>15}")
    for r in rows:
        budget_text = "none" if r.budget is None else f"{r.budget:g}"
        left = "-" if r.left is None else f"{r.left:.4f}"
        typer.echo(f"{r.path:<{width}}  {r.trainings:>12}  {r.runs:>4}  {r.epsilon:>8.4f}  "
                   f"{r.delta:>7g}  {budget_text:>7}  {left:>7}  {r.plain_trainings:>15}")

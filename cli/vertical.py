"""``fedsplit vertical``: sites with different columns of the same patients (embedding fusion).

- ``simulate``: PSI alignment, split training in Flower's simulation engine (one ClientApp per
  site), baselines (each site alone, one centralized model on all columns), summary.json and
  rounds.png.
- ``compare-fills``: the partial-overlap fills side by side (in-process runs of the same code).
- ``predict``: score new rows with a trained run's branches and head, aligned by PSI.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from fedsplit.cli.options import Lr, Rounds, Seed
from fedsplit.protocol.selection import selection_metric
from fedsplit.protocol.tasks import task_kind
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from fedsplit.protocol.record.vertical import VerticalSummary

console = Console()
app = typer.Typer(help="Vertical federated learning: same patients, different columns per site.",
                  no_args_is_help=True)


def print_summary(summary: VerticalSummary) -> None:
    """Each site alone, fused, centralized."""
    keys = list(task_kind(summary.task).metrics)  # the task kind's: accuracy; r2, rmse
    rounds = len(summary.rounds)

    def cells(metrics: dict[str, Any], style: str = "") -> list[str]:
        end = "[/]" if style else ""
        return [f"{style}{metrics[k]:.4f}{end}" for k in keys]

    table = Table(title=f"Held-out split ({summary.test_examples} rows)")
    table.add_column("model")
    table.add_column("training rows", justify="right")
    table.add_column("rounds kept", justify="right")
    for k in keys:
        table.add_column(k, justify="right")
    for s in summary.local_only:
        table.add_row(f"{s.site} alone", str(s.num_examples), f"{s.rounds_kept} of {rounds}",
                      *cells(s.metrics))
    fed = summary.federated
    if fed is not None:
        kept = fed.rounds_kept if fed.rounds_kept is not None else rounds
        table.add_row("[bold]fused (federated)[/]", str(summary.train_rows), f"{kept} of {rounds}",
                      *cells(fed.metrics, "[bold]"))
    c = summary.centralized
    if c is not None:
        table.add_row("centralized (all columns)", str(c.num_examples), f"{c.rounds_kept} of {rounds}",
                      *cells(c.metrics))
    console.print(table)
    if (summary.keep or "best-val") == "last":
        console.print("the fused model keeps its last round (--keep last); the baselines (the "
                      "federation's steps) the round that scores best on validation rows cut from "
                      "the label holder's training rows (docs/vertical.md)")
    else:
        console.print("every model, fused and baselines (the federation's steps), keeps the round "
                      "that scores best on validation rows cut from the label holder's training "
                      "rows, ties to the later round (--keep best-val; docs/vertical.md)")
    for o in summary.overlap:
        console.print(f"overlap {o.site}: {o.shared} of {o.label_rows} labelled patients "
                      f"({o.share_of_labels or 0:.0%}){' [yellow]LOW[/]' if o.status == 'low' else ''}")


@app.command("simulate")
def simulate(
    out: Annotated[Path, typer.Option(help="Output directory (summary.json, rounds.png, models).")],
    site: Annotated[list[Path] | None, typer.Option("--site", help="A site's CSV/Parquet (repeat).")] = None,
    labels: Annotated[Path | None, typer.Option(help="Label holder's file: ID column + target.")] = None,
    id_column: Annotated[str, typer.Option(help="ID column in every file.")] = "id",
    target: Annotated[str, typer.Option(help="Target column in the label file.")] = "target",
    dataset: Annotated[str | None, typer.Option(
        help="Bundled data: breast-cancer, digits or diabetes (regression).")] = None,
    sites: Annotated[int, typer.Option(min=1, help="Sites to cut --dataset's columns into.")] = 2,
    overlap: Annotated[float, typer.Option(help="--dataset: share of patients every site holds.")] = 1.0,
    task: Annotated[str, typer.Option(help="auto, classification or regression.")] = "auto",
    fill: Annotated[str, typer.Option(help="Missing views: nearest, mean, zero or drop.")] = "nearest",
    rounds: Rounds = 10,
    steps: Annotated[int, typer.Option(min=1, help="Mini-batch steps per round.")] = 20,
    batch_size: Annotated[int, typer.Option(min=1, help="Aligned rows per step.")] = 64,
    lr: Lr = 0.01,
    embedding_dim: Annotated[int, typer.Option(min=1, help="Embedding width per site.")] = 16,
    branch_hidden: Annotated[int, typer.Option(min=0, help="Hidden width in each branch (0 = none).")] = 0,
    head_hidden: Annotated[int, typer.Option(min=0, help="Head hidden width (0 = linear).")] = 16,
    min_overlap: Annotated[float, typer.Option(help="Refuse under this share of shared patients.")] = 0.2,
    test_fraction: Annotated[float, typer.Option(min=0.05, max=0.9, help="Held-out share.")] = 0.2,
    seed: Seed = 0,
    keep: Annotated[str, typer.Option(
        help="Which round the fused model keeps: best-val (the round that scores best on "
             "validation rows cut from the label holder's training rows, ties to the later: the "
             "baselines' rule) or last (the last round, for protocols that fix the round count).",
        metavar="best-val|last")] = "best-val",
) -> None:
    """Train branches + a fusion head across sites with Flower; compare with each site and centralized."""
    import torch
    from fedsplit.orchestration.vertical.experiment import resolve_inputs, run_vertical
    from fedsplit.protocol.errors import ConfigError
    from fedsplit.protocol.selection import KEEP
    from fedsplit.protocol.vertical.config import FusionParams

    torch.set_num_threads(1)
    if keep not in KEEP:
        raise ConfigError(f"--keep is {' or '.join(KEEP)}. Received: {keep!r}")
    params = FusionParams.parse({
        "embedding_dim": embedding_dim, "branch_hidden": branch_hidden, "head_hidden": head_hidden,
        "lr": lr, "batch_size": batch_size, "steps_per_round": steps, "fill": fill,
        "min_overlap": min_overlap})
    inputs = resolve_inputs(dataset=dataset, site_files=site or [], labels=labels, num_sites=sites,
                            overlap=overlap, out=out.resolve(), seed=seed, id_column=id_column,
                            target=target)
    summary = run_vertical(inputs, params, out, rounds=rounds, task=task, seed=seed,
                           test_fraction=test_fraction, dataset=dataset, keep=keep,
                           on_stage=lambda msg: console.print(f"[dim]{msg}[/]"))
    print_summary(summary)
    console.print(f"wrote {out / 'summary.json'}, {out / 'rounds.png'}")


@app.command("compare-fills")
def compare_fills(
    out: Annotated[Path, typer.Option(help="Output directory (fills.json).")],
    site: Annotated[list[Path] | None, typer.Option("--site", help="A site's CSV/Parquet (repeat).")] = None,
    labels: Annotated[Path | None, typer.Option(help="Label holder's file.")] = None,
    id_column: Annotated[str, typer.Option(help="ID column in every file.")] = "id",
    target: Annotated[str, typer.Option(help="Target column in the label file.")] = "target",
    dataset: Annotated[str | None, typer.Option(
        help="Bundled data: breast-cancer, digits or diabetes (regression).")] = None,
    sites: Annotated[int, typer.Option(min=1, help="Sites for --dataset.")] = 2,
    overlap: Annotated[float, typer.Option(help="--dataset: share of patients every site holds.")] = 0.6,
    rounds: Rounds = 10,
    steps: Annotated[int, typer.Option(min=1)] = 20,
    embedding_dim: Annotated[int, typer.Option(min=1)] = 16,
    seed: Seed = 0,
) -> None:
    """Accuracy of each fill (nearest, mean, zero, drop) on the same held-out rows, in-process."""
    import torch
    from fedsplit.orchestration.vertical.experiment import resolve_inputs, run_compare_fills
    from fedsplit.protocol.vertical.config import FusionParams

    torch.set_num_threads(1)
    out = out.resolve()
    params = FusionParams.parse({"steps_per_round": steps, "embedding_dim": embedding_dim})
    inputs = resolve_inputs(dataset=dataset, site_files=site or [], labels=labels, num_sites=sites,
                            overlap=overlap, out=out, seed=seed, id_column=id_column, target=target)
    results, task = run_compare_fills(inputs, params, out, rounds=rounds, seed=seed)
    table = Table(title="Fills for missing views (held-out rows)")
    for col in ("fill", "training rows", "all held-out rows", "rows every site holds"):
        table.add_column(col, justify="right")
    key = selection_metric(task)
    for r in results.fills:
        complete = r.metrics_complete_rows if r.metrics_complete_rows is not None else r.metrics
        table.add_row(r.fill, str(r.train_rows), f"{r.metrics[key]:.4f} (n={r.num_examples})",
                      f"{complete[key]:.4f} (n={r.complete_rows})")
    console.print(table)


@app.command("predict")
def predict(
    model: Annotated[Path, typer.Option(help="A `vertical simulate` output directory.")],
    site: Annotated[list[Path], typer.Option("--site", help="New rows per site, same order as training.")],
    out: Annotated[Path, typer.Option(help="CSV of predictions to write.")],
    id_column: Annotated[str, typer.Option(help="ID column in every file.")] = "id",
    labels: Annotated[Path | None, typer.Option(help="Optional labels to score against.")] = None,
    target: Annotated[str, typer.Option(help="Target column in --labels.")] = "target",
) -> None:
    """Score rows every site holds: PSI-align the site files, embed at each branch, run the head."""
    import torch
    from fedsplit.orchestration.vertical.predict import predict_rows

    torch.set_num_threads(1)
    result = predict_rows(model, site, id_column, labels, target)
    result.frame.to_csv(out, index=False)
    console.print(f"wrote {len(result.frame)} predictions to {out} ({result.skipped} rows of site-0 "
                  f"not held by every site were skipped)")
    if result.metrics:
        console.print(f"metrics against {labels}: {result.metrics}")

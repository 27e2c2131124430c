"""``fedsplit simulate``: a federation of simulated hospitals on one machine, with baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.cli.options import (
    AggregationOptions,
    DataOptions,
    ModelOptions,
    RunOptions,
    TrainingOptions,
    grouped,
)
from fedsplit.orchestration.datasets import SIMULATE_DATASETS
from fedsplit.orchestration.tables import SITE_TABLE_FILE, metric_key, summary_tables
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.record.common import SUMMARY_FILE, scalars
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.record.privacy import PrivacyAudit
from fedsplit.protocol.record.summary import RunSummary
from fedsplit.protocol.tasks import task_kind
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()


def round_status(history: RunRecord) -> str:
    """The progress bar's status: the headline scores of the newest round that trained a model
    (naming it when a later round trained none), or that no round has yet. A round that
    trained nothing is evaluated on the model it started from: its score is not shown."""
    evaluated = [r for r in history.rounds if r.evaluate is not None]
    if not evaluated:
        return ("Flower: agreeing on the schema and the first model" if not history.rounds
                else f"training round {history.rounds[-1].round}")
    trained = [r for r in evaluated if r.model is not None]
    if not trained:
        return f"no model trained yet ({len(evaluated)} round(s) trained nothing)"
    newest = trained[-1]
    shown = ", ".join(f"{k}={v:.3f}" for k, v in scalars(newest.evaluate.metrics).items()
                      if k in ("accuracy", "r2", "loss"))
    if newest.round != evaluated[-1].round:
        return f"round {evaluated[-1].round} trained nothing; round {newest.round}: {shown}"
    return shown


def print_summary(summary: RunSummary, site_table: Path | None = None) -> None:
    """Print each model's score on every hospital's test patients, their mean and the pooled test
    (above `orchestration.tables.CONSOLE_SITES` hospitals their spread; ``site_table``: the file
    with every hospital's row)."""
    tuned = summary.personalized
    prior = tuned is not None and tuned.prior_test is not None
    tuned_label = "federated + prior" if prior else "federated + fine-tuned"
    for table in summary_tables(summary, site_table):
        console.print(table)
    if tuned is not None and tuned.prior_test is not None:
        console.print("federated + prior: each hospital refits the global model's final bias "
                      "on its own training rows and keeps it when a likelihood-ratio test rejects "
                      "the global bias (p < 0.05): " + ", ".join(
                          f"{name} {'refitted' if t.adopted else 'global'} (p={t.p_value:.2g})"
                          for name, t in tuned.prior_test.items()))
    elif tuned is not None:
        budget = ("as many mini-batches as alone: "
                  + ", ".join(f"{name} {n}" for name, n in tuned.steps_per_site.items())
                  if tuned.steps == "alone" else f"{tuned.steps} mini-batches")
        part = "its final layer's bias, " if tuned.scope == "bias" else ""
        console.print(f"federated + fine-tuned: each hospital's own fine-tuned copy of the global "
                      f"model ({part}{budget}), scored on its own test patients (pooled: each row by "
                      f"its hospital's model)")
    entries = [(label, entry) for label, entry in (
        ("centralized", summary.centralized), ("federated", summary.federated),
        (tuned_label, tuned)) if entry is not None]
    for key in task_kind(str(summary.task)).metrics:  # the kind's other metrics (regression: rmse)
        if key != metric_key(summary) and all(key in entry.metrics for _, entry in entries):
            console.print(f"{key} (pooled): " + ", ".join(
                f"{label} {entry.metrics[key]:.3f}" for label, entry in entries))
    for line in summary.table_schema.warnings if summary.table_schema else []:
        console.print(f"[yellow]schema warning:[/] {line}")


@grouped
def simulate(
    out: Annotated[Path, typer.Option(help="Output directory (summary.json, rounds.png, models).")],
    dataset: Annotated[
        str | None, typer.Option(help=f"Bundled dataset: {', '.join(SIMULATE_DATASETS)} "
                                      "(FLamby's 6 regions, a survival task).")
    ] = None,
    site: Annotated[
        list[str] | None,
        typer.Option("--site", help="A hospital's own data: a CSV/Parquet/NPZ file, or any file "
                                    "or folder --recipe's reader reads (e.g. HDF5 signals, PNG "
                                    "folders), as PATH, NAME=PATH or NAME=TRAIN:TEST (repeat per "
                                    "site; name: the file stem)."),
    ] = None,
    sites: Annotated[
        int | None, typer.Option(min=1, help="Hospitals to split --dataset across (default 3; "
                                             "heart-disease has its own four).")
    ] = None,
    partition: Annotated[
        str, typer.Option(help="iid, dirichlet:ALPHA (label skew) or sizes:n1,n2,...")
    ] = "iid",
    test_fraction: Annotated[
        float, typer.Option(min=0.05, max=0.9, help="Share of rows held out for scoring only.")
    ] = 0.2,
    attack: Annotated[
        str, typer.Option(help="Make --attackers sites hostile: signflip[:K], scale:K, gaussian:SIGMA, "
                               "nan, labelflip (none = honest).")
    ] = "none",
    attackers: Annotated[int, typer.Option(min=0, help="How many sites (the last ones) are hostile.")] = 0,
    leave_out: Annotated[
        list[int] | None,
        typer.Option("--leave-out", help="Partition across --sites but run without site K (repeatable)."),
    ] = None,
    parallel: Annotated[
        str, typer.Option(help="Split each hospital's training: none, data:replicas=R, "
                               "model:map=..., pipeline:stages=S,microbatches=M.")
    ] = "none",
    dp: Annotated[
        str, typer.Option(help="Differential privacy: epsilon=E,delta=D[,clip=C][,level=patient|"
                               "hospital] planned for --rounds (docs/privacy.md); runs the "
                               "privacy audit at the end. none = off.")
    ] = "none",
    personalize: Annotated[
        str, typer.Option(help="Personalization: after the last round each hospital "
                               "fine-tunes the global model for STEPS mini-batches of Adam "
                               "(--lr, --batch-size) on its own training rows, scored on its "
                               "own test patients; 'alone' = each hospital its hospital-alone "
                               "step budget (rounds x its steps per round); 'prior' = each "
                               "hospital refits only the final bias on its own rows, kept when "
                               "a likelihood-ratio test (p < 0.05) says its label mix differs. "
                               "0 = off.",
                          metavar="STEPS|alone|prior")
    ] = "0",
    personalize_scope: Annotated[
        str, typer.Option(help="Which weights --personalize fine-tunes: all (every weight) or "
                               "bias (only the final layer's bias, a per-hospital prior "
                               "correction; every other weight stays the global model's); "
                               "auto = all for a step budget, bias for prior.",
                          metavar="auto|all|bias")
    ] = "auto",
    baselines: Annotated[
        str, typer.Option(help="Baselines trained beside the federation: auto (the task kind's: "
                               "centralized and each hospital alone), none, or a comma list of "
                               "centralized, local. Each is scored in O(hospitals): the "
                               "centralized model on every hospital's test patients, a hospital "
                               "alone on its own (also on the others' up to 20 hospitals).",
                          metavar="auto|none|centralized,local")
    ] = "auto",
    ray_address: Annotated[
        str | None, typer.Option(help="Run the simulated hospitals on an existing Ray cluster: "
                                      "its head's HOST:PORT (`ray start --head`; docs/simulate.md, "
                                      "'On a Ray cluster'). Default: Ray on this machine.")
    ] = None,
    data: DataOptions = DataOptions(),
    model: ModelOptions = ModelOptions(),
    training: TrainingOptions = TrainingOptions(),
    aggregation: AggregationOptions = AggregationOptions(),
    run: RunOptions = RunOptions(),
) -> None:
    """Train one model across simulated hospitals with Flower; compare with central and local training."""
    from fedsplit.orchestration.site_files import check_site_files

    # RunConfig and Experiment check every option against the others (a ConfigError says which)
    cfg = RunConfig.from_flower(dict(
        **model.run_keys(dataset, data), **data.run_keys(), **training.run_keys(),
        **aggregation.run_keys(), **run.run_keys(), parallel=parallel, attack=attack,
        attackers=attackers, dp=dp))
    check_site_files(site or [])  # a missing file at any hospital: one line, before torch loads
    from fedsplit.orchestration.experiment import Experiment, parse_baselines, run_simulation
    from fedsplit.protocol.privacy import DPSpec

    exp = Experiment(cfg=cfg, out=out, dataset=dataset, site_files=site or [], num_sites=sites,
                     partition=partition, test_fraction=test_fraction, leave_out=leave_out or [],
                     personalize=personalize, personalize_scope=personalize_scope,
                     baselines=parse_baselines(baselines), ray_address=ray_address)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("rounds", total=run.rounds, status="reading the hospitals' files")

        def on_progress(history: RunRecord) -> None:
            progress.update(bar, completed=sum(1 for r in history.rounds if r.evaluate is not None),
                            status=round_status(history))

        summary = run_simulation(exp, on_progress=on_progress,
                                 on_stage=lambda msg: progress.console.print(f"[dim]{msg}[/]"),
                                 on_phase=lambda name: progress.update(bar, status=name))
        progress.update(bar, completed=run.rounds, status="done")
    print_summary(summary, out / SITE_TABLE_FILE)
    dp_spec = DPSpec.parse(cfg.dp)
    if dp_spec is not None and summary.privacy is not None:
        audit = summary.privacy.audit or PrivacyAudit()
        for name, site_eps in summary.privacy.per_site.items():
            group = audit.per_site.get(name)
            console.print(f"{name}: epsilon {site_eps.epsilon:.3f} of {dp_spec.epsilon}"
                          + (f", membership AUC {group.auc:.3f}" if group is not None else ""))
        head = audit.headline
        if head is not None:
            console.print(f"membership AUC (federation, {head.attack}): {head.auc:.3f} "
                          f"[{head.ci95[0]:.3f}, {head.ci95[1]:.3f}]")
    console.print(f"wrote {out / SUMMARY_FILE}, {out / SITE_TABLE_FILE}, {out / 'rounds.png'}, "
                  f"global model "
                  f"{summary.federated.model if summary.federated else '-'}")
    if summary.survival is not None:
        console.print(f"survival: pooled Kaplan-Meier curve {summary.survival.km_plot} (and "
                      f".json), the kept model's Breslow baseline {summary.survival.baseline} "
                      f"(for `fedsplit predict --times`)")

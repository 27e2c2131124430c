"""``fedsplit simulate``: a federation of simulated hospitals on one machine, with baselines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import aggregation
from client.data import DATASETS
from protocol.config import RunConfig
from protocol.errors import ConfigError

console = Console()


def print_summary(summary: dict[str, Any]) -> None:
    """Print centralized vs each site alone vs federated on the held-out test split."""
    keys = ["accuracy"] if summary["task"] == "classification" else ["r2", "rmse"]
    table = Table(title=f"Held-out test split ({summary['test_examples']} rows)")
    table.add_column("model")
    table.add_column("training rows", justify="right")
    for k in keys:
        table.add_column(k, justify="right")
    table.add_row("centralized (pooled data)", str(summary["centralized"]["num_examples"]),
                  *[f"{summary['centralized']['metrics'][k]:.4f}" for k in keys])
    for site in summary["local_only"]:
        table.add_row(f"{site['site']} alone", str(site["num_examples"]),
                      *[f"{site['metrics'][k]:.4f}" for k in keys])
    table.add_row(f"[bold]federated ({summary['strategy']})[/]",
                  str(summary["federated"]["num_examples"]),
                  *[f"[bold]{summary['federated']['metrics'][k]:.4f}[/]" for k in keys])
    console.print(table)


def simulate(
    out: Annotated[Path, typer.Option(help="Output directory (summary.json, rounds.png, models).")],
    dataset: Annotated[
        str | None, typer.Option(help=f"Bundled dataset: {', '.join(DATASETS)}.")
    ] = None,
    site: Annotated[
        list[Path] | None,
        typer.Option("--site", help="A hospital's own CSV/Parquet/NPZ file (repeat per site)."),
    ] = None,
    target: Annotated[str, typer.Option(help="Target column in --site tables.")] = "target",
    sites: Annotated[int, typer.Option(min=1, help="Hospitals to split --dataset across.")] = 3,
    partition: Annotated[
        str, typer.Option(help="iid, dirichlet:ALPHA (label skew) or sizes:n1,n2,...")
    ] = "iid",
    strategy: Annotated[str, typer.Option(help="Aggregation strategy (`fedsplit strategies`).")] = "fedavg",
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Strategy parameter key=value (repeatable).")
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Federation rounds.")] = 10,
    local_epochs: Annotated[int, typer.Option(min=1, help="Local epochs per round.")] = 1,
    lr: Annotated[float, typer.Option(min=0.0, help="Adam learning rate.")] = 0.01,
    batch_size: Annotated[int, typer.Option(min=1, help="Local batch size.")] = 32,
    proximal_mu: Annotated[float, typer.Option(min=0.0, help="FedProx mu (0 = off).")] = 0.0,
    task: Annotated[str, typer.Option(help="auto, classification or regression.")] = "auto",
    test_fraction: Annotated[
        float, typer.Option(min=0.05, max=0.9, help="Share of rows held out for scoring only.")
    ] = 0.2,
    seed: Annotated[int, typer.Option(help="Seed for partitions, splits and initial weights.")] = 0,
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
    norm: Annotated[
        str, typer.Option(help="Normalisation after each MLP hidden layer: none or batch (BatchNorm1d).")
    ] = "none",
    resume: Annotated[
        bool, typer.Option(help="Continue an unfinished run in --out after its last completed round "
                                "(refused if its config or site data differ); --no-resume starts over.")
    ] = True,
) -> None:
    """Train one model across simulated hospitals with Flower; compare with central and local training."""
    import torch

    from orchestration.experiment import Experiment, check_attack, run_experiment

    torch.set_num_threads(1)  # one thread per process: the cores are shared with the hospitals
    if bool(dataset) == bool(site):
        raise ConfigError(
            "Give either --dataset NAME (split bundled data across --sites) or one --site FILE per "
            f"hospital, not both or neither. Received: dataset={dataset!r}, {len(site or [])} --site"
        )
    if norm not in ("none", "batch"):
        raise ConfigError(f"--norm is none or batch (BatchNorm1d after each MLP hidden layer). "
                          f"Received: {norm!r}")
    params = aggregation.parse_param_pairs(param or [])
    aggregation.get_strategy(strategy, params)  # fail fast on a bad name or value
    from client.parallel import ParallelConfig

    ParallelConfig.parse(parallel)
    check_attack(attack, attackers, (len(site) if site else sites) - len(leave_out or []))
    cfg = RunConfig.from_flower(dict(  # validated: a bad --task or --norm is a ConfigError
        num_server_rounds=rounds, strategy=strategy, strategy_params=json.dumps(params),
        local_epochs=local_epochs, lr=lr, batch_size=batch_size, proximal_mu=proximal_mu,
        task=task, target=target, seed=seed, parallel=parallel, attack=attack, attackers=attackers,
        norm=norm, resume=resume,
    ))
    exp = Experiment(cfg=cfg, out=out, dataset=dataset, site_files=site or [],
                     num_sites=len(site) if site else sites, partition=partition,
                     test_fraction=test_fraction, leave_out=leave_out or [])
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("rounds", total=rounds, status="starting Flower")

        def on_progress(history: dict[str, Any]) -> None:
            done = [r for r in history.get("rounds", []) if "evaluate" in r]
            status = "agreeing on the model" if not done else ", ".join(
                f"{k}={v:.3f}" for k, v in done[-1]["evaluate"]["metrics"].items()
                if k in ("accuracy", "r2", "loss"))
            progress.update(bar, completed=len(done), status=status)

        summary = run_experiment(exp, on_progress=on_progress,
                                 on_stage=lambda msg: progress.console.print(f"[dim]{msg}[/]"))
        progress.update(bar, completed=rounds, status="done")
    print_summary(summary)
    console.print(f"wrote {out / 'summary.json'}, {out / 'rounds.png'}, global model "
                  f"{summary['federated']['model']}")

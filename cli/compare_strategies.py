"""``fedsplit compare-strategies``: the same (possibly hostile) federation under several rules."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.client.data import DATASETS
from fedsplit.protocol.errors import ConfigError
from rich.console import Console
from rich.table import Table

from fedsplit import aggregation

console = Console()


def parse_strategy_params(names: list[str], pairs: list[str]) -> dict[str, dict[str, str]]:
    """``["trimmed-mean:beta=0.3"]`` -> ``{"trimmed-mean": {"beta": "0.3"}}`` (validated)."""
    params: dict[str, dict[str, str]] = {name: {} for name in names}
    for pair in pairs:
        name, sep, rest = pair.partition(":")
        if not sep or name not in params:
            raise ConfigError(
                f"--param here is STRATEGY:key=value for one of {', '.join(names)} "
                f"(e.g. trimmed-mean:beta=0.3). Received: {pair!r}"
            )
        params[name].update(aggregation.parse_param_pairs([rest]))
    for name, values in params.items():
        aggregation.get_strategy(name, values)  # fail fast on bad names and values
    return params


def compare_strategies(
    out: Annotated[Path, typer.Option(help="Output directory: one folder per run, comparison.json/.png.")],
    strategies: Annotated[
        str, typer.Option(help="Comma-separated strategies, e.g. fedavg,median,trimmed-mean,krum.")
    ] = "fedavg,median,trimmed-mean,krum",
    dataset: Annotated[str, typer.Option(help=f"Bundled dataset: {', '.join(DATASETS)}.")] = "digits",
    sites: Annotated[int, typer.Option(min=2, help="Hospitals.")] = 5,
    partition: Annotated[str, typer.Option(help="iid, dirichlet:ALPHA or sizes:n1,...")] = "iid",
    attack: Annotated[str, typer.Option(help="signflip[:K], scale:K, gaussian:SIGMA, nan, labelflip, none.")]
    = "none",
    attackers: Annotated[int, typer.Option(min=0, help="Hostile sites (the last ones).")] = 0,
    param: Annotated[
        list[str] | None, typer.Option("--param", help="STRATEGY:key=value (repeatable).")
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Federation rounds per run.")] = 10,
    local_epochs: Annotated[int, typer.Option(min=1, help="Local epochs per round.")] = 1,
    lr: Annotated[float, typer.Option(min=0.0, help="Adam learning rate.")] = 0.01,
    proximal_mu: Annotated[float, typer.Option(min=0.0, help="FedProx mu for every run.")] = 0.0,
    clean: Annotated[
        bool, typer.Option(help="Also run clean FedAvg (no hostile site) as the reference.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed (same partition for every run).")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue unfinished runs in OUT after their last "
                                              "completed round (--no-resume: start over).")] = True,
) -> None:
    """Run one federation per strategy on the same sites (and attack); compare accuracy per round."""
    import torch
    from fedsplit.orchestration.comparison import Comparison, run_comparison
    from fedsplit.orchestration.experiment import check_attack

    torch.set_num_threads(1)
    names = [n.strip() for n in strategies.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--strategies needs distinct strategy names. Received: {strategies!r}")
    params = parse_strategy_params(names, param or [])
    hostile = check_attack(attack, attackers, sites)  # fail fast, before any run
    comp = Comparison(out=out, strategies=names, params=params, dataset=dataset, sites=sites,
                      partition=partition, attack=attack, attackers=attackers, clean=clean,
                      rounds=rounds, local_epochs=local_epochs, lr=lr, proximal_mu=proximal_mu,
                      seed=seed, resume=resume)
    results, comparison = run_comparison(
        comp, on_run=lambda i, n, label: console.print(f"[bold]run {i}/{n}[/]: {label}"))

    key = str(comparison.metric)
    label = f" under {attack} x{attackers}" if hostile else ""
    table = Table(title=f"{dataset}, {sites} sites ({partition}){label}: test {key} after {rounds} rounds")
    table.add_column("run")
    table.add_column(f"final {key}", justify="right")
    table.add_column(f"best {key}", justify="right")
    table.add_column("centralized", justify="right")
    for run_label, summary in results.items():
        final, central = summary.federated, summary.centralized
        table.add_row(run_label, f"{final.metrics[key]:.4f}" if final else "-",
                      f"{max(summary.round_metric(key)):.4f}",
                      f"{central.metrics[key]:.4f}" if central else "-")
    console.print(table)
    console.print(f"wrote {out / 'comparison.json'} and {out / 'comparison.png'}")

"""The same (possibly hostile) federation under several aggregation rules (``compare-strategies``).

Every run uses the same sites (partition and seed), the same model and training settings; only
the strategy differs. With hostile sites, a clean FedAvg run (nobody attacks) is the reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedsplit.orchestration.experiment import Experiment, check_attack, run_experiment
from fedsplit.orchestration.plots import metric_key, plot_comparison
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.record.summary import ComparedRun, RunSummary, StrategyComparison


@dataclass
class Comparison:
    """What to compare; ``params`` holds each strategy's parameters (name -> key -> value)."""

    out: Path
    strategies: Sequence[str]
    params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    dataset: str = "digits"
    sites: int = 5
    partition: str = "iid"
    attack: str = "none"
    attackers: int = 0
    clean: bool = True
    rounds: int = 10
    local_epochs: int = 1
    lr: float = 0.01
    proximal_mu: float = 0.0
    seed: int = 0
    resume: bool = True


def run_label(name: str, attack: str, attackers: int) -> str:
    """How a run is named in the table, comparison.json and its folder."""
    return f"{name} under {attack} x{attackers}" if attackers else name


def run_comparison(
    comp: Comparison, *, on_run: Callable[[int, int, str], None] | None = None
) -> tuple[dict[str, RunSummary], StrategyComparison]:
    """Run one federation per strategy; write comparison.json and comparison.png into ``comp.out``.

    Returns (run label -> that run's summary, the comparison written).
    """
    hostile = check_attack(comp.attack, comp.attackers, comp.sites)
    runs: list[tuple[str, str, Mapping[str, str], str, int]] = []
    if comp.clean and hostile:
        runs.append(("clean fedavg", "fedavg", {}, "none", 0))
    runs += [(run_label(name, comp.attack, comp.attackers if hostile else 0), name,
              comp.params.get(name, {}), comp.attack, comp.attackers) for name in comp.strategies]

    results: dict[str, RunSummary] = {}
    for i, (label, name, values, attack, attackers) in enumerate(runs, start=1):
        if on_run:
            on_run(i, len(runs), label)
        cfg = RunConfig(num_server_rounds=comp.rounds, strategy=name,
                        strategy_params=json.dumps(dict(values)), local_epochs=comp.local_epochs,
                        lr=comp.lr, proximal_mu=comp.proximal_mu,
                        seed=comp.seed, attack=attack, attackers=attackers, resume=comp.resume)
        folder = comp.out / label.replace(" ", "-").replace(":", "")
        exp = Experiment(cfg=cfg, out=folder, dataset=comp.dataset, num_sites=comp.sites,
                         partition=comp.partition)
        results[label] = run_experiment(exp)

    key = metric_key(next(iter(results.values())))
    comparison = StrategyComparison(
        dataset=comp.dataset, sites=comp.sites, partition=comp.partition, attack=comp.attack,
        hostile_sites=[f"site-{i}" for i in hostile], rounds=comp.rounds, metric=key,
        runs={label: ComparedRun(
            strategy=summary.strategy, strategy_params=summary.strategy_params,
            final=summary.federated.metrics[key] if summary.federated else None,
            per_round=summary.round_metric(key),
            centralized=summary.centralized.metrics[key] if summary.centralized else None)
            for label, summary in results.items()})
    comparison.save(comp.out / StrategyComparison.file_name())
    suffix = f" under {comp.attack} x{comp.attackers}" if hostile else ""
    plot_comparison(results, comp.out / "comparison.png", f"{comp.dataset}: {comp.sites} sites{suffix}")
    return results, comparison

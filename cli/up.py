"""``fedsplit up``: a federation of simulated hospitals as local processes, in one command.

The same topology as ``docker/compose.yaml`` on 127.0.0.1: a SuperLink, the coordinator
(SuperExec running the ServerApp), one ``fedsplit site run`` agent per hospital, each with its own
partition and FLWR_HOME, and the admin API (sequenced by `orchestration.up`). It prints one line
per round; Ctrl-C, SIGTERM or the end of the run stops every process it started.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from click.core import ParameterSource
from fedsplit.cli.options import (
    AggregationOptions,
    DataOptions,
    ModelOptions,
    RunOptions,
    TrainingOptions,
    grouped,
)
from fedsplit.client.data import DATASETS
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.common import scalars
from fedsplit.protocol.record.horizontal import RoundEntry, RunRecord
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)  # one line per message, in logs too


def round_line(entry: RoundEntry, total: int) -> str:
    """One progress line for a finished round of the run record."""
    sites = entry.train.sites if entry.train else []
    used = [s.site for s in sites if not s.excluded]
    left = [f"{s.site or '?'} ({'late' if s.late else 'failed'})" for s in sites if s.excluded]
    metrics = scalars(entry.evaluate.metrics) if entry.evaluate else {}
    # the built-in tasks' headline metrics, else a recipe's own (its first three, e.g.
    # balanced-accuracy, loss, macro-auroc); survival's pair rates are sums, not scores
    builtin = "accuracy" in metrics or "r2" in metrics
    names = ([k for k in metrics if k in ("accuracy", "loss", "r2")] if builtin
             else [k for k in metrics if not k.startswith("c_")][:3])
    shown = ", ".join(f"{k}={metrics[k]:.4f}" for k in names)
    if shown and entry.model is None and entry.trained:  # scored the model it started from
        shown = "no model trained: no score"
    parts = [f"round {entry.round}/{total}", f"{len(used)} hospitals", shown or "no evaluation"]
    if entry.error is not None:
        parts.append(f"[yellow]{entry.error}[/]")
    if left:
        parts.append(f"[yellow]without {', '.join(left)}[/]")
    if entry.seconds is not None:
        parts.append(f"{entry.seconds:.1f} s")
    return " | ".join(parts)


class RoundPrinter:
    """Prints each round once, when its evaluation is recorded, and every resume."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.printed: set[int] = set()
        self.resumes = 0

    def __call__(self, history: RunRecord) -> None:
        """Print what is new in ``history``."""
        for event in history.resumed[self.resumes:]:
            console.print(f"[cyan]coordinator resumed after round {event.after_round} "
                          f"(saved global model and history)[/]")
        self.resumes = len(history.resumed)
        last = max((r.round for r in history.rounds), default=0)
        for entry in history.rounds:
            done = entry.evaluate is not None or entry.round < last or history.status == "finished"
            if done and entry.round not in self.printed:
                self.printed.add(entry.round)
                console.print(round_line(entry, self.total))


@grouped
def up(
    ctx: typer.Context,
    sites: Annotated[int, typer.Option(min=1, help="Simulated hospitals.")] = 3,
    tls: Annotated[bool, typer.Option(help="TLS on the SuperLink and SuperNode authentication "
                                           "(certificates and keys made in WORK/certs).")] = False,
    dataset: Annotated[str, typer.Option(help=f"Bundled dataset: {', '.join(DATASETS)}.")] = "breast-cancer",
    partition: Annotated[str, typer.Option(help="iid, dirichlet:ALPHA or sizes:n1,n2,...")] = "iid",
    quorum: Annotated[int, typer.Option(min=0, help="Hospitals a round needs (0 = all).")] = 0,
    round_timeout: Annotated[float, typer.Option(min=1, help="Seconds each round phase waits for "
                                                             "replies.")] = 120.0,
    work: Annotated[Path, typer.Option(help="Working directory: data, certs, logs, FLWR_HOMEs, "
                                            "and OUT = WORK/out.")] = Path("fedsplit-up"),
    port: Annotated[int, typer.Option(help="SuperLink port on 127.0.0.1 (0 = a free one).")] = 0,
    admin: Annotated[bool, typer.Option(help="Also start the admin API.")] = True,
    admin_port: Annotated[int, typer.Option(help="Admin API port (0 = a free one).")] = 0,
    timeout: Annotated[float, typer.Option(min=1, help="Give up after this many seconds.")] = 3600,
    superlink: Annotated[str | None, typer.Option(help="Attach to a running SuperLink HOST:PORT "
                                                       "instead (compose): only submit the run.")] = None,
    root_cert: Annotated[Path | None, typer.Option(help="With --superlink: its CA certificate.")] = None,
    superlink_database: Annotated[Path | None, typer.Option(
        help="Keep the SuperLink's state and message objects in this SQLite file instead of "
             "memory (Flower's --database; made anew at start): replies that land together "
             "wait on disk, not in the coordinator's memory (3.7-3.8x a 100M model above idle "
             "against 5.3x), at the cost of writing them there (rounds about 1.1-1.4x longer; "
             "docs/scale.md).")] = None,
    out: Annotated[Path | None, typer.Option(help="Where the coordinator writes history and models "
                                                  "(default WORK/out; with --superlink a path the "
                                                  "coordinator and this command both see).")] = None,
    site: Annotated[list[str] | None, typer.Option(
        "--site", metavar="NAME=FILE",
        help="A hospital on its own file, repeated per hospital: a CSV/Parquet table, an NPZ, or "
             "what the --recipe's reader reads (e.g. one .h5 file or a folder). Instead of "
             "--dataset/--sites/--partition.")] = None,
    data: DataOptions = DataOptions(),
    model: ModelOptions = ModelOptions(),
    training: TrainingOptions = TrainingOptions(),
    aggregation: AggregationOptions = AggregationOptions(),
    run: RunOptions = RunOptions(rounds=3),
) -> None:
    """Start SuperLink, coordinator, hospitals and admin API on 127.0.0.1; run the federation."""
    from fedsplit.orchestration.site_files import own_sites

    if site:
        given = [f"--{name}" for name in ("dataset", "sites", "partition")
                 if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)]
        if given:
            raise ConfigError(f"--site gives each hospital its own file; --dataset, --sites and "
                              f"--partition cut a bundled dataset instead: use one or the other. "
                              f"Received: --site with {', '.join(given)}")
        if superlink is not None:
            raise ConfigError("--site starts the hospitals here; with --superlink the hospitals run "
                              "their own agents (fedsplit site run --data FILE). Received: --site "
                              f"with --superlink {superlink}")
        sites = len(site)
        own_sites(site)  # a missing file at any hospital: one line, before torch or a process

    if superlink_database is not None:
        if superlink is not None:
            raise ConfigError("--superlink-database is for the SuperLink this command starts; the "
                              "running one keeps its own (flower-superlink --database FILE). "
                              f"Received: --superlink-database with --superlink {superlink}")
        if superlink_database.is_dir():
            raise ConfigError("--superlink-database is a file the SuperLink writes (SQLite), not "
                              "a folder: name a file in it, e.g. WORK/superlink.db. Received: "
                              f"--superlink-database {superlink_database}")
    from fedsplit.orchestration.survival_summary import up_dataset
    from fedsplit.orchestration.task_kinds import task_report
    from fedsplit.orchestration.up import UpPlan, left_out_failure, run_up

    survival = up_dataset(dataset, site)  # tcga-brca: its regions as hospitals, FLamby's columns
    sites = survival.sites if survival.sites is not None else sites
    work = work.resolve()
    out = (out or work / "out").resolve()
    cfg = RunConfig.from_flower(dict(  # validated: a bad value is a ConfigError naming it
        **model.run_keys(survival.dataset, data), **data.run_keys(), **training.run_keys(),
        **aggregation.run_keys(), **run.run_keys(), out_dir=str(out), min_nodes=sites,
        quorum=quorum, round_timeout=round_timeout))
    plan = UpPlan(cfg=cfg, work=work, sites=sites, dataset=dataset, partition=partition, tls=tls,
                  port=port, admin_port=admin_port if admin else None, timeout=timeout,
                  superlink=superlink, root_cert=root_cert, site_files=tuple(site or ()),
                  superlink_database=superlink_database.resolve() if superlink_database else None)
    started = time.monotonic()
    history = run_up(plan, on_progress=RoundPrinter(run.rounds),
                     on_stage=lambda msg: console.print(f"[bold]{msg}[/]"),
                     say=lambda msg: console.print(f"[dim]{msg}[/]"))
    # run_up returned: the run trained and global.h5 exists (else NoTrainingError, exit 14)
    kept = "" if superlink is not None else f"global model {out / 'global.h5'}, "
    console.print(f"[bold green]done[/] in {time.monotonic() - started:.0f} s: {len(history.rounds)} "
                  f"rounds; {kept}history {out / 'history.json'}")
    if superlink is None:  # the task kind's report (survival: per-hospital C-index, KM, baseline)
        for line in task_report(cfg.task, out, history):
            console.print(line)
    if (failure := left_out_failure(history, out)) is not None:  # trained without a hospital
        raise failure

"""``fedsplit up``'s sequencing: a federation of simulated hospitals as local processes.

`run_up` checks the run config against the strategy factory (`server.compose`), then either
submits it to a running SuperLink (``superlink``: compose's federation job; the hospitals hold
their own data) or, on 127.0.0.1: writes each hospital's partition under WORK/sites, puts the
data's fingerprint in the run config, refuses to resume an unfinished run on other data (before
any process starts), starts the `LocalFederation` (SuperLink, coordinator, one agent per
hospital, admin API) and runs the federation to its end. SIGTERM stops every process it
started, like Ctrl-C.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from fedsplit.orchestration.experiment import prepare_partitions
from fedsplit.orchestration.fingerprint import data_fingerprint
from fedsplit.orchestration.flower_runtime import attach
from fedsplit.orchestration.local_federation import LocalFederation, Site
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.history import RunRecord
from fedsplit.server.compose import check_composition
from fedsplit.server.history import find_resume_point


@dataclass(frozen=True)
class UpPlan:
    """Where and how `run_up` runs ``cfg`` (its ``out_dir``, ``min_nodes`` and ``seed`` set)."""

    cfg: RunConfig
    work: Path
    sites: int = 3
    dataset: str = "breast-cancer"
    partition: str = "iid"
    tls: bool = False
    port: int = 0
    admin_port: int | None = 0  # None: no admin API
    timeout: float = 3600.0
    superlink: str | None = None  # attach to it instead of starting processes
    root_cert: Path | None = None


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_up(plan: UpPlan, *, on_progress: Callable[[RunRecord], None] | None = None,
           on_stage: Callable[[str], None] = lambda _msg: None,
           say: Callable[[str], None] = lambda _msg: None) -> RunRecord:
    """Run the federation ``plan`` describes to its end; return its run record.

    ``on_stage`` gets one line when the federation starts, ``say`` each process's start and
    stop, ``on_progress`` the run record each time the coordinator rewrites it.
    """
    cfg = plan.cfg
    check_composition(cfg)  # a bad strategy, parameter or secure-aggregation pairing fails here
    if plan.superlink is not None:  # the hospitals hold their own data: no fingerprint from here
        on_stage(f"federation on {plan.superlink}: {cfg.strategy}, {cfg.num_server_rounds} rounds")
        return attach(cfg, plan.superlink, plan.work, root_cert=plan.root_cert,
                      on_progress=on_progress)
    if cfg.recipe:  # the local hospitals import it: a missing module or bad params fail here
        from fedsplit.client.recipes import load_recipe

        load_recipe(cfg.recipe, cfg.recipe_params)
    files = prepare_partitions(plan.work / "sites", plan.dataset, plan.sites, plan.partition,
                               cfg.seed)
    cfg = cfg.model_copy(update={"data_fingerprint": data_fingerprint(files)})
    if cfg.resume:  # refuse an unfinished run on other data before starting any process
        find_resume_point(Path(cfg.out_dir), cfg.to_flower())
    federation = LocalFederation(plan.work, [Site(n, path.parent) for n, path in files.items()],
                                 tls=plan.tls, port=plan.port, admin_port=plan.admin_port, say=say)
    previous = signal.signal(signal.SIGTERM, _terminate)  # `kill` stops everything, like Ctrl-C
    try:
        with federation:
            federation.start()
            on_stage(f"federation: {plan.sites} hospitals, {cfg.strategy}, "
                     f"{cfg.num_server_rounds} rounds, quorum {cfg.quorum or plan.sites}; "
                     f"logs in {federation.logs}")
            return federation.run(cfg, timeout=plan.timeout, on_progress=on_progress)
    finally:
        signal.signal(signal.SIGTERM, previous)

"""The coordinator: a Flower ServerApp that runs a registry strategy over the hospitals.

Runs unchanged in Flower's simulation engine and in the deployment runtime (SuperLink +
SuperNodes). Everything it needs comes from the run config (`protocol.config.RunConfig`).
Before round 1 it checks that the configured strategy can work with the most hospitals a round
can have (Krum and multi-Krum need N >= 2f + 3): a rule that could never aggregate fails at
start with the fix, not after the first round's training.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError, FedsplitError, NoTrainingError
from fedsplit.server.compose import compose_aggregator, compose_loop
from fedsplit.server.history import RunHistory, find_resume_point
from fedsplit.server.phases import run_phase
from fedsplit.server.secure import unmask
from fedsplit.server.setup import ModelSetup, prepare_model, wait_for_nodes
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

log = logging.getLogger(__name__)

app = ServerApp()

RESUME_GRACE_S = 60.0  # a resumed run waits this long for all min-nodes, then goes on with a quorum


def most_per_round(hospitals: int, cfg: RunConfig) -> int:
    """The most training replies a round can bring: Flower samples
    ``max(int(hospitals * fraction-train), quorum)`` of the connected hospitals."""
    quorum = cfg.quorum or cfg.min_nodes
    return min(hospitals, max(int(hospitals * cfg.fraction_train), quorum))


def check_strategy_fits(aggregator: AggregationStrategy, hospitals: int, cfg: RunConfig) -> None:
    """Refuse a strategy that needs more updates than any round can bring (e.g. Krum's 2f+3)."""
    need = aggregator.min_updates()
    most = most_per_round(hospitals, cfg)
    if most >= need:
        return
    f = getattr(aggregator.params, "f", None)
    why = aggregator.min_updates_reason()
    raise ConfigError(
        f"Strategy {aggregator.name}{f' with f={f}' if f is not None else ''} needs at least "
        f"{need} usable updates per round{f' ({why})' if why else ''}, but a round here can bring "
        f"at most {most} (hospitals: {hospitals}, min-nodes={cfg.min_nodes}, "
        f"fraction-train={cfg.fraction_train}). Lower f, choose another strategy, or add "
        f"hospitals (min-nodes, and fraction-train=1). Received: strategy={aggregator.name}, "
        f"params={aggregator.params.model_dump()}, hospitals={hospitals}"
    )


def server_optimizer(cfg: RunConfig) -> ServerOptimizer | None:
    """The run's server optimizer (``server-opt`` and its settings), or None."""
    if cfg.server_opt == "none":
        return None
    return ServerOptimizer(cfg.server_opt, lr=cfg.server_lr, beta1=cfg.server_beta1,
                           beta2=cfg.server_beta2, tau=cfg.server_tau,
                           momentum=cfg.server_momentum)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Agree on a starting model, then run the configured rounds."""
    # a simulation's roster inline again: the run is recorded and compared as without one
    cfg = RunConfig.from_flower(context.run_config).with_roster()
    # the coordinator's process settings, read from its environment once, here (docs/settings.md)
    backend = BackendSettings.from_environ(os.environ)
    unmask.use_workers(unmask.workers_from(os.environ))
    # the rule under the run's privacy settings (server/compose.py): a rule the privacy
    # wrappers cannot wrap is refused here
    aggregator = compose_aggregator(cfg)
    # A restarted coordinator continues an unfinished run from its last completed round.
    resume = find_resume_point(Path(cfg.out_dir), cfg.to_flower()) if cfg.resume else None
    history = RunHistory(Path(cfg.out_dir), cfg.to_flower(),
                         previous=resume.history if resume else None)
    quorum = cfg.quorum or cfg.min_nodes
    optimizer = server_optimizer(cfg)
    try:
        if resume is not None:
            log.info("Resuming after round %d from %s", resume.last_round,
                     resume.start_model or resume.global_model)
            try:  # give hospitals restarted with the coordinator a short grace to reconnect
                wait_for_nodes(grid, cfg.min_nodes, min(cfg.round_timeout, RESUME_GRACE_S))
            except FedsplitError:
                wait_for_nodes(grid, quorum, cfg.round_timeout)
            check_strategy_fits(aggregator, max(cfg.min_nodes, len(list(grid.get_node_ids()))),
                                cfg)
            setup = ModelSetup(resume.arrays(), resume.model_id, resume.schema,
                               federated=(tuple(resume.history.federated)
                                          if resume.history.federated is not None else None))
            done = resume.last_round
            if optimizer is not None:
                resume.restore_optimizer(optimizer)
        else:
            nodes = wait_for_nodes(grid, cfg.min_nodes, cfg.round_timeout)
            check_strategy_fits(aggregator, max(cfg.min_nodes, len(nodes)), cfg)
            setup = prepare_model(grid, nodes, cfg)
            history.set_model(setup.model_id, setup.federated)
            history.set_schema(setup.schema, setup.warnings)
            done = 0
        loop = compose_loop(  # plain or secure merge step, the dp hook (server/compose.py)
            cfg,
            aggregator,
            history,
            quorum=quorum,
            deadline=cfg.round_timeout,
            cohort_caps=cfg.caps,
            cap_policy=cfg.cap_policy,
            backend=backend,
            fraction_train=cfg.fraction_train,
            server_optimizer=optimizer,
            federated=setup.federated,
            site_names=setup.site_names,
        )
        # the task kind's own fit instead of the rounds (survival: the exact Cox fit)
        if not run_phase("fit", grid, cfg, setup, history) and done < cfg.num_server_rounds:
            loop.run(  # one message per hospital per round (server/rounds.py)
                grid,
                initial_arrays=setup.hand_over(),
                num_rounds=cfg.num_server_rounds - done,
                timeout=cfg.round_timeout,
                train_config=wire.train_config(setup.model_id, cfg.proximal_mu, setup.schema),
                evaluate_config=wire.evaluate_config(setup.model_id, setup.schema),
            )
        if (why := history.record.failure()) is not None:  # nothing to present: say why
            raise NoTrainingError(
                f"The federation trained no model: {why}. Fix what each hospital's line says "
                f"(its data, its recipe) and run again. Received: history {history.path}")
        # the task kind's phase after the rounds (survival: the pooled curve, the baseline)
        run_phase("after", grid, cfg, setup, history)
    except FedsplitError as e:
        history.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    history.finish()

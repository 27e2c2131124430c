"""The coordinator: a Flower ServerApp that runs a registry strategy over the hospitals.

Runs unchanged in Flower's simulation engine and in the deployment runtime (SuperLink +
SuperNodes). Everything it needs comes from the run config (`protocol.config.RunConfig`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

import aggregation
from protocol.config import RunConfig
from protocol.errors import FedsplitError
from server.history import RunHistory, find_resume_point
from server.setup import ModelSetup, prepare_model, wait_for_nodes
from server.strategy import RegistryStrategy

log = logging.getLogger(__name__)

app = ServerApp()

RESUME_GRACE_S = 60.0  # a resumed run waits this long for all min-nodes, then goes on with a quorum


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Agree on a starting model, then run the configured rounds."""
    cfg = RunConfig.from_flower(context.run_config)
    aggregator = aggregation.get_strategy(cfg.strategy, cfg.params)
    # A restarted coordinator continues an unfinished run from its last completed round.
    resume = find_resume_point(Path(cfg.out_dir), cfg.to_flower()) if cfg.resume else None
    history = RunHistory(Path(cfg.out_dir), cfg.to_flower(),
                         previous=resume.history if resume else None)
    quorum = cfg.quorum or cfg.min_nodes
    try:
        if resume is not None:
            log.info("Resuming after round %d from %s", resume.last_round, resume.global_model)
            try:  # give hospitals restarted with the coordinator a short grace to reconnect
                wait_for_nodes(grid, cfg.min_nodes, min(cfg.round_timeout, RESUME_GRACE_S))
            except FedsplitError:
                wait_for_nodes(grid, quorum, cfg.round_timeout)
            setup = ModelSetup(resume.arrays(), resume.model_id)
            done = resume.last_round
        else:
            nodes = wait_for_nodes(grid, cfg.min_nodes, cfg.round_timeout)
            setup = prepare_model(grid, nodes, cfg)
            history.set_model(setup.model_id)
            done = 0
        strategy = RegistryStrategy(
            aggregator,
            history,
            quorum=quorum,
            deadline=cfg.round_timeout,
            round_offset=done,
            cohort_caps=cfg.caps,
            cap_policy=cfg.cap_policy,
            fraction_train=cfg.fraction_train,
            fraction_evaluate=1.0,
            min_train_nodes=quorum,
            min_evaluate_nodes=quorum,
            min_available_nodes=quorum,
        )
        if done < cfg.num_server_rounds:
            strategy.start(
                grid=grid,
                initial_arrays=setup.arrays,
                num_rounds=cfg.num_server_rounds - done,
                timeout=cfg.round_timeout,
                train_config=ConfigRecord({"model-id": setup.model_id,
                                           "proximal-mu": cfg.proximal_mu}),
                evaluate_config=ConfigRecord({"model-id": setup.model_id}),
            )
    except FedsplitError as e:
        history.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    history.finish()

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
from server.history import RunHistory
from server.setup import prepare_model, wait_for_nodes
from server.strategy import RegistryStrategy

log = logging.getLogger(__name__)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Agree on a starting model, then run the configured rounds."""
    cfg = RunConfig.from_flower(context.run_config)
    aggregator = aggregation.get_strategy(cfg.strategy, cfg.params)
    history = RunHistory(Path(cfg.out_dir), cfg.to_flower())
    try:
        nodes = wait_for_nodes(grid, cfg.min_nodes, cfg.round_timeout)
        setup = prepare_model(grid, nodes, cfg)
        history.set_model(setup.model_id)
        strategy = RegistryStrategy(
            aggregator,
            history,
            fraction_train=cfg.fraction_train,
            fraction_evaluate=1.0,
            min_train_nodes=cfg.min_nodes,
            min_evaluate_nodes=cfg.min_nodes,
            min_available_nodes=cfg.min_nodes,
        )
        strategy.start(
            grid=grid,
            initial_arrays=setup.arrays,
            num_rounds=cfg.num_server_rounds,
            timeout=cfg.round_timeout,
            train_config=ConfigRecord({"model-id": setup.model_id, "proximal-mu": cfg.proximal_mu}),
            evaluate_config=ConfigRecord({"model-id": setup.model_id}),
        )
    except FedsplitError as e:
        history.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    history.finish()

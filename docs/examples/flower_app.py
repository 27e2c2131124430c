"""A Flower app of your own whose coordinator merges updates with fedsplit's trimmed mean.

Your ClientApp trains as it always did; only the ServerApp changes: `RegistryStrategy` is
Flower's FedAvg round loop with fedsplit's aggregation (validated replies, a robust rule, a
report per round, history.json). Components: ``flower_app:server`` and ``flower_app:client``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fedsplit.aggregation import get_strategy
from fedsplit.server.history import RunHistory
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    out = Path(str(context.run_config.get("out-dir", "flower-app-out")))
    rounds = int(context.run_config.get("num-server-rounds", 3))
    history = RunHistory(out, config={"strategy": "trimmed-mean"})  # out/history.json, each round
    strategy = RegistryStrategy(
        get_strategy("trimmed-mean", {"beta": 0.2}),  # any rule of `fedsplit strategies`
        history,
        fraction_evaluate=0.0,
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(4, np.float32)]),
                            num_rounds=rounds, train_config=ConfigRecord({"model-id": "my-model-v1"}))
    np.save(out / "final.npy", result.arrays.to_numpy_ndarrays()[0])
    history.finish()


@client.train()
def train(msg: Message, context: Context) -> Message:
    # Your own training goes here; this hospital moves the weights towards its own target.
    node = int(context.node_config.get("partition-id", 0))
    weights = msg.content["arrays"].to_numpy_ndarrays()
    target = np.full(4, float(node), np.float32)
    new = [w + 0.5 * (target - w) for w in weights]
    content = RecordDict({"arrays": ArrayRecord(new),
                          "metrics": MetricRecord({"num-examples": 100 + 10 * node})})
    return Message(content=content, reply_to=msg)

"""The bare ServerApp: Flower's FedAvg over all hospitals, train and (unless evaluate=0)
evaluate every round; writes the wall time at the start and at the end of every round to
``times-file`` (JSON lines) for bench/deploy_rounds.py."""

from __future__ import annotations

import json
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


class Timed(FedAvg):
    """FedAvg that notes when each round ends (after its last phase)."""

    def __init__(self, path: str, evaluate: bool, **kw) -> None:
        super().__init__(**kw)
        self.path, self.evaluate = path, evaluate

    def note(self, **what) -> None:
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({**what, "t": time.time()}) + "\n")

    def aggregate_train(self, server_round, replies):
        out = super().aggregate_train(server_round, replies)
        if not self.evaluate:
            self.note(round=server_round)
        return out

    def aggregate_evaluate(self, server_round, replies):
        out = super().aggregate_evaluate(server_round, replies)
        self.note(round=server_round)
        return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n, evaluate = int(cfg["min-nodes"]), bool(int(cfg["evaluate"]))
    strategy = Timed(str(cfg["times-file"]), evaluate, fraction_train=1.0,
                     fraction_evaluate=1.0 if evaluate else 0.0, min_train_nodes=n,
                     min_evaluate_nodes=n, min_available_nodes=n)
    strategy.note(start=True)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(torch.nn.Linear(30, 1).state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), timeout=600,
                   train_config=ConfigRecord({}))

"""Reference for bench/round_overhead.py: the same model and data through plain Flower FedAvg.

No fedsplit coordinator logic: no registry, no reply validation, no history or weight files,
no stats/init exchange (the initial model is built in the ServerApp). The ClientApp does the
same local work as fedsplit's agent (same data loading, model and training loop), so the
difference in per-round time is fedsplit's coordinator overhead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from fedsplit.client.models import build_model
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.site import load_site
from fedsplit.client.train import fit_steps, local_steps_per_round, score
from fedsplit.protocol.config import RunConfig
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

torch.set_num_threads(1)

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Plain FedAvg over the same model; per-round timestamps go to history.json."""
    cfg = RunConfig.from_flower(context.run_config)
    model_id = Path(cfg.initial_weights).read_text().strip()  # the bench passes the model id here
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    marks: list[float] = [time.monotonic()]

    def on_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # Flower calls evaluate_fn once before round 1
            marks[0] = time.monotonic()
            return None
        marks.append(time.monotonic())
        rounds = [{"round": i + 1, "seconds": round(marks[i + 1] - marks[i], 3)}
                  for i in range(len(marks) - 1)]
        (out / "history.json").write_text(json.dumps({"status": "running", "rounds": rounds}))
        return None

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=cfg.min_nodes,
                      min_evaluate_nodes=cfg.min_nodes, min_available_nodes=cfg.min_nodes)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(build_model(model_id, seed=0).state_dict()),
                   num_rounds=cfg.num_server_rounds, timeout=cfg.round_timeout,
                   train_config=ConfigRecord({"model-id": model_id}),
                   evaluate_config=ConfigRecord({"model-id": model_id}), evaluate_fn=on_round)
    data = json.loads((out / "history.json").read_text())
    data["status"] = "finished"
    (out / "history.json").write_text(json.dumps(data))


def _model(msg: Message) -> torch.nn.Module:
    model = build_model(str(msg.content["config"]["model-id"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Same local training as fedsplit's agent: as many optimizer steps (at least
    MIN_LOCAL_STEPS: `local_steps_per_round`) of the same batch size."""
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(NodeConfig.from_flower(context.node_config), context.node_id, cfg)
    model = _model(msg)
    steps = local_steps_per_round(len(site.train), local_steps=cfg.local_steps,
                                  local_epochs=cfg.local_epochs, batch_size=cfg.batch_size)
    loss = fit_steps(model, site.train.x, site.train.y, steps=steps, lr=cfg.lr,
                     batch_size=cfg.batch_size, seed=cfg.seed)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(site.train),
                                                        "train-loss": float(loss)})}),
                   reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Same local evaluation as fedsplit's agent."""
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(NodeConfig.from_flower(context.node_config), context.node_id, cfg)
    result = score(_model(msg), site.val.x, site.val.y)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": len(site.val),
                                                        **{k: float(v) for k, v in result.items()}})}),
                   reply_to=msg)



"""The hospital agent: a Flower ClientApp that trains locally and ships only weights and counts.

Handlers (Flower message types):

- ``query.stats``: per-feature count, sum and sum of squares of the site's training rows (and of
  the target for regression), so the federation agrees on one standardisation.
- ``query.init``: build the initial model with the agreed statistics (asked of one site).
- ``train``: load the global model, train ``local-epochs`` on local rows, reply with the weights,
  ``num-examples`` and scalar metrics.
- ``evaluate``: score the global model on the site's held-out rows.

Rows, labels and IDs never leave: every reply holds arrays named like the model's parameters,
numbers, and the site's name.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.attacks import Attack, hostile_sites, parse_attack
from client.data import feature_stats
from client.models import ModelSpec, build_model
from client.parallel import fit_parallel
from client.site import load_site
from client.train import pick_device, score, set_statistics
from protocol.config import RunConfig
from protocol.errors import ConfigError
from protocol.update import Update

torch.set_num_threads(1)  # one thread per hospital process: many small jobs share the cores

app = ClientApp()


def _config(msg: Message) -> ConfigRecord:
    return msg.content.config_records.get("config", ConfigRecord())


def _site_record(name: str) -> ConfigRecord:
    return ConfigRecord({"name": name})


@app.query("stats")
def stats(msg: Message, context: Context) -> Message:
    """Reply with aggregate feature (and target) statistics of the local training rows."""
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(context.node_config, context.node_id, cfg)
    count, total, sumsq = feature_stats(site.train)
    y = site.train.y.astype(np.float64)
    metrics = MetricRecord({
        "num-examples": len(site.train),
        "count": count.tolist(),
        "sum": total.tolist(),
        "sumsq": sumsq.tolist(),
        "label-max": int(site.train.y.max()) if site.train.task == "classification" else 0,
        "y-sum": float(y.sum()),
        "y-sumsq": float((y**2).sum()),
    })
    schema = ConfigRecord({
        "name": site.name,
        "kind": site.train.kind,
        "task": site.train.task,
        "input-shape": [int(d) for d in site.train.x.shape[1:]],
        "features": site.train.feature_names,
    })
    return Message(RecordDict({"stats": metrics, "schema": schema}), reply_to=msg)


@app.query("init")
def init(msg: Message, context: Context) -> Message:
    """Reply with a freshly initialised model that carries the agreed statistics."""
    cfg = RunConfig.from_flower(context.run_config)
    c = _config(msg)
    spec = ModelSpec(
        kind=str(c["kind"]),
        task=str(c["task"]),
        input_shape=tuple(int(d) for d in c["input-shape"]),
        num_outputs=int(c["num-outputs"]),
        hidden=cfg.hidden_widths,
    )
    model = build_model(spec, seed=cfg.seed)
    set_statistics(model, np.asarray(c["mean"]), np.asarray(c["std"]),
                   float(c["y-mean"]), float(c["y-std"]))
    return Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()),
                    "model": ConfigRecord({"model-id": spec.to_id()})}),
        reply_to=msg,
    )


def _global_model(msg: Message) -> torch.nn.Module:
    model = build_model(str(_config(msg)["model-id"]))
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    return model


def _hostile(context: Context, cfg: RunConfig) -> Attack | None:
    """The attack this simulated site plays, if it is one of the last ``attackers`` sites."""
    attack = parse_attack(cfg.attack)
    if attack is None or cfg.attackers == 0:
        return None
    if "partition-id" not in context.node_config:
        raise ConfigError(
            "attack/attackers make simulated sites hostile and need Flower's simulation engine "
            "(which numbers sites with partition-id). Received: node config "
            f"{dict(context.node_config)}"
        )
    sites = int(context.node_config["num-partitions"])
    hostile = hostile_sites(sites, cfg.attackers)
    return attack if int(context.node_config["partition-id"]) in hostile else None


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the global model on local rows; reply with weights, count and metrics."""
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(context.node_config, context.node_id, cfg)
    c = _config(msg)
    model = _global_model(msg)
    device = pick_device(cfg.device)
    server_round = int(c.get("server-round", 0))
    attack = _hostile(context, cfg)
    y = site.train.y
    if attack is not None:  # a simulated hostile hospital (attack/attackers in the run config)
        y = attack.poison_labels(y, model.spec.num_outputs)
        start = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    result = fit_parallel(
        model, site.train.x, y,
        epochs=cfg.local_epochs, lr=cfg.lr, batch_size=cfg.batch_size,
        seed=cfg.seed * 100_003 + server_round, device=device,
        proximal_mu=float(c.get("proximal-mu", cfg.proximal_mu)), parallel=cfg.parallel,
    )
    update = Update.from_state_dict(model.state_dict(), num_examples=len(site.train))
    record = update.to_array_record()
    if attack is not None:  # poisoned weights skip the sender's own checks: the coordinator's guard
        poisoned = attack.poison_update(update.arrays, start, seed=cfg.seed * 7919 + server_round)
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in poisoned.items()})
    info = result.metrics()
    metrics = MetricRecord({
        "num-examples": update.num_examples,
        "train-loss": result.loss,
        "on-gpu": int(device.type == "cuda"),
        **{k: v for k, v in info.items() if isinstance(v, int | float)},
    })
    site_record = ConfigRecord({"name": site.name, "device": str(device),
                                **{k: v for k, v in info.items() if isinstance(v, str)}})
    return Message(
        RecordDict({"arrays": record, "metrics": metrics, "site": site_record}),
        reply_to=msg,
    )


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the global model on the site's held-out rows."""
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(context.node_config, context.node_id, cfg)
    model = _global_model(msg)
    result = score(model, site.val.x, site.val.y, pick_device(cfg.device))
    metrics = MetricRecord({"num-examples": len(site.val), **result})
    return Message(RecordDict({"metrics": metrics, "site": _site_record(site.name)}), reply_to=msg)

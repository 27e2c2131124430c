"""The hospital agent: a Flower ClientApp that trains locally and ships only weights and counts.

Handlers (Flower message types):

- ``query.stats``: per-feature count, sum and sum of squares of the site's training rows (and of
  the target for regression), so the federation agrees on one standardisation.
- ``query.init``: build the initial model with the agreed statistics (asked of one site).
- ``train``: load the global model, train ``local-epochs`` on local rows, reply with the weights,
  ``num-examples`` and scalar metrics.
- ``evaluate``: score the global model on the site's held-out rows.

Rows, labels and IDs never leave: every reply holds arrays named like the model's parameters,
numbers, and the site's name. Every instruction and reply is read and built by
`protocol.horizontal_wire`, which lists the records and keys each may carry and refuses others.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from client.attacks import Attack, hostile_sites, parse_attack
from client.data import feature_stats
from client.models import ModelSpec, build_model
from client.parallel import fit_parallel
from client.site import load_site
from client.train import pick_device, score, set_statistics
from protocol import horizontal_wire as wire
from protocol.config import RunConfig
from protocol.errors import ConfigError
from protocol.update import Update, arrays_to_state_dict, state_dict_arrays

torch.set_num_threads(1)  # one thread per hospital process: many small jobs share the cores

app = ClientApp()


@app.query("stats")
def stats(msg: Message, context: Context) -> Message:
    """Reply with aggregate feature (and target) statistics of the local training rows."""
    wire.check_content(wire.STATS, msg.content, reply=False)
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(context.node_config, context.node_id, cfg)
    count, total, sumsq = feature_stats(site.train)
    y = site.train.y.astype(np.float64)
    reply = wire.build_stats_reply(wire.SiteStats(
        name=site.name, kind=site.train.kind, task=site.train.task,
        input_shape=tuple(int(d) for d in site.train.x.shape[1:]),
        features=list(site.train.feature_names), num_examples=len(site.train),
        count=count, sum=total, sumsq=sumsq,
        label_max=int(site.train.y.max()) if site.train.task == "classification" else 0,
        y_sum=float(y.sum()), y_sumsq=float((y**2).sum()),
    ))
    return Message(reply, reply_to=msg)


@app.query("init")
def init(msg: Message, context: Context) -> Message:
    """Reply with a freshly initialised model that carries the agreed statistics."""
    cfg = RunConfig.from_flower(context.run_config)
    request = wire.parse_init_instruction(msg)
    spec = ModelSpec(kind=request.kind, task=request.task, input_shape=request.input_shape,
                     num_outputs=request.num_outputs, hidden=request.hidden, norm=request.norm)
    model = build_model(spec, seed=cfg.seed)
    set_statistics(model, request.mean, request.std, request.y_mean, request.y_std)
    reply = wire.build_init_reply(state_dict_arrays(model.state_dict()), spec.to_id())
    return Message(reply, reply_to=msg)


def _global_model(instruction: wire.ModelInstruction) -> torch.nn.Module:
    model = build_model(instruction.model_id)
    model.load_state_dict(arrays_to_state_dict(instruction.arrays, like=model.state_dict()))
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
    instruction = wire.parse_model_instruction(msg, wire.TRAIN)
    model = _global_model(instruction)
    device = pick_device(cfg.device)
    server_round = instruction.server_round
    attack = _hostile(context, cfg)
    y = site.train.y
    if attack is not None:  # a simulated hostile hospital (attack/attackers in the run config)
        y = attack.poison_labels(y, model.spec.num_outputs)
        start = state_dict_arrays(model.state_dict())
    mu = instruction.proximal_mu
    result = fit_parallel(
        model, site.train.x, y,
        epochs=cfg.local_epochs, lr=cfg.lr, batch_size=cfg.batch_size,
        seed=cfg.seed * 100_003 + server_round, device=device,
        proximal_mu=cfg.proximal_mu if mu is None else mu, parallel=cfg.parallel,
    )
    update = Update.from_state_dict(model.state_dict(), num_examples=len(site.train))
    info = result.metrics()
    metrics = {"train-loss": result.loss, "on-gpu": int(device.type == "cuda"),
               **{k: v for k, v in info.items() if isinstance(v, int | float)}}
    site_info = {"name": site.name, "device": str(device),
                 **{k: v for k, v in info.items() if isinstance(v, str)}}
    if attack is not None:  # poisoned weights skip the sender's own checks: the coordinator's guard
        poisoned = attack.poison_update(update.arrays, start, seed=cfg.seed * 7919 + server_round)
        reply = wire.build_train_reply(poisoned, {wire.NUM_EXAMPLES: update.num_examples, **metrics},
                                       site_info)
    else:
        reply = wire.build_train_reply(update, metrics, site_info)
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the global model on the site's held-out rows."""
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(context.node_config, context.node_id, cfg)
    model = _global_model(wire.parse_model_instruction(msg, wire.EVALUATE))
    result = score(model, site.val.x, site.val.y, pick_device(cfg.device))
    reply = wire.build_evaluate_reply({wire.NUM_EXAMPLES: len(site.val), **result},
                                      {wire.SITE_NAME: site.name})
    return Message(reply, reply_to=msg)

"""The hospital agent: a Flower ClientApp that trains locally and ships only weights and counts.

Handlers (Flower message types):

- ``query.schema``: the site's column report (`protocol.schema.column_report`: kinds, missing
  counts, frequent categories; never a row), from which the coordinator merges one schema.
- ``query.stats``: per-feature count, sum and sum of squares of the site's training rows, encoded
  with the schema the instruction carries (and of the target for regression), so the
  federation agrees on one standardisation.
- ``query.init``: build the initial model with the agreed statistics (asked of one site).
- ``train``: load the global model, train ``local_steps_per_round`` mini-batches on local rows
  (``local-steps``, or ``local-epochs`` epochs but at least 10 steps), reply with the weights,
  ``num-examples`` and scalar metrics.
- ``evaluate``: score the global model on the site's held-out rows.
- ``query.survival``: after a survival run, the summary's sums (Kaplan-Meier counts, Breslow
  baseline sums of the kept model; `client.survival.summary`).

Rows, labels and IDs never leave: every reply holds arrays named like the model's parameters,
numbers, and the site's name. Every instruction and reply is read and built by
`protocol.horizontal_wire`, which lists the records and keys each may carry and refuses others.
"""

from __future__ import annotations

import numpy as np
import torch
from fedsplit.client.attacks import Attack, hostile_sites, parse_attack
from fedsplit.client.data import feature_stats
from fedsplit.client.models import KINDS, RECIPE_KIND, ModelSpec, build_model, recipe_of
from fedsplit.client.parallel import fit_parallel
from fedsplit.client.privacy.agent import patient_dp, train_private
from fedsplit.client.recipes import ModelInputs, builtin_recipe
from fedsplit.client.secure.agent import handle_query, take_secure_record, train_reply
from fedsplit.client.site import effective_recipe, load_site, site_columns, site_recipe
from fedsplit.client.train import (
    batches_per_epoch,
    local_steps_per_round,
    pick_device,
    score,
    set_statistics,
    step_rows,
)
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.update import Update, arrays_to_state_dict, state_dict_arrays
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

torch.set_num_threads(1)  # one thread per hospital process: many small jobs share the cores

app = ClientApp()


@app.query("schema")
def schema(msg: Message, context: Context) -> Message:
    """Reply with the site's column report (no rows; rare categories withheld)."""
    wire.check_content(wire.SCHEMA_QUERY, msg.content, reply=False)
    cfg = RunConfig.from_flower(context.run_config)
    report = site_columns(context.node_config, context.node_id, cfg)
    return Message(wire.build_schema_reply(report), reply_to=msg)


@app.query("stats")
def stats(msg: Message, context: Context) -> Message:
    """Reply with aggregate feature (and target) statistics of the local training rows."""
    wire.check_content(wire.STATS, msg.content, reply=False)
    cfg = RunConfig.from_flower(context.run_config)
    site = load_site(context.node_config, context.node_id, cfg, wire.instruction_schema(msg))
    count, total, sumsq = feature_stats(site.train)
    y = site.train.y.astype(np.float64)
    reply = wire.build_stats_reply(wire.SiteStats(
        name=site.name, kind=site.train.kind, task=site.train.task,
        input_shape=tuple(int(d) for d in site.train.x.shape[1:]),
        features=list(site.train.feature_names), num_examples=len(site.train),
        count=count, sum=total, sumsq=sumsq,
        label_max=int(site.train.y.max()) if site.train.task == "classification" else 0,
        y_sum=float(y.sum()), y_sumsq=float((y**2).sum()),
        recipe=effective_recipe(context.node_config, cfg, site.train.kind).identity.to_json(),
    ))
    return Message(reply, reply_to=msg)


@app.query("secagg")
def secagg(msg: Message, context: Context) -> Message:
    """Secure aggregation's setup, share-keys and unmask stages (`client.secure`)."""
    return Message(handle_query(msg.content, msg.metadata.dst_node_id, context), reply_to=msg)


@app.query("init")
def init(msg: Message, context: Context) -> Message:
    """Reply with a freshly initialised model that carries the agreed statistics."""
    cfg = RunConfig.from_flower(context.run_config)
    request = wire.parse_init_instruction(msg)
    if request.kind in KINDS:  # a built-in model, as the coordinator describes it
        recipe = builtin_recipe(request.kind, hidden=request.hidden, norm=request.norm)
    elif (recipe := site_recipe(context.node_config, cfg)) is None:
        raise ConfigError("The coordinator asks for the federation's recipe model, but this "
                          "hospital runs no recipe. Start it with --recipe (node config recipe). "
                          f"Received: kind={request.kind!r}")
    spec: ModelSpec = recipe.model_spec(ModelInputs(request.task, request.input_shape,
                                                    request.num_outputs))
    model = build_model(spec, seed=cfg.seed, recipe=recipe)
    set_statistics(model, request.mean, request.std, request.y_mean, request.y_std)
    reply = wire.build_init_reply(state_dict_arrays(model.state_dict()), spec.to_id())
    return Message(reply, reply_to=msg)


def _global_model(instruction: wire.ModelInstruction, context: Context,
                  cfg: RunConfig) -> torch.nn.Module:
    """The coordinator's model; a recipe model must be this hospital's own recipe (same name,
    version and parameters), else it is refused with the difference."""
    spec = ModelSpec.from_id(instruction.model_id)
    recipe = None
    if spec.kind == RECIPE_KIND:
        recipe = site_recipe(context.node_config, cfg)
        if recipe is None:
            raise ConfigError(
                f"The federation's model was built by recipe {spec.identity.label()}, but this "
                f"hospital runs no recipe. Start it with --recipe (node config recipe). "
                f"Received: {spec.identity.to_json()}"
            )
    model = build_model(spec, recipe=recipe, strict=True)
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


@app.query("survival")
def survival_summary(msg: Message, context: Context) -> Message:
    """After a survival run: one stage of the curve and baseline sums (`client.survival.summary`)."""
    from fedsplit.client.survival.summary import answer

    return answer(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the global model on local rows; reply with weights, count and metrics."""
    cfg = RunConfig.from_flower(context.run_config)
    secure = take_secure_record(msg.content)  # secure aggregation's collect stage, or None
    instruction = wire.parse_model_instruction(msg, wire.TRAIN)
    site = load_site(context.node_config, context.node_id, cfg, instruction.schema)
    model = _global_model(instruction, context, cfg)
    device = pick_device(cfg.device)
    server_round = instruction.server_round
    attack = _hostile(context, cfg)
    y = site.train.y
    if attack is not None:  # a simulated hostile hospital (attack/attackers in the run config)
        y = attack.poison_labels(y, model.spec.num_outputs)
        start = state_dict_arrays(model.state_dict())
    mu = instruction.proximal_mu
    seed = cfg.seed * 100_003 + server_round
    x = site.train.x
    steps = local_steps_per_round(len(x), local_steps=cfg.local_steps,
                                  local_epochs=cfg.local_epochs, batch_size=cfg.batch_size)
    if (dp := patient_dp(cfg)) is not None:  # DP-SGD within the hospital's budget (client/privacy)
        loss, epsilon = train_private(model, x, y, dp, cfg, steps=steps, server_round=server_round,
                                      site=site.name, seed=seed, device=device,
                                      proximal_mu=cfg.proximal_mu if mu is None else mu)
        update = Update.from_state_dict(model.state_dict(), num_examples=len(site.train))
        metrics = {wire.TRAIN_LOSS: loss, wire.ON_GPU: int(device.type == "cuda"), wire.DP_EPSILON: epsilon}
        site_info = {"name": site.name, "device": str(device)}
        return Message(train_reply(secure, context, instruction.arrays, update, metrics, site_info),
                       reply_to=msg)
    rows = step_rows(len(x), steps, cfg.batch_size, seed)
    if rows is not None:  # exactly `steps` mini-batches: one pass over reshuffled repeats
        x, y = x[rows], y[rows]
    result = fit_parallel(
        model, x, y,
        epochs=1 if rows is not None else steps // batches_per_epoch(len(x), cfg.batch_size),
        lr=cfg.lr, batch_size=min(cfg.batch_size, len(site.train)),
        seed=seed, device=device,
        proximal_mu=cfg.proximal_mu if mu is None else mu, parallel=cfg.parallel,
    )
    update = Update.from_state_dict(model.state_dict(), num_examples=len(site.train))
    info = result.metrics()
    metrics = {wire.TRAIN_LOSS: result.loss, wire.ON_GPU: int(device.type == "cuda"),
               **{k: v for k, v in info.items() if isinstance(v, int | float)}}
    site_info = {"name": site.name, "device": str(device),
                 **{k: v for k, v in info.items() if isinstance(v, str)}}
    if attack is not None:  # poisoned weights skip the sender's own checks: the coordinator's guard
        poisoned = attack.poison_update(update.arrays, start, seed=cfg.seed * 7919 + server_round)
        reply = wire.build_train_reply(poisoned, {wire.NUM_EXAMPLES: update.num_examples, **metrics},
                                       site_info)
    else:
        reply = train_reply(secure, context, instruction.arrays, update, metrics, site_info)
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the global model on the site's held-out rows."""
    cfg = RunConfig.from_flower(context.run_config)
    instruction = wire.parse_model_instruction(msg, wire.EVALUATE)
    site = load_site(context.node_config, context.node_id, cfg, instruction.schema)
    model = _global_model(instruction, context, cfg)
    result = score(model, site.val.x, site.val.y, pick_device(cfg.device))
    names = recipe_of(model).metric_names(model.spec.task)
    reply = wire.build_evaluate_reply({wire.NUM_EXAMPLES: len(site.val), **result},
                                      {wire.SITE_NAME: site.name},
                                      metrics_allowed=names)
    return Message(reply, reply_to=msg)

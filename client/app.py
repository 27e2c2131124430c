"""The hospital agent: a Flower ClientApp that trains locally and ships only weights and counts.

Handlers (Flower message types):

- ``query.schema``: the site's column report (`protocol.schema.column_report`: kinds, missing
  counts, frequent categories; never a row), from which the coordinator merges one schema.
- ``query.stats``: per-feature count, sum and sum of squares of the site's training rows, encoded
  with the schema the instruction carries (and of the target for regression), so the
  federation agrees on one standardisation.
- ``query.setup``: both of the above in one exchange (the stats encoded with the site's own
  schema; the coordinator asks ``query.stats`` again only where the agreed schema differs).
- ``query.init``: build the initial model with the agreed statistics (asked of every site).
- ``train``: load the global model, train ``local_steps_per_round`` mini-batches on local rows
  (``local-steps``, or ``local-epochs`` epochs but at least 10 steps), reply with the weights,
  ``num-examples`` and scalar metrics; with ``evaluate-first`` (one message per round) first
  score the received model on the validation rows and add those metrics (``evaluation``).
- ``evaluate``: score the global model on the site's held-out rows.
- ``query.<name>``: a task kind's own messages (`protocol.tasks.TaskKind.client_phases`):
  ``query.survival``, after a survival run, the summary's sums (Kaplan-Meier counts, Breslow
  baseline sums of the kept model; `client.survival.summary`).

Rows, labels and IDs never leave: every reply holds arrays named like the model's parameters,
numbers, and the site's name. Every instruction and reply is read and built by
`protocol.horizontal_wire`, which lists the records and keys each may carry and refuses others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from fedsplit.client.data import feature_stats, local_state_path
from fedsplit.client.failures import answered, hospital_stage
from fedsplit.client.models import ModelSpec, build_model, recipe_of
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.policy import policy_mod
from fedsplit.client.recipes import ModelInputs, Recipe, recipe_to_build
from fedsplit.client.site import (
    SiteData,
    effective_recipe,
    load_site,
    site_columns,
    site_name,
    site_recipe,
)
from fedsplit.client.train import (
    batches_per_epoch,
    local_steps_per_round,
    pick_device,
    score,
    set_statistics,
    step_batch_size,
    step_rows,
)
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import model_plan
from fedsplit.protocol.atomic import atomic_path
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import SECAGG, DPSpec
from fedsplit.protocol.recipe import requested_recipe
from fedsplit.protocol.tasks import resolve, task_kind, task_names
from fedsplit.protocol.update import (
    Update,
    arrays_to_state_dict,
    c_contiguous,
    state_dict_arrays,
)
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

if TYPE_CHECKING:
    from fedsplit.client.attacks import Attack

torch.set_num_threads(1)  # one thread per hospital process: many small jobs share the cores

app = ClientApp(mods=[policy_mod("horizontal")])  # the hospital's policy and egress log

LOCAL = "fedsplit-local"  # Context.state array record: this hospital's tensors that never travel


def _node(context: Context) -> NodeConfig:
    """This hospital's node config, read into its model (`client.node_config`): the one way
    every handler reads it."""
    return NodeConfig.from_flower(context.node_config)


def _name(context: Context) -> str:
    """This hospital's name (node config site-name, else by partition, else its node id)."""
    return site_name(_node(context), context.node_id,
                     RunConfig.from_flower(context.run_config))


def _site(context: Context, cfg: RunConfig, schema: str | None = None) -> SiteData:
    """This hospital's rows, read (and its failures named) as the stage "reading its data"."""
    with hospital_stage(site_name(_node(context), context.node_id, cfg), "reading its data"):
        return load_site(_node(context), context.node_id, cfg, schema)


@app.query("schema")
@answered("reading its data", _name)
def schema(msg: Message, context: Context) -> Message:
    """Reply with the site's column report (no rows; rare categories withheld)."""
    wire.check_content(wire.SCHEMA_QUERY, msg.content, reply=False)
    cfg = RunConfig.from_flower(context.run_config)
    with hospital_stage(_name(context), "reading its data"):
        report = site_columns(_node(context), context.node_id, cfg)
    return Message(wire.build_schema_reply(report), reply_to=msg)


@app.query("stats")
@answered("reading its data", _name)
def stats(msg: Message, context: Context) -> Message:
    """Reply with aggregate feature (and target) statistics of the local training rows."""
    wire.check_content(wire.STATS, msg.content, reply=False)
    cfg = RunConfig.from_flower(context.run_config)
    site = _site(context, cfg, wire.instruction_schema(msg))
    stats = _stats(site, context, cfg)
    return Message(wire.build_stats_reply(stats, _model_check(site, stats, context, cfg)),
                   reply_to=msg)


def _stats(site: SiteData, context: Context, cfg: RunConfig) -> wire.SiteStats:
    """The site's per-feature moments of its training rows, as encoded, and its recipe."""
    count, total, sumsq = feature_stats(site.train)
    y = site.train.y.astype(np.float64)
    return wire.SiteStats(
        name=site.name, kind=site.train.kind, task=site.train.task,
        input_shape=tuple(int(d) for d in site.train.x.shape[1:]),
        features=list(site.train.feature_names), num_examples=len(site.train),
        count=count, sum=total, sumsq=sumsq,
        label_max=int(site.train.y.max()) if task_kind(site.train.task).classes else 0,
        y_sum=float(y.sum()), y_sumsq=float((y**2).sum()),
        recipe=effective_recipe(_node(context), cfg, site.train.kind).identity.to_json(),
    )


@app.query("setup")
@answered("reading its data", _name)
def setup(msg: Message, context: Context) -> Message:
    """``query.schema`` and ``query.stats`` in one exchange: the column report, and the stats
    of the rows encoded with the site's own schema (named by its digest). The coordinator
    asks ``query.stats`` again, with the agreed schema, only where that differs. A site that
    cannot encode its rows on its own (its failure then waits for that second question, with
    the agreed schema) sends the report alone."""
    wire.check_content(wire.SETUP_QUERY, msg.content, reply=False)
    cfg = RunConfig.from_flower(context.run_config)
    with hospital_stage(_name(context), "reading its data"):
        report = site_columns(_node(context), context.node_id, cfg)
    try:
        site = _site(context, cfg)
        stats = _stats(site, context, cfg)
    except Exception:  # named again, with the agreed schema, by query.stats
        return Message(wire.build_setup_reply(report), reply_to=msg)
    schema = site.train.schema
    encoded_with = schema.digest() if report.table and schema is not None else ""
    return Message(wire.build_setup_reply(report, stats, encoded_with,
                                          _model_check(site, stats, context, cfg)), reply_to=msg)


def _model_check(site: SiteData, stats: wire.SiteStats, context: Context,
                 cfg: RunConfig) -> dict[str, object] | None:
    """The fingerprint of the model ``query.init`` would build here if the federation's
    statistics were this site's own (its records: `protocol.horizontal_wire.build_model_check`:
    no weights), and which tensors hold them (`client.model_check`); None when it cannot be
    built here on its own (``query.init`` then builds it, and names any failure, as before)."""
    from fedsplit.client.model_check import probe_statistics

    try:
        schema = site.train.schema
        request = model_plan.plan_model(
            [stats], task=cfg.task, model=cfg.model, num_classes=cfg.num_classes,
            hidden=cfg.hidden_widths, norm=cfg.norm,
            recipe=effective_recipe(_node(context), cfg, site.train.kind).identity,
            schema_task=schema.task if schema is not None else None,
            labels=len(schema.labels) if schema is not None else 0)
        model, spec, federated = _initial_model(request, _init_recipe(request, context, cfg), cfg)
        statistics, varying = probe_statistics(model, int(np.asarray(request.mean).size),
                                               set_statistics)
        set_statistics(model, request.mean, request.std, request.y_mean, request.y_std)
        _check_dp(model, federated, cfg)
        return wire.build_model_check(state_dict_arrays(model.state_dict()), spec.to_id(),
                                      federated, request, statistics, varying)
    except Exception:  # asked again (query.init) with the federation's statistics
        return None


@app.query("secagg")
@answered("secure aggregation", _name)
def secagg(msg: Message, context: Context) -> Message:
    """Secure aggregation's setup, share-keys and unmask stages (`client.secure`)."""
    from fedsplit.client.secure.agent import handle_query

    return Message(handle_query(msg.content, msg.metadata.dst_node_id, context), reply_to=msg)


@app.query("init")
@answered("building the model", _name)
def init(msg: Message, context: Context) -> Message:
    """Reply with a freshly initialised model that carries the agreed statistics, the names of
    the tensors that travel every round, and this hospital's name. Every hospital answers, so
    the coordinator compares their models before round 1 (names, shapes, dtypes)."""
    cfg = RunConfig.from_flower(context.run_config)
    request = wire.parse_init_instruction(msg)
    name = _name(context)
    recipe = _init_recipe(request, context, cfg)
    with hospital_stage(name, "building the model"):
        _check_outputs(context, name, request.task, request.num_outputs)
        model, spec, federated = _initial_model(request, recipe, cfg)
        set_statistics(model, request.mean, request.std, request.y_mean, request.y_std)
        _check_dp(model, federated, cfg)
    reply = wire.build_init_reply(state_dict_arrays(model.state_dict()), spec.to_id(),
                                  federated=federated, site=name)
    return Message(reply, reply_to=msg)


def _init_recipe(request: wire.ModelRequest, context: Context, cfg: RunConfig) -> Recipe:
    """The recipe that builds the requested model: the built-in one it names, else this
    hospital's own (`client.recipes.recipe_to_build`)."""
    return recipe_to_build(requested_recipe(request.kind, request.hidden, request.norm),
                           site_recipe(_node(context), cfg), where="The federation's model")


def _initial_model(request: wire.ModelRequest, recipe: Recipe, cfg: RunConfig
                   ) -> tuple[torch.nn.Module, ModelSpec, list[str]]:
    """The seeded model ``request`` describes, before its statistics are set (the same at every
    hospital running the same code), its spec and the tensors that travel."""
    spec: ModelSpec = recipe.model_spec(ModelInputs(request.task, request.input_shape,
                                                    request.num_outputs))
    model = build_model(spec, seed=cfg.seed, recipe=recipe)
    return model, spec, _federated(model)


def _check_dp(model: torch.nn.Module, federated: list[str], cfg: RunConfig) -> None:
    """Refuse, before round 1 and with the fix, a model the run's DP cannot train or send."""
    if (dp := DPSpec.parse(cfg.dp)) is not None:
        from fedsplit.client.privacy.agent import check_dp_model, check_dp_travel

        if dp.level == "patient":
            check_dp_model(model, dp, cfg)
        else:
            check_dp_travel(model, federated, dp)


def _federated(model: torch.nn.Module) -> list[str]:
    """The tensors of ``model`` that travel every round (its recipe's `Recipe.federated`)."""
    names = list(recipe_of(model).federated(model))
    state = model.state_dict()
    if not names or any(n not in state for n in names):
        raise ConfigError(f"Recipe {recipe_of(model).name}'s federated(model) must name at least "
                          f"one entry of the model's state_dict. Received: {names[:8]}")
    return [n for n in state if n in set(names)]  # in state_dict order


def _global_model(instruction: wire.ModelInstruction, context: Context,
                  cfg: RunConfig) -> torch.nn.Module:
    """The coordinator's model with this hospital's own tensors that never travel (`LOCAL`:
    e.g. FedBN's BatchNorm layers, counters) put back; a recipe model must be this hospital's
    own recipe (same name, version and parameters), else it is refused with the difference."""
    spec = ModelSpec.from_id(instruction.model_id)
    with hospital_stage(_name(context), "loading the global model"):
        _check_outputs(context, _name(context), spec.task, spec.num_outputs)
        recipe = recipe_to_build(spec.identity, site_recipe(_node(context), cfg),
                                 where=spec.where)
        model = build_model(spec, recipe=recipe, strict=True)
        arrays = dict(instruction.arrays)
        if LOCAL in context.state.array_records:
            own = context.state.array_records[LOCAL]
            arrays.update({k: a.numpy() for k, a in own.items()
                           if k in arrays and tuple(a.shape) == tuple(arrays[k].shape)})
        model.load_state_dict(arrays_to_state_dict(arrays, like=model.state_dict()))
    return model


def _check_outputs(context: Context, name: str, task: str, outputs: int) -> None:
    """Refuse (policy ``max_labels``) a classification model with more classes than this
    hospital allows (`client.policy.labels.check_federation_labels`)."""
    if task_kind(task).classes:
        from fedsplit.client.policy.labels import check_federation_labels
        from fedsplit.client.policy.paths import hospital_policy

        check_federation_labels(hospital_policy(_node(context)), name, outputs,
                                "the federation's model")


def _keep_local(context: Context, cfg: RunConfig, server_round: int,
                start: dict[str, np.ndarray], update: Update, federated: list[str]) -> Update:
    """Keep this hospital's trained tensors that never travel in its `LOCAL` state (and, in
    Flower's simulation, in its staged folder: `local_state_path`, so `fedsplit simulate`
    scores each hospital's own model); return the update with only the tensors that travel."""
    shared = set(federated)
    own = {k: a for k, a in update.arrays.items()
           if k not in shared and (k not in start or not np.array_equal(a, start[k]))}
    if own:
        context.state.array_records[LOCAL] = ArrayRecord(
            {k: Array(c_contiguous(a)) for k, a in own.items()})
        if (folder := _node(context).partition_folder(cfg.data_dir)) is not None:
            path = local_state_path(folder, server_round)
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                np.savez(fh, **own)
    return Update({k: a for k, a in update.arrays.items() if k in shared},
                  num_examples=update.num_examples)


def _patient_dp(cfg: RunConfig) -> DPSpec | None:
    """The run's patient-level DP spec, or None (`client.privacy.agent.patient_dp`, without
    importing the DP-SGD code for a run that does not use it)."""
    spec = DPSpec.parse(cfg.dp)
    return spec if spec is not None and spec.level == "patient" else None


def _hostile(context: Context, cfg: RunConfig) -> Attack | None:
    """The attack this simulated site plays, if it is one of the last ``attackers`` sites."""
    if cfg.attackers == 0:  # (client.attacks is imported only for a simulated attack)
        return None
    from fedsplit.client.attacks import hostile_sites, parse_attack

    attack = parse_attack(cfg.attack)
    if attack is None or cfg.attackers == 0:
        return None
    node = _node(context)
    if node.partition_id is None or node.num_partitions is None:
        raise ConfigError(
            "attack/attackers make simulated sites hostile and need Flower's simulation engine "
            "(which numbers sites with partition-id). Received: node config "
            f"{node.given}"
        )
    hostile = hostile_sites(node.num_partitions, cfg.attackers)
    return attack if node.partition_id in hostile else None


def _task_phase(entry: str) -> Callable[[Message, Context], Message]:
    """The handler of a task kind's ``query.<name>`` message: ``entry``'s function, imported
    when the first such message comes."""
    def answer(msg: Message, context: Context) -> Message:
        reply: Message = resolve(entry)(msg, context)
        return reply

    return answer


# the task kinds' own messages (`protocol.tasks`: survival's ``query.survival``, after a
# survival run: one stage of the curve and baseline sums, `client.survival.summary`)
for _query, _entry in {name: entry for kind in map(task_kind, task_names())
                       for name, entry in kind.client_phases.items()}.items():
    app.query(_query)(_task_phase(_entry))


@app.train()
@answered("training", _name)
def train(msg: Message, context: Context) -> Message:
    """Train the global model on local rows; reply with the tensors that travel, the count and
    metrics (the others stay in this hospital's state)."""
    cfg = RunConfig.from_flower(context.run_config)
    secure = None  # secure aggregation's collect stage, when the instruction carries it
    if SECAGG in msg.content.config_records:
        from fedsplit.client.secure.agent import take_secure_record

        secure = take_secure_record(msg.content)
    instruction = wire.parse_model_instruction(msg, wire.TRAIN)
    site = _site(context, cfg, instruction.schema)
    model = _global_model(instruction, context, cfg)
    federated = _federated(model)
    start = {k: np.asarray(instruction.arrays[k]) for k in instruction.arrays}
    sent = {k: start[k] for k in federated if k in start}
    device = pick_device(cfg.device)
    server_round = instruction.server_round
    attack = _hostile(context, cfg)
    y = site.train.y
    if attack is not None:  # a simulated hostile hospital (attack/attackers in the run config)
        y = attack.poison_labels(y, model.spec.num_outputs)
    evaluation: dict[str, float] | None = None
    if instruction.evaluate_first:  # one message per round: score what came (the previous
        evaluation = _scores(model, site, device)  # round's model) before training, secure too
    mu = instruction.proximal_mu
    seed = cfg.seed * 100_003 + server_round
    x = site.train.x
    batch = step_batch_size(model, len(x), cfg.batch_size)  # a Cox loss: whole risk sets
    steps = local_steps_per_round(len(x), local_steps=cfg.local_steps,
                                  local_epochs=cfg.local_epochs, batch_size=batch)
    with hospital_stage(site.name, "training"):
        from fedsplit.client.privacy.ledger import hospital_account

        # the hospital's own privacy ledger: DP-SGD charged (and refused above its budgets)
        # before it trains, a plain training counted; never by the coordinator's round number
        account = hospital_account(_node(context), cfg, site.name, context.run_id)
        if (dp := _patient_dp(cfg)) is not None:  # DP-SGD within the hospital's budgets
            from fedsplit.client.privacy.agent import train_private

            loss, epsilon = train_private(model, x, y, dp, cfg, steps=steps,
                                          server_round=server_round, account=account, seed=seed,
                                          device=device,
                                          proximal_mu=cfg.proximal_mu if mu is None else mu)
            # the data file's epsilon after this training, over every run (the ledger's)
            info: dict[str, object] = {wire.DP_EPSILON: epsilon}
        else:
            account.record_plain(server_round)
            rows = step_rows(len(x), steps, batch, seed)
            if rows is not None:  # exactly `steps` mini-batches: one pass over reshuffled repeats
                x, y = x[rows], y[rows]
            from fedsplit.client.parallel import fit_parallel

            result = fit_parallel(
                model, x, y,
                epochs=1 if rows is not None else steps // batches_per_epoch(len(x), batch),
                lr=cfg.lr, batch_size=min(batch, len(site.train)),
                seed=seed, device=device,
                proximal_mu=cfg.proximal_mu if mu is None else mu, parallel=cfg.parallel,
            )
            loss, info = result.loss, result.metrics()
        update = _keep_local(context, cfg, server_round, start, Update.from_state_dict(
            model.state_dict(), num_examples=len(site.train)), federated)
    metrics = {wire.TRAIN_LOSS: loss, wire.ON_GPU: int(device.type == "cuda"),
               **{k: v for k, v in info.items() if isinstance(v, int | float)}}
    site_info = {"name": site.name, "device": str(device),
                 **{k: v for k, v in info.items() if isinstance(v, str)}}
    if attack is not None:  # poisoned weights skip the sender's own checks: the coordinator's guard
        poisoned = attack.poison_update(update.arrays, sent, seed=cfg.seed * 7919 + server_round)
        reply = wire.build_train_reply(poisoned, {wire.NUM_EXAMPLES: update.num_examples, **metrics},
                                       site_info, evaluation=evaluation,
                                       metrics_allowed=_metric_names(model))
    elif secure is None:
        reply = wire.build_train_reply(update, metrics, site_info, evaluation=evaluation,
                                       metrics_allowed=_metric_names(model))
    else:
        with hospital_stage(site.name, "secure aggregation"):
            from fedsplit.client.secure.agent import train_reply

            reply = train_reply(secure, context, sent, update, metrics, site_info,
                                evaluation=evaluation, metrics_allowed=_metric_names(model))
    return Message(reply, reply_to=msg)


@app.evaluate()
@answered("scoring", _name)
def evaluate(msg: Message, context: Context) -> Message:
    """Score the global model (with this hospital's own tensors that never travel) on the
    site's held-out rows."""
    cfg = RunConfig.from_flower(context.run_config)
    instruction = wire.parse_model_instruction(msg, wire.EVALUATE)
    site = _site(context, cfg, instruction.schema)
    model = _global_model(instruction, context, cfg)
    result = _scores(model, site, pick_device(cfg.device))
    reply = wire.build_evaluate_reply(result, {wire.SITE_NAME: site.name},
                                      metrics_allowed=_metric_names(model))
    return Message(reply, reply_to=msg)


def _scores(model: torch.nn.Module, site: SiteData, device: torch.device) -> dict[str, float]:
    """The model's metrics (and ``num-examples``) on the site's validation rows, as the stage
    "scoring": the evaluate reply's, and a train reply's ``evaluation`` (evaluate-first)."""
    with hospital_stage(site.name, "scoring"):
        return {wire.NUM_EXAMPLES: len(site.val), **score(model, site.val.x, site.val.y, device)}


def _metric_names(model: torch.nn.Module) -> list[str]:
    """The metric names the model's recipe reports besides the built-in ones."""
    return list(recipe_of(model).metric_names(model.spec.task))

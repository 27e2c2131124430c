"""Before round 1: agree on the model and its standardisation without seeing any rows, in as few
exchanges as the hospitals' data allows (one when they agree on the columns; issue 32).

1. ``query.setup`` to every hospital (``query.schema``, ``query.stats`` and the model check in
   one exchange): its column report (kinds, missing counts, frequent categories, labels;
   `protocol.schema`) and, speculatively, under its own file's schema, its statistics (step 2)
   and its model check (step 3). The coordinator merges the reports into one versioned table
   schema (conflicts stop the run with `ConfigError` naming hospital, column and fix;
   suspicious columns are logged as warnings). Image (NPZ) sites report no table and skip
   the schema.
2. the statistics: a hospital whose own schema is the agreed one (same digest) already sent
   them; only the others get ``query.stats`` carrying the schema (they reply with their
   statistics and their model check under it): input shape, encoded feature names, task and
   per-feature count / sum / sum of squares. The coordinator checks that they match and pools
   the moments into one mean and standard deviation (and warns about columns that are
   constant at one site or orders of magnitude off the others).
   Each stats reply also names the recipe the hospital runs (name, version, validated
   parameters: `protocol.recipe`); hospitals that differ are refused here, before round 1,
   with the hospital and the difference named.
3. the model: the coordinator plans the federation's model from the pooled statistics
   (`protocol.model_plan.plan_model`). A hospital's model check is a fingerprint, never its
   weights (`protocol.horizontal_wire.ModelPrint`: each tensor's name, shape, dtype and a digest
   of its seeded starting values, left out for the tensors its statistics fill:
   `client.model_check`); it stands for its ``query.init`` reply when it was built for the same
   model (`model_key`: kind, task, input shape, outputs, hidden, norm); only the hospitals
   without one (a check they could not build, another label count, ...) get ``query.init``
   with the pooled statistics, and the coordinator fingerprints their models. The majority's
   fingerprint defines the federation's model, and a hospital whose model differs (another
   layer width, dtype or tensor name, other starting values under the same recipe name,
   version and parameters) is refused by name with the tensor and the difference, whatever
   order the replies came in; no majority (a tie) refuses the run naming the groups. The first
   hospital by name among the majority builds the shared starting weights with the pooled
   statistics (``query.init`` to it alone: the one model that moves up in set-up), checked
   against the majority's fingerprint and against the statistics map its check sent
   (`place_statistics`); the coordinator sends them out in round 1. A recipe's model id must
   carry the recipe the hospitals agreed on.

So set-up is two exchanges when every hospital's own schema is the agreed one (the second to
the reference hospital alone), three when some schema differs (``query.stats`` to those
hospitals). Its replies' sizes do not grow with the model, but for the reference's.

The coordinator never imports model code: it only routes statistics and arrays. Every
exchange is built and checked by `protocol.horizontal_wire`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import model_plan
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.design import prune_schema
from fedsplit.protocol.errors import (
    ConfigError,
    FederationError,
    FedsplitError,
    error_from_record,
)
from fedsplit.protocol.recipe import (
    RecipeIdentity,
    check_same_recipe,
    describe_model,
    keeps_short_id,
)
from fedsplit.protocol.schema import Schema, SiteColumns, merge_reports, moment_warnings
from fedsplit.protocol.update import array_view
from fedsplit.protocol.weights import read_schema, read_weights
from fedsplit.server.exchange import send_and_collect
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

log = logging.getLogger(__name__)



@dataclass
class ModelSetup:
    """The shared starting model, the table schema it reads (JSON; None for images), the schema
    warnings, the tensors that travel every round (None: all) and each node's hospital name."""

    arrays: ArrayRecord
    model_id: str
    schema: str | None = None
    warnings: list[str] = field(default_factory=list)
    federated: tuple[str, ...] | None = None
    site_names: dict[int, str] = field(default_factory=dict)

    def hand_over(self) -> ArrayRecord:
        """The starting model, given to the round loop to own: this setup keeps an empty
        record, so the model's bytes go once the loop has replaced it (not held all run)."""
        arrays, self.arrays = self.arrays, ArrayRecord()
        return arrays


def wait_for_nodes(grid: Grid, minimum: int, timeout: float) -> list[int]:
    """Return connected node ids once at least ``minimum`` are connected (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() > deadline:
            raise FederationError(
                f"Only {len(nodes)} hospital(s) connected within {timeout:.0f} s; the run needs "
                f"min-nodes={minimum}. Start more SuperNodes or lower min-nodes. Received: {nodes}"
            )
        time.sleep(1.0)


def _ask(grid: Grid, nodes: list[int], message_type: str, content: RecordDict,
         timeout: float, names: dict[int, str] | None = None) -> list[Message]:
    """Send one setup instruction to every node; every hospital must answer without failing.

    A failure is named as the hospital wrote it (`protocol.errors.HospitalFailure`: hospital,
    stage, cause), else by the name ``names`` knows for its node: one hospital's failure is
    raised as its own `HospitalFailure` line, several as one `FederationError` listing each."""
    msgs = [Message(content, dst_node_id=n, message_type=message_type) for n in nodes]
    replies = send_and_collect(grid, msgs, timeout=timeout)
    errors = [r for r in replies if r.has_error()]
    if errors:
        known = names or {}
        lines = sorted(_failure_line(r, known) for r in errors)
        if len(lines) == 1:
            raise error_from_record(f"HospitalFailure: {lines[0]}") or FederationError(lines[0])
        raise FederationError(f"{len(errors)} of {len(nodes)} hospitals failed before round 1 "
                              f"({message_type}): {'; '.join(_grouped(lines))}")
    if len(replies) < len(nodes):
        answered = {r.metadata.src_node_id for r in replies}
        silent = sorted((names or {}).get(n, f"node-{n}") for n in nodes if n not in answered)
        raise FederationError(
            f"Only {len(replies)} of {len(nodes)} hospitals answered {message_type} within "
            f"{timeout:.0f} s; no answer from {', '.join(silent)}. Check their agents' logs. "
            f"Received: {len(replies)} replies"
        )
    return replies


def _grouped(lines: list[str]) -> list[str]:
    """Hospitals that failed the same way in one line: ``hospitals a, b, STAGE: CAUSE``."""
    by_cause: dict[str, list[str]] = {}
    for line in lines:
        site = wire.failure_site(line)
        if site is None:
            by_cause.setdefault(line, [])
            continue
        by_cause.setdefault(line[len(f"hospital {site}, "):], []).append(site)
    return [cause if not sites else f"hospital {sites[0]}, {cause}" if len(sites) == 1
            else f"hospitals {', '.join(sites)}, {cause}" for cause, sites in by_cause.items()]


def _failure_line(reply: Message, names: dict[int, str]) -> str:
    """A failed setup reply as one line that names the hospital."""
    reason = wire.failure_reason(reply.error.reason)
    if wire.failure_site(reason) is not None:
        return reason
    node = reply.metadata.src_node_id
    return f"hospital {names[node]}: {reason}" if node in names else f"node {node}: {reason}"


def prepare_model(grid: Grid, nodes: list[int], cfg: RunConfig) -> ModelSetup:
    """Run the stats and init exchanges (or load ``initial-weights``) and return the start model."""
    if cfg.initial_weights:
        update = read_weights(cfg.initial_weights)
        if not update.model:
            raise ConfigError(
                f"initial-weights file {cfg.initial_weights} has no 'model' attribute, so the "
                f"hospitals cannot rebuild the architecture. Use a global.h5 written by fedsplit. "
                f"Received: model=None"
            )
        return ModelSetup(update.to_array_record(), update.model,
                          read_schema(cfg.initial_weights))

    names: dict[int, str] = {}  # node id -> hospital name, as the hospitals report them
    agreed, warnings, early = agree_setup(grid, nodes, cfg, names)
    schema = agreed.to_json() if agreed is not None else None
    digest = agreed.digest() if agreed is not None else ""
    # the stats (and model check) a hospital sent with its report hold if it encoded with the
    # agreed schema
    held = {n: got for n, got in early.items()
            if got.stats is not None and got.encoded_with == digest}
    by_node = {n: got.stats for n, got in held.items() if got.stats is not None}
    checks = {n: got.check for n, got in held.items() if got.check is not None}
    if stale := [n for n in nodes if n not in by_node]:
        log.info("Set-up: asking %d of %d hospitals for their statistics under the agreed "
                 "schema", len(stale), len(nodes))
        replies = _ask(grid, stale, wire.STATS, wire.build_stats_instruction(schema),
                       cfg.round_timeout, names)
        by_node.update({r.metadata.src_node_id: _parse(wire.parse_stats_reply, r, wire.STATS)
                        for r in replies})
        checks.update({r.metadata.src_node_id: check for r in replies
                       if (check := _parse(wire.parse_stats_check, r, wire.STATS)) is not None})
    parsed = sorted(by_node.items(), key=lambda pair: pair[1].name)
    names.update({node: stat.name for node, stat in parsed})
    stats = [stat for _, stat in parsed]  # in name order: the same run whatever the arrival
    if agreed is not None:
        warnings += moment_warnings(agreed, {s.name: (s.count, s.sum, s.sumsq) for s in stats})
        agreed, stats, dropped = prune_design(agreed, stats)
        if dropped:  # the hospitals' model checks were built for the inputs before the drop
            schema, checks = agreed.to_json(), {}
            warnings += dropped
    for line in warnings:
        log.warning("Schema: %s", line)
    ref = stats[0]
    for other in stats[1:]:
        for key, mine, theirs in (("kind", ref.kind, other.kind),
                                  ("input-shape", list(ref.input_shape), list(other.input_shape)),
                                  ("features", ref.features, other.features)):
            if mine != theirs:
                raise ConfigError(
                    f"Hospitals {ref.name} and {other.name} disagree on {key}: horizontal "
                    f"federation needs every site to hold the same columns in the same order. "
                    f"Sites holding different columns need vertical fusion instead. Received: "
                    f"{_head(mine)} vs {_head(theirs)}"
                )
    recipe = agree_recipe(stats)
    request = model_plan.plan_model(
        stats, task=cfg.task, model=cfg.model, num_classes=cfg.num_classes,
        hidden=cfg.hidden_widths, norm=cfg.norm, recipe=recipe,
        schema_task=agreed.task if agreed is not None else None,
        labels=len(agreed.labels) if agreed is not None else 0)
    log.info("Model setup: %s (recipe %s), %s, %d rows over %d hospitals", request.kind,
             recipe.label(), request.task, sum(s.num_examples for s in stats), len(nodes))
    initial = _initial_model(grid, nodes, cfg, request, checks, names)
    if not keeps_short_id(recipe):  # the built-ins' ids are planned from the run config
        made = describe_model(initial.model_id)
        if made is None or made.recipe.differences(recipe):
            raise FederationError(
                f"Hospital {initial.site} built the initial model with another recipe "
                f"than the one every hospital reported ({recipe.to_json()}). Received: "
                f"{initial.model_id[:200]}"
            )
    return ModelSetup(initial.arrays, initial.model_id, schema, warnings, initial.federated,
                      names)


def prune_design(schema: Schema, stats: list[wire.SiteStats]
                 ) -> tuple[Schema, list[wire.SiteStats], list[str]]:
    """The agreed schema less the derived features that are constant over every hospital's
    rows (`protocol.design.prune_schema`: derived columns never stop a run), each hospital's
    statistics of the features kept (the same numbers: dropping such a feature changes no other
    one), and one warning per source column (none, and ``schema`` as it was, when nothing is
    dropped). A hospital whose statistics are not of ``schema``'s features is left as it is
    (refused by the check that follows).

    Every task kind: the exact Cox fit, the learned survival models and the horizontal
    classification and regression models share this rule (docs/simulate.md "Derived columns").
    A classification or regression model would standardize such a feature to 0 in every
    training row, so it never stopped one, but it still took a column of the first layer and
    a hospital reading it would see an input nobody holds."""
    if (not stats
            or any(list(s.features) != schema.feature_names for s in stats)):
        return schema, stats, []
    pruned = prune_schema(schema, np.sum([s.count for s in stats], axis=0),
                          np.sum([s.sum for s in stats], axis=0),
                          np.sum([s.sumsq for s in stats], axis=0))
    if not pruned.dropped:
        return schema, stats, []
    keep = np.asarray(pruned.keep, dtype=np.int64)
    sliced = [replace(s, input_shape=(len(keep),), features=[s.features[i] for i in keep],
                      count=np.asarray(s.count)[keep], sum=np.asarray(s.sum)[keep],
                      sumsq=np.asarray(s.sumsq)[keep]) for s in stats]
    log.info("Schema %s: %d derived input(s) carry nothing at any hospital and are left out "
             "(schema %s)", schema.digest(), len(pruned.dropped), pruned.schema.digest())
    return pruned.schema, sliced, list(pruned.warnings)


def _initial_model(grid: Grid, nodes: list[int], cfg: RunConfig, request: wire.ModelRequest,
                   checks: dict[int, wire.ModelCheck], names: dict[int, str]) -> wire.InitialModel:
    """Every hospital's model for ``request``, compared by fingerprint (`agree_models`), and the
    starting weights, built once: a hospital's model check (a fingerprint, no weights) stands for
    its ``query.init`` reply when it was built for the same model
    (`protocol.horizontal_wire.model_key`); only the others are asked ``query.init``. The
    reference (first by name among the majority) builds the starting weights with the pooled
    statistics (``query.init`` to it alone, unless it was just asked), checked against the
    majority's fingerprint and its check's statistics map."""
    key = wire.model_key(request)
    held = {n: c for n, c in checks.items() if c.key == key}
    instruction = wire.build_init_instruction(request)
    built: dict[int, wire.InitialModel] = {}
    if missing := [n for n in nodes if n not in held]:
        log.info("Set-up: asking %d of %d hospitals to build the model (query.init)",
                 len(missing), len(nodes))
        built = {r.metadata.src_node_id: _init_model(r, names)
                 for r in _ask(grid, missing, wire.INIT, instruction, cfg.round_timeout, names)}
    # tensors the statistics fill differ between hospitals' checks: compared by layout only
    varying = sorted({name for c in held.values() for name, *_, digest in c.model.tensors
                      if digest is None})
    prints = {n: _comparable(c.model, varying) for n, c in held.items()}
    prints.update({n: wire.ModelPrint.of(model, varying) for n, model in built.items()})
    reference = agree_models([prints[n] for n in nodes])
    node = next(n for n in nodes if prints[n] is reference)
    if node in built:
        return built[node]  # built by query.init with the pooled statistics
    log.info("Set-up: asking hospital %s to build the starting weights (query.init)",
             reference.site)
    start = _init_model(_ask(grid, [node], wire.INIT, instruction, cfg.round_timeout,
                             names)[0], names)
    made = wire.ModelPrint.of(start, varying)
    if _signature(made) != _signature(reference):
        raise FederationError(
            f"Hospital {reference.site} built another model for query.init than in its "
            f"set-up reply: {_difference(made, reference)}. Received: {start.model_id[:200]}")
    statistics = held[node].statistics
    placed = (model_plan.place_statistics(start, statistics, request)
              if statistics is not None else None)
    if placed is not None and (wrong := [
            name for name in statistics
            if not np.array_equal(array_view(placed.arrays[name]),
                                  array_view(start.arrays[name]))]):
        raise FederationError(
            f"Hospital {reference.site} built starting weights whose {', '.join(wrong[:4])} do "
            f"not hold the pooled statistics its set-up reply said they hold. Install the same "
            f"recipe code at every hospital. Received: {start.model_id[:200]}")
    return start


def _comparable(model: wire.ModelPrint, varying: list[str]) -> wire.ModelPrint:
    """``model``'s fingerprint without a digest for the ``varying`` tensors."""
    return replace(model, tensors=tuple((name, shape, dtype, None if name in varying else digest)
                                        for name, shape, dtype, digest in model.tensors))


def _signature(model: wire.ModelPrint) -> tuple[Any, ...]:
    """What two hospitals' models must share: every tensor's name, shape, dtype and starting
    values' digest (where they must agree), in order, and which tensors travel."""
    return model.tensors, model.federated


def _difference(mine: wire.ModelPrint, theirs: wire.ModelPrint) -> str:
    """The first differences between two hospitals' model fingerprints, for a message."""
    a = {name: rest for name, *rest in mine.tensors}
    b = {name: rest for name, *rest in theirs.tensors}
    out = [f"{k} {a[k][0]} {a[k][1]} vs {b[k][0]} {b[k][1]}"
           for k in a if k in b and a[k][:2] != b[k][:2]]
    out += [f"{k} has other starting values ({mine.site}'s digest {a[k][2]} vs {b[k][2]})"
            for k in a if k in b and a[k][:2] == b[k][:2] and a[k][2] != b[k][2]]
    out += [f"{k} only in {mine.site}'s" for k in a if k not in b]
    out += [f"{k} only in {theirs.site}'s" for k in b if k not in a]
    if not out and list(a) != list(b):
        out.append("the same tensors in another order")
    if not out and mine.federated != theirs.federated:
        other = sorted(set(mine.federated or a) ^ set(theirs.federated or b))
        out.append(f"other tensors travel: {other[:6]}")
    return "; ".join(out[:4]) + (f" (and {len(out) - 4} more)" if len(out) > 4 else "")


def _init_model(reply: Message, names: dict[int, str]) -> wire.InitialModel:
    """A ``query.init`` reply's model, named by the hospital (else its node)."""
    model = _parse(wire.parse_init_reply, reply, wire.INIT)
    site = model.site or names.get(reply.metadata.src_node_id,
                                   f"node-{reply.metadata.src_node_id}")
    return wire.InitialModel(model.arrays, model.model_id, model.federated, site)


def agree_model(replies: list[Message], names: dict[int, str]) -> wire.InitialModel:
    """`agree_models` over ``query.init`` replies: the first hospital's model by name among the
    majority."""
    models = [_init_model(reply, names) for reply in replies]
    prints = [wire.ModelPrint.of(m) for m in models]
    chosen = agree_models(prints)
    return next(m for m, p in zip(models, prints, strict=True) if p is chosen)


def agree_models(models: list[wire.ModelPrint]) -> wire.ModelPrint:
    """Every hospital's model fingerprint compared before round 1: the majority's (names,
    shapes, dtypes, starting values' digests, travelling tensors) is the federation's; a
    hospital whose model differs is refused with the difference (`ConfigError`), decided by the
    majority, never by arrival. Returns the first hospital's fingerprint by name among the
    majority (it builds the starting weights), one of ``models``."""
    models = sorted(models, key=lambda m: str(m.site))
    groups: dict[tuple[Any, ...], list[wire.ModelPrint]] = {}
    for model in models:
        groups.setdefault(_signature(model), []).append(model)
    if len(groups) == 1:
        return models[0]
    ranked = sorted(groups.values(), key=lambda g: (-len(g), str(g[0].site)))
    if len(ranked[0]) == len(ranked[1]):  # no majority: nobody can say which model is right
        listing = "; ".join(f"{', '.join(str(m.site) for m in g)}" for g in ranked)
        raise ConfigError(
            f"The hospitals build different models from the same recipe and inputs, and no "
            f"majority agrees on one ({listing}): {ranked[0][0].site} vs {ranked[1][0].site}: "
            f"{_difference(ranked[0][0], ranked[1][0])}. Install the same recipe code at every "
            f"hospital (same name and version must mean the same code). Received: "
            f"{len(groups)} different models")
    reference = ranked[0][0]
    odd = [m for g in ranked[1:] for m in g]
    lines = "; ".join(f"hospital {m.site}: {_difference(m, reference)}" for m in odd)
    who = (f"Hospital {odd[0].site} builds" if len(odd) == 1
           else f"Hospitals {', '.join(str(m.site) for m in odd)} build")
    raise ConfigError(
        f"{who} another model than the majority ({', '.join(str(m.site) for m in ranked[0])}) from "
        f"the same recipe and inputs: {lines}. Install the same recipe code at every hospital "
        f"(same name and version must mean the same code). Received: {len(odd)} of "
        f"{len(models)} hospitals differ")


def agree_recipe(stats: list[wire.SiteStats]) -> RecipeIdentity:
    """The recipe every hospital reported in its stats reply; hospitals that differ in name,
    version or parameters raise `ConfigError` naming each and the difference."""
    return check_same_recipe({s.name: RecipeIdentity.from_json(
        s.recipe, where=f"hospital {s.name}'s recipe") for s in stats})


def agree_setup(grid: Grid, nodes: list[int], cfg: RunConfig, names: dict[int, str] | None = None
                ) -> tuple[Schema | None, list[str], dict[int, wire.SetupReply]]:
    """``query.setup`` to every hospital (one exchange: column report and, speculatively, the
    stats under its own schema); merge the reports into one schema (`merge_schema`).

    Returns the schema (None for images), its warnings and each node's reply; ``names``
    (node id -> hospital name) is filled in.
    """
    replies = _ask(grid, nodes, wire.SETUP_QUERY, wire.build_setup_instruction(),
                   cfg.round_timeout)
    got = {r.metadata.src_node_id: _parse(wire.parse_setup_reply, r, wire.SETUP_QUERY)
           for r in replies}
    if names is not None:
        names.update({node: reply.report.site for node, reply in got.items()})
    schema, warnings = merge_schema([reply.report for reply in got.values()], cfg)
    return schema, warnings, got


def agree_schema(grid: Grid, nodes: list[int], cfg: RunConfig,
                 names: dict[int, str] | None = None) -> tuple[Schema | None, list[str]]:
    """``query.schema`` to every hospital; merge their column reports into one schema
    (`merge_schema`). ``names`` (node id -> hospital name) is filled in."""
    replies = _ask(grid, nodes, wire.SCHEMA_QUERY, wire.build_schema_instruction(),
                   cfg.round_timeout)
    pairs = [(r.metadata.src_node_id, _parse(wire.parse_schema_reply, r, wire.SCHEMA_QUERY))
             for r in replies]
    if names is not None:
        names.update({node: report.site for node, report in pairs})
    return merge_schema([report for _, report in pairs], cfg)


def merge_schema(reports: list[SiteColumns], cfg: RunConfig) -> tuple[Schema | None, list[str]]:
    """The hospitals' column reports merged into one schema, and its warnings.

    Returns (None, []) when the hospitals hold images (NPZ), which need no schema; a mix of
    tables and images is refused.
    """
    reports = sorted(reports, key=lambda r: r.site)
    tables = [r for r in reports if r.table]
    if not tables:
        return None, []
    if len(tables) != len(reports):
        images = [r.site for r in reports if not r.table]
        raise ConfigError(
            f"Hospitals {', '.join(images)} hold images (NPZ) while "
            f"{', '.join(r.site for r in tables)} hold tables: one federation trains one model on "
            f"one kind of data. Received: {len(images)} image and {len(tables)} table sites"
        )
    names = [r.site for r in reports]
    if len(set(names)) != len(names):
        raise ConfigError(f"Two hospitals report the same name; give each its own site-name. "
                          f"Received: {sorted(names)}")
    merged = merge_reports(reports, cfg.table_settings, task=cfg.task)
    log.info("Schema %s agreed: %d columns -> %d features", merged.schema.digest(),
             len(merged.schema.columns), len(merged.schema.feature_names))
    return merged.schema, list(merged.warnings)


def _head(value: Any) -> Any:
    """The first 8 entries of a list, for messages."""
    return value[:8] if isinstance(value, list) else value


def _parse(parse: Any, reply: Message, kind: str) -> Any:
    """Parse a setup reply; a reply that breaks the wire contract ends the setup."""
    try:
        return parse(reply)
    except FedsplitError as e:
        raise FederationError(
            f"Hospital {wire.reply_site(reply)} answered {kind} outside the wire contract "
            f"(protocol/horizontal_wire.py); update its agent to this fedsplit version. {e}"
        ) from e

"""What crosses the network in horizontal training, and the only shapes it may take.

Seven Flower message kinds run a horizontal federation. Each instruction (coordinator ->
hospital) and each reply (hospital -> coordinator) is a ``RecordDict`` whose records and keys
are listed here, once; `check_content` enforces the lists on both ends, so a bug that tried to
ship rows, labels or IDs fails loudly instead of leaking, and a reply with an unexpected record
or key is refused with a `ReplyError` naming it.

=============  =====================================  =========================================
kind           instruction records                    reply records
=============  =====================================  =========================================
query.schema   config: {}                             columns (config): report (the site's
                                                      column report as JSON, checked field by
                                                      field: `protocol.schema.SiteColumns`)
query.stats    config: schema (optional: the agreed   stats (metrics): num-examples, count, sum,
               table schema as JSON)                  sumsq, label-max, y-sum, y-sumsq;
                                                      schema (config): name, kind, task,
                                                      input-shape, features, recipe (the
                                                      identity of the site's recipe as JSON:
                                                      `protocol.recipe.RecipeIdentity`);
                                                      optional model check: fingerprint
                                                      (config): tensors (no weights: `ModelPrint`),
                                                      model (as query.init's) and check (config):
                                                      kind, task, input-shape, num-outputs,
                                                      hidden, norm, statistics (optional)
query.setup    config: {}                             columns (as query.schema's); and, when the
                                                      site could encode its rows on its own, stats
                                                      and schema (as query.stats's, encoded with
                                                      its own file's schema, whose digest the
                                                      schema record's encoded-with names) and
                                                      the model check (as query.stats's)
query.init     config: kind, task, input-shape,       arrays: the initial model;
               num-outputs, hidden, norm, mean, std,  model (config): model-id
               y-mean, y-std
train          arrays: the global model;              arrays: the trained model;
               config: model-id, server-round,        metrics: the weight key (num-examples)
               proximal-mu, schema (optional),        and numeric metrics;
               evaluate-first (optional)              site (config, optional): name, device,
                                                      parallel-mode, parallel-config;
                                                      evaluation (metrics, when the instruction
                                                      says evaluate-first): the weight key and
                                                      metrics of the RECEIVED model on the
                                                      site's validation rows, before training
evaluate       arrays; config: model-id,              metrics: the weight key and numeric
               server-round, schema (optional)        metrics; site (optional): name
=============  =====================================  =========================================

Set-up never moves a model up from every hospital: a ``query.setup`` reply's model check is
the fingerprint (`ModelPrint`: each tensor's name, shape, dtype and a digest of its starting
values where they must agree, i.e. every tensor the statistics do not fill) of the model the
site would return to ``query.init`` if the federation's statistics were its own (`ModelCheck`):
built for the request `protocol.model_plan.plan_model` gives from its own stats and schema, with
the names of the tensors that hold the statistics (``statistics``: JSON {tensor: mean | std |
y-mean | y-std}). Where the coordinator's request has the same `model_key`, the check stands
for the site's ``query.init`` reply in the majority check, and only the reference hospital
builds the starting weights (``query.init``, one model up); the coordinator sends them out.
``query.stats`` carries the check built under the agreed schema.

One message per hospital per round: a train instruction with ``evaluate-first`` asks the
hospital to score the model it receives (the previous round's global model) on its validation
rows before it trains, and to put those metrics in its reply's ``evaluation`` record, so the
coordinator needs no separate evaluate exchange for that model (`server.rounds`). A masked
train reply (secure aggregation, `protocol.privacy`) carries the same record (`evaluation_record`).

Record and configuration keys are closed lists. Array names are the model's parameter names
(the coordinator checks every reply's layout against the round's model). Metric names in
train and evaluate replies are open on the coordinator's side, as in Flower (a metric is a
number or a list of numbers), but the hospital agent's builders accept only the names in
`TRAIN_METRICS` / `EVALUATE_METRICS`, and scalars only. A reply without a ``site`` record
(e.g. from a plain Flower ClientApp) is named after its node, ``node-<id>``.

Table sites encode their rows with the ``schema`` the instruction carries (the federation's
agreed schema, `protocol.schema.Schema`); without one, a table site uses its file's own.

Arrays are float16/32/64 everywhere; integer buffers travel as float64 (see
`protocol.update.state_dict_arrays`), and every array keeps its shape, 0-d included.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, Any

import numpy as np
from fedsplit.protocol.arrays import check_arrays, check_num_examples
from fedsplit.protocol.errors import ConfigError, FedsplitError, ReplyError, one_line
from fedsplit.protocol.privacy import MASKED
from fedsplit.protocol.schema import SiteColumns
from fedsplit.protocol.survival import CONCORDANT_RATE, PAIRS_RATE
from fedsplit.protocol.update import Update, array_view, to_array_record

if TYPE_CHECKING:
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

# --- message kinds --------------------------------------------------------------------------
SCHEMA_QUERY = "query.schema"
STATS = "query.stats"
#: the first set-up message: query.schema's column report and query.stats's moments in one
#: exchange (the stats encoded with the site's own schema; asked again only where the agreed
#: schema differs: `server.setup.prepare_model`)
SETUP_QUERY = "query.setup"
INIT = "query.init"
TRAIN = "train"  # Flower's MessageType.TRAIN
EVALUATE = "evaluate"  # Flower's MessageType.EVALUATE
KINDS = (SCHEMA_QUERY, STATS, SETUP_QUERY, INIT, TRAIN, EVALUATE)

# --- record names ---------------------------------------------------------------------------
CONFIG = "config"
ARRAYS = "arrays"
METRICS = "metrics"
SITE = "site"
STATS_RECORD = "stats"
SCHEMA = "schema"
MODEL = "model"
COLUMNS = "columns"
CHECK = "check"  # query.setup / query.stats reply: what the model check was built for
FINGERPRINT = "fingerprint"  # query.setup / query.stats reply: the model check's tensors

# --- keys -----------------------------------------------------------------------------------
NUM_EXAMPLES = "num-examples"  # the default weight key (Flower's weighted_by_key)
MODEL_ID = "model-id"
FEDERATED = "federated"  # query.init reply: the state_dict names that travel (the rest stay home)
SERVER_ROUND = "server-round"  # Flower's FedAvg adds it to every train/evaluate config
PROXIMAL_MU = "proximal-mu"
SITE_NAME = "name"
SCHEMA_KEY = "schema"  # the agreed table schema (JSON) in stats, train and evaluate instructions
#: train instruction: score the received model on the validation rows before training, and
#: reply with those metrics in the ``evaluation`` record (one message per round)
EVALUATE_FIRST = "evaluate-first"
EVALUATION = "evaluation"  # train reply: metrics of the received model (evaluate-first)
REPORT = "report"

STATS_KEYS = ("num-examples", "count", "sum", "sumsq", "label-max", "y-sum", "y-sumsq")
SCHEMA_KEYS = ("name", "kind", "task", "input-shape", "features", "recipe")
ENCODED_WITH = "encoded-with"  # query.setup: digest of the table schema the stats used ("": none)
INIT_KEYS = ("kind", "task", "input-shape", "num-outputs", "hidden", "norm", "mean", "std",
             "y-mean", "y-std")
#: the query.init keys that fix the model's tensors (names, shapes, dtypes); the statistics
#: (mean, std, y-mean, y-std) only fill values
MODEL_KEYS = INIT_KEYS[:6]
#: model check (query.setup / query.stats reply): which tensor holds which statistic, as JSON
#: {tensor name: one of STATISTIC_SOURCES}; absent when the site's recipe does more than place them
STATISTICS = "statistics"
STATISTIC_SOURCES = ("mean", "std", "y-mean", "y-std")
#: model check: its tensors as JSON [[name, shape, dtype, digest or null], ...] (`ModelPrint`)
TENSORS = "tensors"
SITE_KEYS = ("name", "device", "parallel-mode", "parallel-config")
TRAIN_LOSS = "train-loss"  # a train reply's mean training loss
ON_GPU = "on-gpu"  # 1 when the hospital trained on a GPU
PARALLEL_WORKERS = "parallel-workers"  # in-site parallelism: workers used (client.parallel)
PARALLEL_SAMPLES_PER_S = "parallel-samples-per-s"  # in-site training throughput
#: A train reply's spent privacy budget (patient-level DP-SGD, cumulative over the run);
#: the coordinator copies it to the run record (`protocol.record.horizontal.RunRecord.record_privacy`).
DP_EPSILON = "dp-epsilon"
#: Metric names the hospital agent may put in its replies (scalars only).
TRAIN_METRICS = frozenset({NUM_EXAMPLES, TRAIN_LOSS, ON_GPU, PARALLEL_WORKERS,
                           PARALLEL_SAMPLES_PER_S, DP_EPSILON})
#: (a survival recipe's concordance pair counts per row pick its round: `protocol.survival`)
EVALUATE_METRICS = frozenset({NUM_EXAMPLES, "loss", "accuracy", "r2", "rmse", CONCORDANT_RATE,
                              PAIRS_RATE})


@dataclass(frozen=True)
class RecordRule:
    """One record of a message: its type, the keys it may hold, the keys it must hold.

    ``keys`` None means open names (model parameters, Flower metrics).
    """

    type: str  # "arrays", "metrics" or "config"
    keys: frozenset[str] | None = None
    required: frozenset[str] = frozenset()
    optional: bool = False


def _rule(type_: str, keys: Sequence[str] | None = None, required: Sequence[str] | None = None,
          optional: bool = False) -> RecordRule:
    allowed = frozenset(keys) if keys is not None else None
    need = frozenset(required) if required is not None else (allowed or frozenset())
    return RecordRule(type_, allowed, need, optional)


#: a query.setup or query.stats reply's model check (all three records or none): the fingerprint
#: of the model the site built under the schema it encoded with (`ModelCheck`), never its weights
_CHECK_RULES: dict[str, RecordRule] = {
    FINGERPRINT: _rule("config", (TENSORS,), optional=True),
    MODEL: _rule("config", (MODEL_ID, FEDERATED), (MODEL_ID,), optional=True),
    CHECK: _rule("config", (*MODEL_KEYS, STATISTICS), MODEL_KEYS, optional=True),
}

#: kind -> (instruction records, reply records)
CONTRACT: dict[str, tuple[dict[str, RecordRule], dict[str, RecordRule]]] = {
    SCHEMA_QUERY: ({CONFIG: _rule("config", ())}, {COLUMNS: _rule("config", (REPORT,))}),
    STATS: ({CONFIG: _rule("config", (SCHEMA_KEY,), ())},
            {STATS_RECORD: _rule("metrics", STATS_KEYS), SCHEMA: _rule("config", SCHEMA_KEYS),
             **_CHECK_RULES}),
    SETUP_QUERY: ({CONFIG: _rule("config", ())},
                  {COLUMNS: _rule("config", (REPORT,)),
                   STATS_RECORD: _rule("metrics", STATS_KEYS, optional=True),
                   SCHEMA: _rule("config", (*SCHEMA_KEYS, ENCODED_WITH), SCHEMA_KEYS,
                                 optional=True),
                   **_CHECK_RULES}),
    INIT: ({CONFIG: _rule("config", INIT_KEYS)},
           {ARRAYS: _rule("arrays"), MODEL: _rule("config", (MODEL_ID, FEDERATED), (MODEL_ID,)),
            SITE: _rule("config", (SITE_NAME,), (), optional=True)}),
    TRAIN: ({ARRAYS: _rule("arrays"),
             CONFIG: _rule("config", (MODEL_ID, SERVER_ROUND, PROXIMAL_MU, SCHEMA_KEY,
                                      EVALUATE_FIRST), (MODEL_ID,))},
            {ARRAYS: _rule("arrays"), METRICS: _rule("metrics"),
             SITE: _rule("config", SITE_KEYS, (), optional=True),
             EVALUATION: _rule("metrics", optional=True)}),
    EVALUATE: ({ARRAYS: _rule("arrays"),
                CONFIG: _rule("config", (MODEL_ID, SERVER_ROUND, SCHEMA_KEY), (MODEL_ID,))},
               {METRICS: _rule("metrics"), SITE: _rule("config", (SITE_NAME,), (), optional=True)}),
}


def _records_of(content: RecordDict, type_: str) -> Mapping[str, Any]:
    return {"arrays": content.array_records, "metrics": content.metric_records,
            "config": content.config_records}[type_]


def check_content(kind: str, content: RecordDict, *, reply: bool) -> None:
    """Refuse any record or key not listed for this message kind and direction.

    Raises `ReplyError` for a reply and `ConfigError` for an instruction, naming what is wrong.
    """
    if kind not in CONTRACT:
        raise ConfigError(f"Unknown horizontal message kind; expected one of {', '.join(KINDS)}. "
                          f"Received: {kind!r}")
    rules = CONTRACT[kind][int(reply)]
    error = ReplyError if reply else ConfigError
    side = "reply to" if reply else "instruction"
    names = list(content.keys())
    extra = [n for n in names if n not in rules]
    if extra:
        raise error(
            f"A horizontal {side} {kind} may carry only the records {sorted(rules)}; anything "
            f"else could leak rows, labels or IDs. Received: unexpected record(s) {extra}"
        )
    for name, rule in rules.items():
        if name not in names:
            if rule.optional:
                continue
            raise error(f"A horizontal {side} {kind} must carry the {rule.type} record {name!r}. "
                        f"Received: records {names}")
        typed = _records_of(content, rule.type)
        if name not in typed:
            raise error(f"Record {name!r} of a horizontal {side} {kind} must be a {rule.type} "
                        f"record. Received: another record type under {name!r}")
        keys = list(typed[name].keys())
        if rule.keys is not None and (unexpected := [k for k in keys if k not in rule.keys]):
            raise error(
                f"Record {name!r} of a horizontal {side} {kind} may hold only "
                f"{sorted(rule.keys)}; anything else could leak rows, labels or IDs. "
                f"Received: unexpected key(s) {unexpected}"
            )
        if missing := sorted(rule.required - set(keys)):
            raise error(f"Record {name!r} of a horizontal {side} {kind} lacks {missing}. "
                        f"Received: keys {sorted(keys)}")


def _record_dict(records: Mapping[str, Any]) -> RecordDict:
    from flwr.app import RecordDict

    return RecordDict(dict(records))


def _config_record(values: Mapping[str, Any]) -> ConfigRecord:
    from flwr.app import ConfigRecord

    return ConfigRecord(dict(values))


def _scalar_metrics(metrics: Mapping[str, Any], allowed: frozenset[str], what: str) -> dict[str, Any]:
    unexpected = sorted(set(metrics) - allowed)
    if unexpected:
        raise ReplyError(
            f"The hospital agent's {what} reply may carry only the metrics {sorted(allowed)}; add "
            f"a new metric to protocol.horizontal_wire first. Received: unexpected {unexpected}"
        )
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ReplyError(f"The hospital agent's metrics are single numbers; {key!r} is not. "
                             f"Received: {key}={value!r}")
        out[key] = int(value) if isinstance(value, int | np.integer) else float(value)
    return out


def reply_site(msg: Message) -> str:
    """The site name a reply carries, else ``node-<id>`` of the node that sent it."""
    if msg.has_content():
        record = msg.content.config_records.get(SITE)
        if record is not None and SITE_NAME in record:
            return str(record[SITE_NAME])
    return f"node-{msg.metadata.src_node_id}"


_FAILURE_SITE = re.compile(r"^hospital ([A-Za-z0-9][A-Za-z0-9_.-]{0,63}), ")
# Flower's own wrapping of an exception raised before the ClientApp ran (e.g. a hospital's
# launcher refusing the app): "<class 'module.Type'>:<'message'>"
_FLOWER_WRAPPED = re.compile(r"^<class '[\w.]+'>:<'(?P<text>.*)'>$", re.DOTALL)


def _unwrapped(reason: str | None) -> str:
    text = str(reason or "")
    match = _FLOWER_WRAPPED.match(text.strip())
    return match.group("text") if match else text


def failure_site(reason: str | None) -> str | None:
    """The hospital a failed reply's one-line reason names (``hospital NAME, STAGE: ...``, as
    the agent writes it: `protocol.errors.HospitalFailure`, also inside Flower's
    ``<class '...'>:<'...'>`` wrapping), else None."""
    match = _FAILURE_SITE.match(_unwrapped(reason))
    return match.group(1) if match else None


def failure_reason(reason: str | None) -> str:
    """A failed reply's reason in one line: the agent's own line as it is; anything else
    (Flower's or Ray's traceback) cut to its final message, prefixed "the ClientApp failed"."""
    if failure_site(reason) is not None:
        return one_line(_unwrapped(reason))
    text = one_line(str(reason or "no reason given"), limit=100_000)
    if "Message: " in text:  # Ray's ClientAppException: "... occurred. Message: <cause>'>"
        text = text.rsplit("Message: ", 1)[1].rstrip("'>").strip()
    return one_line(f"the ClientApp failed: {text}")


def _site_info(msg: Message) -> dict[str, str]:
    record = msg.content.config_records.get(SITE)
    if record is None:
        return {}
    return {k: str(v) for k, v in record.items() if k != SITE_NAME}


def _numbers(record: Mapping[str, Any]) -> dict[str, float | list[float]]:
    out: dict[str, float | list[float]] = {}
    for key, value in record.items():
        if isinstance(value, list):
            out[key] = [float(v) for v in value]
        else:
            out[key] = float(value)
    return out


def _weight(metrics: Mapping[str, Any], weight_key: str) -> int:
    if weight_key not in metrics:
        raise ReplyError(
            f"the reply's metrics lack {weight_key!r}, the sample count that weights it "
            f"(weighted_by_key). Received: {sorted(metrics)}"
        )
    try:
        return check_num_examples(metrics[weight_key], where="reply")
    except FedsplitError as e:
        raise ReplyError(
            f"the reply's {weight_key!r} (the weight key) must be an integer >= 1: fedsplit "
            f"weights every update by its number of training rows. Received: "
            f"{weight_key}={metrics[weight_key]!r}"
        ) from e


# --- query.schema ---------------------------------------------------------------------------
def build_schema_instruction() -> RecordDict:
    """The ``query.schema`` instruction (reading settings come from the run config)."""
    content = _record_dict({CONFIG: _config_record({})})
    check_content(SCHEMA_QUERY, content, reply=False)
    return content


def build_schema_reply(report: SiteColumns) -> RecordDict:
    """A site's ``query.schema`` reply: its column report."""
    content = _record_dict({COLUMNS: _config_record({REPORT: report.to_json()})})
    check_content(SCHEMA_QUERY, content, reply=True)
    return content


def parse_schema_reply(msg: Message) -> SiteColumns:
    """Check and read a ``query.schema`` reply (every field of the report is checked)."""
    check_content(SCHEMA_QUERY, msg.content, reply=True)
    try:
        return SiteColumns.from_json(str(msg.content.config_records[COLUMNS][REPORT]))
    except ConfigError as e:
        raise ReplyError(str(e)) from e


def instruction_schema(msg: Message) -> str | None:
    """The agreed schema (JSON) a stats, train or evaluate instruction carries, if any."""
    record = msg.content.config_records.get(CONFIG)
    if record is None or SCHEMA_KEY not in record:
        return None
    return str(record[SCHEMA_KEY])


# --- query.stats ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SiteStats:
    """A site's schema and per-feature moments (aggregates only: one value per column)."""

    name: str
    kind: str
    task: str
    input_shape: tuple[int, ...]
    features: list[str]
    num_examples: int
    count: np.ndarray
    sum: np.ndarray
    sumsq: np.ndarray
    label_max: int
    y_sum: float
    y_sumsq: float
    recipe: str = ""  # `protocol.recipe.RecipeIdentity` JSON of the recipe the site runs


def build_stats_instruction(schema: str | None = None) -> RecordDict:
    """The ``query.stats`` instruction; ``schema``: the agreed table schema (JSON)."""
    content = _record_dict({CONFIG: _config_record({SCHEMA_KEY: schema} if schema else {})})
    check_content(STATS, content, reply=False)
    return content


def build_stats_reply(stats: SiteStats, check: Mapping[str, Any] | None = None) -> RecordDict:
    """A site's ``query.stats`` reply; ``check``: its model check (`build_model_check`)."""
    from flwr.app import MetricRecord

    content = _record_dict({
        **(check or {}),
        STATS_RECORD: MetricRecord({
            "num-examples": int(stats.num_examples),
            "count": np.asarray(stats.count, dtype=np.float64).tolist(),
            "sum": np.asarray(stats.sum, dtype=np.float64).tolist(),
            "sumsq": np.asarray(stats.sumsq, dtype=np.float64).tolist(),
            "label-max": int(stats.label_max),
            "y-sum": float(stats.y_sum),
            "y-sumsq": float(stats.y_sumsq),
        }),
        SCHEMA: _config_record({
            "name": stats.name, "kind": stats.kind, "task": stats.task,
            "input-shape": [int(d) for d in stats.input_shape],
            "features": [str(f) for f in stats.features],
            "recipe": str(stats.recipe),
        }),
    })
    check_content(STATS, content, reply=True)
    return content


def parse_stats_reply(msg: Message) -> SiteStats:
    """Check and read a ``query.stats`` reply (its model check: `parse_stats_check`)."""
    check_content(STATS, msg.content, reply=True)
    return _read_stats(msg.content.metric_records[STATS_RECORD],
                       msg.content.config_records[SCHEMA])


def parse_stats_check(msg: Message) -> ModelCheck | None:
    """The model check a ``query.stats`` reply carries (built under the schema the instruction
    carried), else None."""
    stats = parse_stats_reply(msg)
    return _read_check(msg.content, stats.name, STATS)


def _read_stats(s: Any, c: Any) -> SiteStats:
    return SiteStats(
        name=str(c["name"]), kind=str(c["kind"]), task=str(c["task"]),
        input_shape=tuple(int(d) for d in np.atleast_1d(c["input-shape"])),
        features=[str(f) for f in np.atleast_1d(c["features"])],
        num_examples=int(s["num-examples"]),
        count=np.asarray(s["count"], dtype=np.float64), sum=np.asarray(s["sum"], dtype=np.float64),
        sumsq=np.asarray(s["sumsq"], dtype=np.float64), label_max=int(s["label-max"]),
        y_sum=float(s["y-sum"]), y_sumsq=float(s["y-sumsq"]), recipe=str(c["recipe"]),
    )


# --- query.setup ----------------------------------------------------------------------------
def build_setup_instruction() -> RecordDict:
    """The ``query.setup`` instruction (reading settings come from the run config)."""
    content = _record_dict({CONFIG: _config_record({})})
    check_content(SETUP_QUERY, content, reply=False)
    return content


def build_setup_reply(report: SiteColumns, stats: SiteStats | None = None,
                      encoded_with: str = "", check: Mapping[str, Any] | None = None
                      ) -> RecordDict:
    """A site's ``query.setup`` reply: its column report and, when it could encode its rows on
    its own, its stats and the digest of the schema it encoded them with (``""``: no table
    schema, e.g. images), and, when it could build its model from them, its model check
    (`build_model_check`)."""
    records = dict(build_schema_reply(report).items())
    if stats is not None:
        stats_records = build_stats_reply(stats, check)
        records.update(stats_records.items())
        records[SCHEMA] = _config_record({**dict(stats_records.config_records[SCHEMA].items()),
                                          ENCODED_WITH: str(encoded_with)})
    content = _record_dict(records)
    check_content(SETUP_QUERY, content, reply=True)
    return content


@dataclass(frozen=True)
class SetupReply:
    """A checked ``query.setup`` reply: the column report, and the stats (None: the site
    could not encode its rows on its own) with the digest of the schema they used, and the
    model check built from them (None: the site could not build it on its own)."""

    report: SiteColumns
    stats: SiteStats | None
    encoded_with: str = ""
    check: ModelCheck | None = None


def parse_setup_reply(msg: Message) -> SetupReply:
    """Check and read a ``query.setup`` reply (the report field by field, the stats as a
    ``query.stats`` reply's)."""
    check_content(SETUP_QUERY, msg.content, reply=True)
    try:
        report = SiteColumns.from_json(str(msg.content.config_records[COLUMNS][REPORT]))
    except ConfigError as e:
        raise ReplyError(str(e)) from e
    if STATS_RECORD not in msg.content.metric_records:
        return SetupReply(report, None)
    if SCHEMA not in msg.content.config_records:
        raise ReplyError(f"A query.setup reply with stats needs the schema record. Received: "
                         f"records {sorted(msg.content.keys())}")
    schema = msg.content.config_records[SCHEMA]
    stats = _read_stats(msg.content.metric_records[STATS_RECORD], schema)
    return SetupReply(report, stats, str(schema.get(ENCODED_WITH, "")),
                      _read_check(msg.content, stats.name, SETUP_QUERY))


# --- query.init -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelRequest:
    """What the coordinator asks one site to build: the model and its agreed statistics."""

    kind: str
    task: str
    input_shape: tuple[int, ...]
    num_outputs: int
    hidden: tuple[int, ...]
    norm: str
    mean: np.ndarray
    std: np.ndarray
    y_mean: float
    y_std: float


def build_init_instruction(request: ModelRequest) -> RecordDict:
    """The ``query.init`` instruction."""
    content = _record_dict({CONFIG: _config_record({
        "kind": request.kind, "task": request.task,
        "input-shape": [int(d) for d in request.input_shape],
        "num-outputs": int(request.num_outputs), "hidden": [int(h) for h in request.hidden],
        "norm": request.norm,
        "mean": np.asarray(request.mean, dtype=np.float64).reshape(-1).tolist(),
        "std": np.asarray(request.std, dtype=np.float64).reshape(-1).tolist(),
        "y-mean": float(request.y_mean), "y-std": float(request.y_std),
    })})
    check_content(INIT, content, reply=False)
    return content


def parse_init_instruction(msg: Message) -> ModelRequest:
    """Check and read a ``query.init`` instruction (hospital side)."""
    check_content(INIT, msg.content, reply=False)
    c = msg.content.config_records[CONFIG]
    return ModelRequest(
        kind=str(c["kind"]), task=str(c["task"]),
        input_shape=tuple(int(d) for d in np.atleast_1d(c["input-shape"])),
        num_outputs=int(c["num-outputs"]),
        hidden=tuple(int(h) for h in np.atleast_1d(c["hidden"])) if len(c["hidden"]) else (),
        norm=str(c["norm"]),
        mean=np.asarray(c["mean"], dtype=np.float64), std=np.asarray(c["std"], dtype=np.float64),
        y_mean=float(c["y-mean"]), y_std=float(c["y-std"]),
    )


@dataclass(frozen=True)
class InitialModel:
    """A hospital's initial model: its parameters, architecture id, the names of the tensors
    that travel every round (`client.recipes.Recipe.federated`; None: every tensor) and the
    hospital that built it."""

    arrays: ArrayRecord
    model_id: str
    federated: tuple[str, ...] | None = None
    site: str | None = None


def build_init_reply(arrays: Mapping[str, np.ndarray], model_id: str,
                     federated: Sequence[str] | None = None, site: str | None = None) -> RecordDict:
    """A site's ``query.init`` reply: the initial model in wire form (see `state_dict_arrays`),
    the names of the tensors that travel (a subset of the arrays, in their order) and the site."""
    checked = check_arrays(arrays, where="initial model")
    records: dict[str, Any] = {ARRAYS: to_array_record(checked),
                               MODEL: _model_record(model_id, federated, checked)}
    if site is not None:
        records[SITE] = _config_record({SITE_NAME: site})
    content = _record_dict(records)
    check_content(INIT, content, reply=True)
    return content


def _model_record(model_id: str, federated: Sequence[str] | None,
                  names: Mapping[str, Any]) -> ConfigRecord:
    """The ``model`` record: the architecture id and the tensors that travel (a subset of
    ``names``, in their order)."""
    model: dict[str, Any] = {MODEL_ID: model_id}
    if federated is not None:
        if unknown := [n for n in federated if n not in names]:
            raise ConfigError(f"The tensors that travel must be entries of the model's state_dict. "
                              f"Received: {unknown[:8]}")
        model[FEDERATED] = list(federated)
    return _config_record(model)


def parse_init_reply(msg: Message) -> InitialModel:
    """Check and read a ``query.init`` reply; its arrays must be finite floats, and the tensors
    that travel a non-empty subset of them."""
    check_content(INIT, msg.content, reply=True)
    site = (str(msg.content.config_records[SITE][SITE_NAME])
            if SITE in msg.content.config_records else None)
    return _read_initial(msg.content, site)


def _read_initial(content: RecordDict, site: str | None) -> InitialModel:
    record = content.array_records[ARRAYS]
    try:
        check_arrays({k: array_view(a) for k, a in record.items()}, where="initial model")
    except FedsplitError as e:
        raise ReplyError(f"The initial model breaks the wire contract (float arrays only; integer "
                         f"buffers travel as float64): {e}") from e
    model = content.config_records[MODEL]
    federated = _read_federated(model, record, "The initial model's", "arrays")
    return InitialModel(record, str(model[MODEL_ID]), federated, site)


def _read_federated(model: ConfigRecord, names: Collection[str], whose: str, of: str
                    ) -> tuple[str, ...] | None:
    """The ``model`` record's travelling tensors (None: all), a non-empty subset of ``names``;
    ``whose`` and ``of`` name the model and its tensors in the refusal."""
    if FEDERATED not in model:
        return None
    federated = tuple(str(n) for n in model[FEDERATED])
    if not federated or any(n not in names for n in federated):
        raise ReplyError(f"{whose} travelling tensors must be a non-empty subset of its {of}. "
                         f"Received: {list(federated)[:8]}")
    return federated


# --- the model check in query.setup / query.stats replies -----------------------------------
# which recipes keep the short ids, and query.init's kind for any other, are the recipe
# registry's (`protocol.recipe`: BUILTIN_RECIPES, RECIPE_KIND, request_kind)


def model_key(request: ModelRequest) -> tuple[Any, ...]:
    """What fixes a requested model's tensors (names, shapes, dtypes): every field of the
    request but the statistics, which only fill values (`MODEL_KEYS`)."""
    return (str(request.kind), str(request.task), tuple(int(d) for d in request.input_shape),
            int(request.num_outputs), tuple(int(h) for h in request.hidden), str(request.norm))


#: One tensor of a model's fingerprint: name, shape, dtype and the digest of its starting values
#: (None: its values depend on the statistics, e.g. a standardisation layer's mean and std).
TensorPrint = tuple[str, tuple[int, ...], str, str | None]


def tensor_digest(array: np.ndarray) -> str:
    """The digest of one tensor's values as they travel (`check_arrays`' wire form): the first
    16 hex digits of the SHA-256 of its C-ordered bytes, dtype and shape."""
    value = np.ascontiguousarray(array)  # a view when it already is (no copy of a model)
    digest = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
    digest.update(value.reshape(-1).view(np.uint8) if value.size else b"")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ModelPrint:
    """What the same-code check compares of a hospital's model, without its weights: every
    tensor's name, shape, dtype and, where the starting weights must agree (every tensor the
    statistics do not fill), a digest of its values (`TensorPrint`, in state_dict order); the
    architecture id, the tensors that travel (None: all) and the hospital."""

    tensors: tuple[TensorPrint, ...]
    model_id: str
    federated: tuple[str, ...] | None = None
    site: str | None = None

    @classmethod
    def of(cls, model: InitialModel, varying: Sequence[str] = ()) -> ModelPrint:
        """The fingerprint of a whole model (a ``query.init`` reply): every tensor digested but
        the ``varying`` ones (those the statistics fill)."""
        return cls(fingerprint({k: array_view(a) for k, a in model.arrays.items()}, varying),
                   model.model_id, model.federated, model.site)


def fingerprint(arrays: Mapping[str, np.ndarray], varying: Sequence[str] = ()
                ) -> tuple[TensorPrint, ...]:
    """Each tensor's name, shape, dtype and digest (`tensor_digest`; None for ``varying``)."""
    checked = check_arrays(arrays, where="model check")
    skip = set(varying)
    return tuple((name, tuple(int(d) for d in a.shape), str(a.dtype),
                  None if name in skip else tensor_digest(a)) for name, a in checked.items())


@dataclass(frozen=True)
class ModelCheck:
    """A site's model in its ``query.setup`` (or ``query.stats``) reply, before the coordinator
    pooled any statistics, as a fingerprint (`ModelPrint`: no weights travel): built as
    ``query.init`` would build it for the request whose `model_key` is ``key``. It stands for
    the site's ``query.init`` reply in the majority check when the coordinator's request has the
    same key; ``statistics`` (tensor name -> one of `STATISTIC_SOURCES`; None: the site's recipe
    does more than place them) says where the pooled statistics go in the starting weights
    (`protocol.model_plan.place_statistics`), which the coordinator checks in the starting model
    the reference hospital builds."""

    model: ModelPrint
    key: tuple[Any, ...]
    statistics: dict[str, str] | None = None


def build_model_check(arrays: Mapping[str, np.ndarray], model_id: str,
                      federated: Sequence[str] | None, request: ModelRequest,
                      statistics: Mapping[str, str] | None,
                      varying: Sequence[str] = ()) -> dict[str, Any]:
    """The records of a model check (for `build_setup_reply` / `build_stats_reply`): the
    fingerprint of ``arrays`` (``varying``: the tensors the statistics fill, not digested), never
    the arrays themselves."""
    tensors = fingerprint(arrays, varying)
    key = model_key(request)
    values: dict[str, Any] = {
        "kind": key[0], "task": key[1], "input-shape": list(key[2]), "num-outputs": key[3],
        "hidden": list(key[4]), "norm": key[5]}
    if statistics is not None:
        values[STATISTICS] = json.dumps(_statistics_map(statistics, arrays), sort_keys=True)
    return {FINGERPRINT: _config_record({TENSORS: json.dumps(
                [[n, list(shape), dtype, digest] for n, shape, dtype, digest in tensors])}),
            MODEL: _model_record(model_id, federated, arrays), CHECK: _config_record(values)}


def _statistics_map(raw: Any, arrays: Mapping[str, Any] | Sequence[str]) -> dict[str, str]:
    if not isinstance(raw, Mapping) or not raw:
        raise ReplyError(f"A model check's statistics name at least one tensor. Received: "
                         f"{str(raw)[:200]}")
    out = {str(k): str(v) for k, v in raw.items()}
    if bad := [f"{k}={v}" for k, v in out.items()
               if k not in arrays or v not in STATISTIC_SOURCES]:
        raise ReplyError(f"A model check's statistics map the model's tensors to "
                         f"{list(STATISTIC_SOURCES)}. Received: {bad[:8]}")
    return out


def _read_tensors(text: str) -> tuple[TensorPrint, ...]:
    """A model check's fingerprint (JSON), each entry checked."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ReplyError(f"A model check's fingerprint is JSON. Received: {text[:200]}") from e
    out: list[TensorPrint] = []
    for entry in raw if isinstance(raw, list) else [raw]:
        if (not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str)
                or not isinstance(entry[1], list)
                or not all(isinstance(d, int) and d >= 0 for d in entry[1])
                or not isinstance(entry[2], str)
                or not (entry[3] is None or isinstance(entry[3], str))):
            raise ReplyError(f"A model check's fingerprint lists [name, shape, dtype, digest or "
                             f"null] per tensor. Received: {str(entry)[:200]}")
        out.append((entry[0], tuple(entry[1]), entry[2], entry[3]))
    names = [t[0] for t in out]
    if not out or len(set(names)) != len(names):
        raise ReplyError(f"A model check's fingerprint names each tensor once, at least one. "
                         f"Received: {names[:8]}")
    return tuple(out)


def _read_check(content: RecordDict, site: str, kind: str) -> ModelCheck | None:
    present = [name for name in (FINGERPRINT, MODEL, CHECK) if name in content]
    if not present:
        return None
    if len(present) != 3:
        raise ReplyError(f"A {kind} reply's model check holds the records fingerprint, model and "
                         f"check together. Received: {present}")
    tensors = _read_tensors(str(content.config_records[FINGERPRINT][TENSORS]))
    names = [t[0] for t in tensors]
    model = content.config_records[MODEL]
    federated = _read_federated(model, set(names), "A model check's", "tensors")
    c = content.config_records[CHECK]
    key = (str(c["kind"]), str(c["task"]),
           tuple(int(d) for d in np.atleast_1d(c["input-shape"])), int(c["num-outputs"]),
           tuple(int(h) for h in np.atleast_1d(c["hidden"])) if len(c["hidden"]) else (),
           str(c["norm"]))
    statistics = None
    if STATISTICS in c:
        try:
            raw = json.loads(str(c[STATISTICS]))
        except ValueError as e:
            raise ReplyError(f"A model check's statistics are JSON. Received: "
                             f"{str(c[STATISTICS])[:200]}") from e
        statistics = _statistics_map(raw, names)
    return ModelCheck(ModelPrint(tensors, str(model[MODEL_ID]), federated, site), key, statistics)


# --- train and evaluate ---------------------------------------------------------------------
def train_config(model_id: str, proximal_mu: float, schema: str | None = None) -> ConfigRecord:
    """The ``config`` record of every train instruction (Flower adds ``server-round``)."""
    values: dict[str, Any] = {MODEL_ID: model_id, PROXIMAL_MU: float(proximal_mu)}
    return _config_record({**values, SCHEMA_KEY: schema} if schema else values)


def evaluating_first(config: ConfigRecord) -> ConfigRecord:
    """A copy of a train instruction's ``config`` that also asks the hospital to score the
    model it receives before training (``evaluate-first``; the original is left unchanged)."""
    return _config_record({**dict(config.items()), EVALUATE_FIRST: True})


def evaluate_config(model_id: str, schema: str | None = None) -> ConfigRecord:
    """The ``config`` record of every evaluate instruction (Flower adds ``server-round``)."""
    return _config_record({MODEL_ID: model_id, SCHEMA_KEY: schema} if schema else {MODEL_ID: model_id})


@dataclass(frozen=True)
class ModelInstruction:
    """A train or evaluate instruction as the hospital reads it."""

    arrays: dict[str, np.ndarray]
    model_id: str
    server_round: int
    proximal_mu: float | None = None
    schema: str | None = None
    evaluate_first: bool = False


def parse_model_instruction(msg: Message, kind: str) -> ModelInstruction:
    """Check and read a ``train`` or ``evaluate`` instruction (hospital side)."""
    if kind not in (TRAIN, EVALUATE):
        raise ConfigError(f"Only train and evaluate instructions carry a model. Received: {kind!r}")
    check_content(kind, msg.content, reply=False)
    c = msg.content.config_records[CONFIG]
    record = msg.content.array_records[ARRAYS]
    return ModelInstruction(
        arrays={k: array_view(a) for k, a in record.items()},  # no second copy
        model_id=str(c[MODEL_ID]),
        server_round=int(c.get(SERVER_ROUND, 0)),
        proximal_mu=float(c[PROXIMAL_MU]) if PROXIMAL_MU in c else None,
        schema=str(c[SCHEMA_KEY]) if SCHEMA_KEY in c else None,
        evaluate_first=bool(c.get(EVALUATE_FIRST, False)),
    )


def build_train_reply(update: Update | Mapping[str, np.ndarray], metrics: Mapping[str, Any],
                      site_info: Mapping[str, str], *,
                      evaluation: Mapping[str, Any] | None = None,
                      metrics_allowed: Sequence[str] = ()) -> RecordDict:
    """A site's ``train`` reply: weights, count and scalar metrics, and who trained them.

    ``update`` is the trained `Update` (its count becomes ``num-examples``), or raw arrays in
    wire form (a simulated hostile site's poisoned weights, which skip the Update checks;
    ``metrics`` must then hold ``num-examples``). ``site_info`` holds ``name`` and optionally
    ``device``, ``parallel-mode``, ``parallel-config``. ``evaluation``: the received model's
    metrics on the validation rows (``evaluate-first``), checked as an evaluate reply's
    (``metrics_allowed``: the recipe's own metric names).
    """
    from flwr.app import MetricRecord

    if isinstance(update, Update):
        arrays: Mapping[str, np.ndarray] = update.arrays
        metrics = {NUM_EXAMPLES: update.num_examples, **metrics}
    else:
        arrays = update
    values = _scalar_metrics(metrics, TRAIN_METRICS, "train")
    if NUM_EXAMPLES not in values:
        raise ReplyError(f"A train reply needs {NUM_EXAMPLES!r}. Received: {sorted(values)}")
    records: dict[str, Any] = {
        ARRAYS: to_array_record(arrays), METRICS: MetricRecord(values),
        SITE: _config_record({k: str(v) for k, v in site_info.items()})}
    if evaluation is not None:
        records[EVALUATION] = evaluation_record(evaluation, metrics_allowed)
    content = _record_dict(records)
    check_content(TRAIN, content, reply=True)
    return content


def evaluation_record(evaluation: Mapping[str, Any], metrics_allowed: Sequence[str] = ()
                      ) -> MetricRecord:
    """A train reply's ``evaluation`` record (``evaluate-first``: the received model's metrics
    on the validation rows), checked as an evaluate reply's metrics (``metrics_allowed``: the
    recipe's own metric names); plain and masked (secure aggregation) train replies carry it."""
    from flwr.app import MetricRecord

    scored = _scalar_metrics(evaluation, EVALUATE_METRICS | frozenset(metrics_allowed),
                             "evaluation")
    if NUM_EXAMPLES not in scored:
        raise ReplyError(f"A train reply's evaluation needs {NUM_EXAMPLES!r}. Received: "
                         f"{sorted(scored)}")
    return MetricRecord(scored)


def build_evaluate_reply(metrics: Mapping[str, Any], site_info: Mapping[str, str],
                         *, metrics_allowed: Sequence[str] = ()) -> RecordDict:
    """A site's ``evaluate`` reply: count and scalar metrics on its held-out rows.

    ``metrics_allowed``: metric names the site's recipe declares besides `EVALUATE_METRICS`
    (lower-case names; a recipe's metrics are numbers computed over the held-out rows).
    """
    from flwr.app import MetricRecord

    values = _scalar_metrics(metrics, EVALUATE_METRICS | frozenset(metrics_allowed), "evaluate")
    if NUM_EXAMPLES not in values:
        raise ReplyError(f"An evaluate reply needs {NUM_EXAMPLES!r}. Received: {sorted(values)}")
    content = _record_dict({METRICS: MetricRecord(values),
                            SITE: _config_record({k: str(v) for k, v in site_info.items()})})
    check_content(EVALUATE, content, reply=True)
    return content


@dataclass(frozen=True)
class TrainReply:
    """A checked training reply.

    ``metrics`` holds every metric (the weight key included; lists stay lists); ``update``
    carries the scalar ones minus the weight key.
    """

    update: Update
    metrics: dict[str, float | list[float]]
    site: str
    info: dict[str, str] = field(default_factory=dict)


def parse_train_reply(msg: Message, *, weight_key: str = NUM_EXAMPLES,
                      server_round: int | None = None) -> TrainReply:
    """Check a ``train`` reply and turn it into a validated `Update` (raises on bad input).

    ``weight_key`` names the metric whose value (an integer >= 1) weights the update.
    """
    check_content(TRAIN, msg.content, reply=True)
    metrics = _numbers(msg.content.metric_records[METRICS])
    count = _weight(msg.content.metric_records[METRICS], weight_key)
    site = reply_site(msg)
    scalars = {k: v for k, v in metrics.items() if k != weight_key and not isinstance(v, list)}
    record = msg.content.array_records[ARRAYS]
    update = Update.from_array_record(record, num_examples=count, site=site, round=server_round,
                                      metrics=scalars)
    return TrainReply(update, metrics, site, _site_info(msg))


@dataclass(frozen=True)
class EvaluateReply:
    """A checked evaluation reply."""

    num_examples: int
    metrics: dict[str, float | list[float]]
    site: str


def parse_evaluate_reply(msg: Message, *, weight_key: str = NUM_EXAMPLES) -> EvaluateReply:
    """Check an ``evaluate`` reply and read its count and metrics (raises on bad input)."""
    check_content(EVALUATE, msg.content, reply=True)
    record = msg.content.metric_records[METRICS]
    return EvaluateReply(_weight(record, weight_key), _numbers(record), reply_site(msg))


def carries_evaluation(msg: Message) -> bool:
    """Whether ``msg`` is a train reply (by its type, or the arrays it carries, plain or
    masked: a merge step may already have taken them, `server.merge.PlainMerge.receive`),
    whose evaluation, if any, is its ``evaluation`` record, rather than an evaluate reply."""
    return msg.has_content() and (msg.metadata.message_type == TRAIN
                                  or ARRAYS in msg.content.array_records
                                  or MASKED in msg.content.array_records)


def evaluation_content(msg: Message) -> RecordDict:
    """The evaluation a reply carries as an evaluate reply's content (``metrics`` and ``site``):
    an evaluate reply's own; a train reply's ``evaluation`` record (for a user's
    ``evaluate_metrics_aggr_fn``, which reads Flower's evaluate replies)."""
    if not carries_evaluation(msg):
        return msg.content
    records: dict[str, Any] = {}
    if EVALUATION in msg.content.metric_records:
        records[METRICS] = msg.content.metric_records[EVALUATION]
    if SITE in msg.content.config_records:
        records[SITE] = msg.content.config_records[SITE]
    return _record_dict(records)


def parse_evaluation(msg: Message, *, weight_key: str = NUM_EXAMPLES) -> EvaluateReply:
    """The evaluation in an ``evaluate`` reply, or in a ``train`` reply's ``evaluation`` record
    (the received model scored before training); raises `ReplyError` when a train reply
    carries none (an agent that ignores ``evaluate-first``)."""
    if not carries_evaluation(msg):
        return parse_evaluate_reply(msg, weight_key=weight_key)
    if ARRAYS in msg.content.array_records:  # a masked reply's records: its merge step checks
        check_content(TRAIN, msg.content, reply=True)
    if EVALUATION not in msg.content.metric_records:
        raise ReplyError(
            f"The train reply carries no {EVALUATION!r} record although the instruction said "
            f"{EVALUATE_FIRST}: update the hospital's agent to this fedsplit version "
            f"(protocol/horizontal_wire.py). Received: records {sorted(msg.content.keys())}")
    record = msg.content.metric_records[EVALUATION]
    return EvaluateReply(_weight(record, weight_key), _numbers(record), reply_site(msg))

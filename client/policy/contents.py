"""What a hospital's reply carries, item by item, in the kinds its policy names.

Every array and every list of numbers a reply holds becomes one `Item` with the kinds of
`protocol.site_policy.SEND_KINDS` it needs the policy to allow (`reply_contents`):

- ``arrays`` of query.init, train and the model check of query.setup / query.stats: the model's
  tensors (its id: the reply's ``model`` record, else the instruction's), ``weights`` for its
  parameters and ``buffers`` for the rest (BatchNorm running statistics, the `Standardize`
  statistics, counters), read from the model rebuilt here; a model-check tensor that holds the
  hospital's own mean or std (the check's ``statistics`` map) also needs ``statistics``. When
  the model cannot be rebuilt, each tensor needs both ``weights`` and ``buffers``;
- the ``stats`` record's count, sum, sum of squares and the target's sums: ``statistics``;
- ``sums`` (the survival paths' vectors): ``survival-sums``;
- ``masked`` (secure aggregation): ``secure`` and the kinds of what it masks (the model's
  travelling tensors for a train reply, ``survival-sums`` for a survival stage); the
  ``secagg`` record (public keys, encrypted shares, unmasking shares): ``secure``;
- a vertical site's ``embeddings``: ``embeddings``; its PSI ``points`` and ``answer``:
  ``psi`` (blinded IDs, which the policy's run_kinds govern: a hospital that takes vertical
  runs takes PSI);
- the column report (query.schema, query.setup): ``column-report`` (governed by the label
  rules: min_category_count, rare_labels, max_labels), whose class labels and category names
  are listed for the egress log;
- anything else: ``unknown``, which no policy allows.

Counts (``num-examples``, a report's rows) and scalar metrics are no send kind: the protocol
needs them and the egress log records each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import survival as sv
from fedsplit.protocol.schema import SiteColumns
from fedsplit.protocol.site_policy import SURVIVAL_RUN

UNKNOWN = "unknown"
_STATISTICS = frozenset({"count", "sum", "sumsq", "y-sum", "y-sumsq"})
_VERTICAL = {"embeddings": ("embeddings",), "points": ("psi",), "answer": ("psi",)}


@dataclass(frozen=True)
class Item:
    """One array, list of numbers or secure-aggregation value a reply carries."""

    record: str
    name: str
    kinds: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """The egress log's form."""
        return {"record": self.record, "name": self.name, "kinds": list(self.kinds),
                "shape": list(self.shape), "dtype": self.dtype, "bytes": self.nbytes}


@dataclass
class Contents:
    """Everything a reply carries: items, counts, metrics, names, the DP epsilon it reports,
    and the task it states (a stats or setup reply's schema)."""

    items: list[Item] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    categories: dict[str, list[str]] = field(default_factory=dict)
    withheld: dict[str, int] = field(default_factory=dict)
    epsilon: float | None = None
    task: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every item."""
        return sum(i.nbytes for i in self.items)


@dataclass(frozen=True)
class Instruction:
    """What the hospital noted of an instruction before its handler ran (a handler may take
    records out of it, e.g. the ``secagg`` record of a secure train instruction)."""

    message: str
    model_id: str | None
    secure: bool
    server_round: int | None


def read_instruction(msg: Any) -> Instruction:
    """The parts of ``msg`` the reply's classification and the egress log need."""
    config = msg.content.config_records.get(wire.CONFIG) if msg.has_content() else None
    model_id = server_round = None
    if config is not None:
        if wire.MODEL_ID in config:
            model_id = str(config[wire.MODEL_ID])
        if wire.SERVER_ROUND in config:
            try:
                server_round = int(config[wire.SERVER_ROUND])
            except (TypeError, ValueError):
                server_round = None
    secure = msg.has_content() and pv.SECAGG in msg.content.config_records
    return Instruction(str(msg.metadata.message_type), model_id, bool(secure), server_round)


def _array_item(record: str, name: str, array: Any, kinds: tuple[str, ...]) -> Item:
    shape = tuple(int(d) for d in array.shape)
    try:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize
    except TypeError:  # not a numpy dtype: the serialized size
        nbytes = len(array.data)
    return Item(record, name, kinds, shape, str(array.dtype), int(nbytes))


def _value_item(record: str, name: str, value: Any, kinds: tuple[str, ...]) -> Item:
    """A config or metric value as an item (bytes, strings, numbers and lists of them)."""
    if isinstance(value, bytes):
        return Item(record, name, kinds, (len(value),), "bytes", len(value))
    if isinstance(value, str):
        return Item(record, name, kinds, (), "str", len(value.encode()))
    if isinstance(value, list):
        if value and isinstance(value[0], bytes):
            return Item(record, name, kinds, (len(value),), "list[bytes]",
                        sum(len(v) for v in value))
        if value and isinstance(value[0], str):
            return Item(record, name, kinds, (len(value),), "list[str]",
                        sum(len(v.encode()) for v in value))
        dtype = "float64" if any(isinstance(v, float) for v in value) else "int64"
        return Item(record, name, kinds, (len(value),), dtype, 8 * len(value))
    dtype = "bool" if isinstance(value, bool) else (
        "float64" if isinstance(value, float) else "int64")
    return Item(record, name, kinds, (), dtype, 8)


@lru_cache(maxsize=16)
def model_kinds(model_id: str) -> tuple[dict[str, str], tuple[str, ...]] | None:
    """``({tensor: "weights" | "buffers"}, the tensors that travel)`` of the model ``model_id``
    names, rebuilt here (its recipe is the one this process loaded); None when it cannot be."""
    try:
        import torch
        from fedsplit.client.models import build_model, recipe_of

        try:  # the structure only: on torch's meta device nothing is allocated or initialised
            with torch.device("meta"):
                model = build_model(model_id)
        except Exception:  # a recipe whose construction needs real tensors
            model = build_model(model_id)
        parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        kinds = {n: "weights" if n in parameters else "buffers" for n in model.state_dict()}
        return kinds, tuple(recipe_of(model).federated(model))
    except Exception:  # any recipe failure: the conservative kinds apply
        return None


def _tensor_kinds(model_id: str | None, name: str) -> tuple[str, ...]:
    known = model_kinds(model_id) if model_id else None
    if known is None or name not in known[0]:
        return ("weights", "buffers")  # either: both must be allowed
    return (known[0][name],)


def _masked_kinds(app: str, instruction: Instruction) -> tuple[str, ...]:
    if app == SURVIVAL_RUN or instruction.message == sv.QUERY:
        return ("secure", "survival-sums")
    known = model_kinds(instruction.model_id) if instruction.model_id else None
    if known is None:
        return ("secure", "weights", "buffers")
    travelling = sorted({known[0].get(n, "weights") for n in known[1]})
    return ("secure", *travelling)


def _statistics_map(content: Any) -> dict[str, str]:
    check = content.config_records.get(wire.CHECK)
    if check is None or wire.STATISTICS not in check:
        return {}
    try:
        value = json.loads(str(check[wire.STATISTICS]))
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _report(contents: Contents, text: str) -> None:
    """The names a column report gives: class labels, categories, what it withheld."""
    try:
        report = SiteColumns.from_json(text)
    except Exception:  # the coordinator refuses it; the log keeps its size
        return
    contents.counts["rows"] = report.rows
    for column in report.columns:
        if column.categories:
            contents.categories[column.name] = sorted(column.categories)
        if column.withheld:
            contents.withheld[column.name] = int(column.withheld)
    if report.target is not None and report.target.labels:
        contents.labels = sorted(report.target.labels)


def _number(value: Any) -> float | int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else float(value)


def reply_contents(app: str, instruction: Instruction, content: Any) -> Contents:
    """Every item of a reply's ``content`` (a Flower ``RecordDict``) with the kinds it needs,
    its counts, metrics and names (see the module docstring); ``app``: the ClientApp's kind."""
    out = Contents()
    reply_model = content.config_records.get(wire.MODEL)
    model_id = (str(reply_model[wire.MODEL_ID]) if reply_model is not None
                and wire.MODEL_ID in reply_model else instruction.model_id)
    statistics = _statistics_map(content)
    for record, arrays in content.array_records.items():
        for name, array in arrays.items():
            if app == "vertical":
                kinds = _VERTICAL.get(name, (UNKNOWN,)) if record == "arrays" else (UNKNOWN,)
            elif record == wire.ARRAYS:
                kinds = _tensor_kinds(model_id, name)
                if name in statistics:
                    kinds = (*kinds, "statistics")
            elif record == pv.MASKED:
                kinds = _masked_kinds(app, instruction)
            elif record == sv.SUMS:
                kinds = ("survival-sums",)
            else:
                kinds = (UNKNOWN,)
            out.items.append(_array_item(record, name, array, kinds))
    for record, metrics in content.metric_records.items():
        for name, value in metrics.items():
            if name == wire.NUM_EXAMPLES:
                out.counts[name if record == wire.METRICS else f"{record}.{name}"] = int(value)
            elif record == wire.STATS_RECORD and name in _STATISTICS:
                out.items.append(_value_item(record, name, value, ("statistics",)))
            elif isinstance(value, list):
                out.items.append(_value_item(record, name, value, (UNKNOWN,)))
            else:
                key = name if record == wire.METRICS else f"{record}.{name}"
                out.metrics[key] = _number(value)
                if name == wire.DP_EPSILON:
                    out.epsilon = float(value)
    for record, config in content.config_records.items():
        if record == pv.SECAGG:
            out.items.extend(_value_item(record, k, v, ("secure",)) for k, v in config.items()
                             if k != pv.STAGE)
        elif record == wire.COLUMNS and wire.REPORT in config:
            text = str(config[wire.REPORT])
            out.items.append(Item(record, wire.REPORT, ("column-report",), (), "json",
                                  len(text.encode())))
            _report(out, text)
        elif record == wire.SCHEMA and "task" in config and app == "horizontal":
            out.task = str(config["task"])
        elif app == "vertical":
            out.counts.update({f"{record}.{k}": int(v) for k, v in config.items()
                               if isinstance(v, int) and not isinstance(v, bool)})
    return out


def describe_items(items: list[Item], limit: int = 3) -> str:
    """The first few items in one phrase: ``arrays/body.0.weight (64, 30) weights``."""
    shown = [f"{i.record}/{i.name} {tuple(i.shape)} {'+'.join(i.kinds)}" for i in items[:limit]]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(shown) + more

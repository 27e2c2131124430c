"""The table schema a federation agrees on before round 1, without any row leaving a site.

Hospitals export their tables as they come: numbers, booleans, text categories, missing values
written in several ways, columns in their own order. Three steps turn them into one model input:

1. **Per-site column report** (`column_report`, sent in the ``query.schema`` reply): for every
   column its name, kind (``numeric``, ``boolean``, ``categorical`` or ``empty``), how many
   values are present and missing, for numbers whether they are all 0/1, and for text its
   categories with their counts. A category seen fewer than ``min_category_count`` times
   (default `MIN_CATEGORY_COUNT` = 5) at a site is **withheld**: only the number of withheld
   categories is reported, never their names or counts. For the target: its kind and, when it
   holds class labels, each label held by at least ``min_category_count`` rows with its count
   (a rarer label is **withheld** the same way: only how many were withheld is reported; the
   hospital drops its rows unless the agreed schema holds the label: `named_label_rows`).
   For a survival task (``event`` set), the target is the time column and the event column is
   the second target: the site checks that every row's time is a positive number and its
   event reads as 1/0, TRUE/FALSE or yes/no (`protocol.survival.read_survival`, refused with
   counts per problem and the fix) and reports the target kind ``time-event`` only
   (`protocol.tasks.LabelEncoding.TIME_EVENT`), never a time or an event count.
2. **Merged, versioned schema** (`merge_reports`, run by the coordinator): the columns in the
   order of the first hospital by name, the union vocabulary of each text column in sorted
   order, a missing-indicator for every column with gaps at any site, the class labels in
   sorted order (at most ``max_labels``, default `MAX_LABELS`: more are refused, naming the
   hospitals that brought the most). Conflicts raise `ConfigError` naming the hospital, the
   column and the fix;
   suspicious columns become warnings (see also `moment_warnings`).
3. **Encoding** (`encode_frame`), the same at every site and in ``fedsplit predict``:

   - numeric: the number (missing -> NaN, which the model's standardisation turns into the
     pooled mean);
   - boolean: 1.0 / 0.0 (``true/false``, ``yes/no``, ``t/f``, ``y/n``, ``1/0``, any case);
   - categorical: one column per vocabulary entry (``name=value``), 1.0 for the row's value;
   - ``name:missing``: 1.0 where the value is missing, for columns with gaps somewhere;
   - the target: a class index, a number, or for survival the pair (time, event 1/0).

   **Fallback**: a category outside the vocabulary (unseen, or withheld everywhere) encodes as
   all-zero one-hot and sets the column's missing indicator when it has one, i.e. it is treated
   as missing.

Missing values are empty cells, ``NA``, ``N/A``, ``NaN``, ``null``, ``None`` and ``?`` (any case),
plus the run's ``na-values`` (``VALUE`` for every column, ``COLUMN=VALUE`` for one). The schema
is JSON (``format`` ``fedsplit.schema``, ``version`` 1); it travels in the Flower
stats/train/evaluate instructions and is stored in every weight file the coordinator writes, so
a model scores raw files on its own.

What the exchange reveals to the coordinator, per site: its row count, every column's name,
kind, number of present and missing values, whether a numeric column is all 0/1, each text
category held by at least ``min_category_count`` rows with its count, the number of withheld
categories, each class label held by at least ``min_category_count`` rows with its count, and
the number of withheld labels. Per encoded feature the later statistics
exchange adds count, sum and sum of squares (mean and spread), as before. Never a row, an ID,
a rare category's or rare label's name, or a combination of columns.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fedsplit.protocol.cells import FALSE_WORDS, TRUE_WORDS, na_set
from fedsplit.protocol.column_sets import check_same_columns
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.survival_rows import read_survival
from fedsplit.protocol.tasks import (
    LabelEncoding,
    inferred_kind,
    label_encoding,
    task_kind,
    task_names,
)

SCHEMA_FORMAT = "fedsplit.schema"
SCHEMA_VERSION = 1
MIN_CATEGORY_COUNT = 5
KINDS = ("numeric", "boolean", "categorical", "empty")
#: Most distinct values a numeric target may hold to count as class labels.
MAX_CLASSES = 20
#: Most distinct class labels a merged schema may hold (each is a model output at every
#: hospital); `merge_reports` refuses more, naming the hospitals that brought the most.
MAX_LABELS = 100
#: A site's values this many times larger (or smaller) than the others' are flagged.
RANGE_FACTOR = 100.0
MANY_CATEGORIES = 50
MISSING_SUFFIX = ":missing"


# --- reading raw cells ----------------------------------------------------------------------
def _cell(value: Any) -> str | None:
    """A raw cell as stripped text; None for a missing value of the file format itself."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    if isinstance(value, float | np.floating):
        if math.isnan(float(value)):
            return None
        f = float(value)
        return str(int(f)) if f.is_integer() and abs(f) < 2**53 else repr(f)
    if isinstance(value, int | np.integer):
        return str(int(value))
    return str(value).strip()


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass
class RawColumn:
    """One column's cells as text (None = missing), with the kind they read as."""

    name: str
    cells: list[str | None]
    kind: str
    numbers: np.ndarray | None = None  # float64, NaN for missing (numeric columns)


def read_column(name: str, values: Sequence[Any], missing: frozenset[str]) -> RawColumn:
    """Classify a column: all numbers -> numeric; all boolean words -> boolean; else categorical."""
    cells: list[str | None] = []
    numeric_markers = {n for n in (_number(m) for m in missing) if n is not None}
    for v in values:
        text = _cell(v)
        gap = text is None or text.lower() in missing or (
            bool(numeric_markers) and _number(text) in numeric_markers)
        cells.append(None if gap else text)
    present = [c for c in cells if c is not None]
    if not present:
        return RawColumn(name, cells, "empty", np.full(len(cells), np.nan))
    numbers = [_number(c) for c in present]
    if all(n is not None for n in numbers):
        arr = np.array([np.nan if c is None else _number(c) for c in cells], dtype=np.float64)
        return RawColumn(name, cells, "numeric", arr)
    if all(c.lower() in TRUE_WORDS | FALSE_WORDS for c in present):
        return RawColumn(name, cells, "boolean")
    return RawColumn(name, cells, "categorical")


@dataclass(frozen=True)
class TableSettings:
    """How a site reads its table (run config: target, id-column, ignore-columns, na-values;
    for survival, the target is the time column and ``event`` the event column)."""

    target: str
    id_column: str = ""
    ignore_columns: tuple[str, ...] = ()
    na_values: tuple[str, ...] = ()
    min_category_count: int = MIN_CATEGORY_COUNT
    event: str = ""


def split_columns(columns: Sequence[str], settings: TableSettings, *, where: str,
                  need_target: bool = True) -> list[str]:
    """The feature columns of a table: all but the target, the ID column and ignored ones."""
    names = [str(c) for c in columns]
    dup = sorted({c for c in names if names.count(c) > 1})
    if dup:
        raise ConfigError(f"{where} has duplicate column names {dup}; rename them. "
                          f"Received: columns {names}")
    if need_target and settings.target not in names:
        raise ConfigError(
            f"{where} has no target column {settings.target!r}; every hospital's table must hold "
            f"the run's target column, which the command that starts the run names (--target of "
            f"simulate, up and vertical simulate; --time for a survival task). "
            f"Columns: {', '.join(names)}. Received: {settings.target!r}"
        )
    if need_target and settings.event and settings.event not in names:
        raise ConfigError(
            f"{where} has no event column {settings.event!r}; pass the right one with --event. "
            f"Columns: {', '.join(names)}. Received: {settings.event!r}"
        )
    if settings.id_column and settings.id_column not in names:
        raise ConfigError(f"{where} has no ID column {settings.id_column!r} (--id-column). "
                          f"Columns: {', '.join(names)}. Received: {settings.id_column!r}")
    skip = {settings.target, settings.event, settings.id_column, *settings.ignore_columns} - {""}
    return [c for c in names if c not in skip]


# --- per-site report ------------------------------------------------------------------------
@dataclass(frozen=True)
class ColumnReport:
    """What one site says about one column (never a value of a row)."""

    name: str
    kind: str
    count: int
    missing: int
    binary: bool = False
    categories: dict[str, int] = field(default_factory=dict)
    withheld: int = 0


@dataclass(frozen=True)
class TargetReport:
    """The target column at one site: its kind and, for class labels, each label's count (the
    labels held by at least ``min_category_count`` rows) and how many rarer ones were withheld."""

    kind: str
    labels: dict[str, int] | None
    withheld: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The wire form (``withheld`` only when some label was withheld)."""
        out: dict[str, Any] = {"kind": self.kind, "labels": self.labels}
        if self.withheld:
            out["withheld"] = self.withheld
        return out


@dataclass(frozen=True)
class SiteColumns:
    """A site's column report (``query.schema`` reply); ``table`` False for image (NPZ) sites."""

    site: str
    rows: int
    table: bool
    columns: tuple[ColumnReport, ...] = ()
    target: TargetReport | None = None

    def to_json(self) -> str:
        """JSON for the wire."""
        return json.dumps({
            "site": self.site, "rows": self.rows, "table": self.table,
            "columns": [c.__dict__ for c in self.columns],
            "target": self.target.to_dict() if self.target else None,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SiteColumns:
        """Parse and check a report; anything beyond the documented fields is refused."""
        try:
            raw = json.loads(text)
            _keys(raw, {"site", "rows", "table", "columns", "target"}, "report")
            columns = []
            for c in raw["columns"]:
                _keys(c, {"name", "kind", "count", "missing", "binary", "categories", "withheld"},
                      "column report")
                if c["kind"] not in KINDS:
                    raise ValueError(f"kind {c['kind']!r}")
                cats = {str(k): int(v) for k, v in dict(c["categories"]).items()}
                columns.append(ColumnReport(str(c["name"]), str(c["kind"]), int(c["count"]),
                                            int(c["missing"]), bool(c["binary"]), cats,
                                            int(c["withheld"])))
            target = None
            if raw["target"] is not None:
                _keys(raw["target"], {"kind", "labels"}, "target report",
                      optional=frozenset({"withheld"}))
                labels = raw["target"]["labels"]
                target = TargetReport(str(raw["target"]["kind"]),
                                      None if labels is None else
                                      {str(k): int(v) for k, v in dict(labels).items()},
                                      int(raw["target"].get("withheld", 0)))
            return cls(str(raw["site"]), int(raw["rows"]), bool(raw["table"]), tuple(columns),
                       target)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"A site's column report is not in the documented form "
                              f"(protocol/schema.py): {e}. Received: {text[:200]!r}") from e


def _keys(obj: Any, allowed: set[str], what: str, optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be an object")
    if extra := sorted(set(obj) - allowed - optional):
        raise ValueError(f"{what} holds undocumented fields {extra}")
    if missing := sorted(allowed - set(obj)):
        raise ValueError(f"{what} lacks {missing}")


def _label(text: str, kind: str) -> str:
    """A class label in canonical text: integers without '.0', boolean words lower-cased."""
    if kind == "boolean":
        return text.lower()
    number = _number(text)
    if number is not None and number.is_integer():
        return str(int(number))
    return text


def label_counts(column: RawColumn) -> dict[str, int] | None:
    """Every class label of a target column with its count (canonical text: `_label`), or None
    for a numeric target that holds no class labels (more than `MAX_CLASSES` distinct values, or
    non-integers). Never sent: `target_report` withholds the rare ones."""
    if column.kind == "numeric":
        values = column.numbers[~np.isnan(column.numbers)]
        distinct = np.unique(values)
        if len(distinct) > MAX_CLASSES or not np.all(np.mod(distinct, 1) == 0):
            return None
    labels: dict[str, int] = {}
    for c in column.cells:
        if c is not None:
            key = _label(c, column.kind)
            labels[key] = labels.get(key, 0) + 1
    return labels


def target_label_counts(frame: Any, settings: TableSettings) -> dict[str, int] | None:
    """A table's class labels with their counts (`label_counts` of its target column); None for
    a survival task, a table without the target column, or a target without class labels."""
    if settings.event or settings.target not in frame.columns:
        return None
    return label_counts(read_column(settings.target, frame[settings.target].tolist(),
                                    na_set(settings.na_values, settings.target)))


def target_report(column: RawColumn, min_count: int = 1) -> TargetReport:
    """The target's kind and its labels (text, booleans, or up to 20 integer values) held by at
    least ``min_count`` rows, with the number of rarer labels withheld (never their names)."""
    counts = label_counts(column)
    if counts is None:
        return TargetReport("numeric", None)
    named = {k: v for k, v in sorted(counts.items()) if v >= min_count}
    return TargetReport(column.kind, named, len(counts) - len(named))


def named_label_rows(schema: Schema, values: Sequence[Any], named: Collection[str]) -> np.ndarray:
    """Which rows of a hospital's target ``values`` it uses with ``schema``: a row whose label
    the schema does not hold and the hospital did not name (``named``: the labels of its own
    column report; the others it withheld as rare) is dropped (False); every other row is
    used, and a label the hospital named but the schema lacks is refused by the encoding as
    before. All True for a schema without class labels."""
    if not schema.labels or not task_kind(schema.task).classes:
        return np.ones(len(values), dtype=bool)
    col = read_column(schema.target, values, na_set(schema.na_values, schema.target))
    known = set(schema.labels) | set(named)
    return np.array([c is None or _label(c, col.kind) in known for c in col.cells], dtype=bool)


def column_report(site: str, frame: Any, settings: TableSettings, *,
                  label_min_count: int | None = None) -> SiteColumns:
    """A site's report on its table (a DataFrame): one `ColumnReport` per feature column, and the
    target's (class labels held by fewer than ``label_min_count`` rows, by default the
    settings' ``min_category_count``, are withheld like rare categories)."""
    where = f"Hospital {site}'s table"
    features = split_columns(list(frame.columns), settings, where=where)
    reports = []
    for name in features:
        col = read_column(name, frame[name].tolist(), na_set(settings.na_values, name))
        present = [c for c in col.cells if c is not None]
        cats: dict[str, int] = {}
        withheld = 0
        binary = False
        if col.kind == "categorical":
            counts: dict[str, int] = {}
            for c in present:
                counts[c] = counts.get(c, 0) + 1
            cats = {k: v for k, v in sorted(counts.items()) if v >= settings.min_category_count}
            withheld = len(counts) - len(cats)
        elif col.kind == "numeric":
            values = col.numbers[~np.isnan(col.numbers)]
            binary = bool(np.all((values == 0) | (values == 1)))
        reports.append(ColumnReport(name, col.kind, len(present), len(col.cells) - len(present),
                                    binary, cats, withheld))
    if settings.event:  # survival: every row's time and event must read (refused with counts)
        read_survival(f"Hospital {site}", frame, settings.target, settings.event,
                      settings.na_values)
        return SiteColumns(site, len(frame), True, tuple(reports),
                           TargetReport(LabelEncoding.TIME_EVENT.value, None))
    target = read_column(settings.target, frame[settings.target].tolist(),
                         na_set(settings.na_values, settings.target))
    gaps = sum(c is None for c in target.cells)
    if gaps:
        raise ConfigError(
            f"{where}: target column {settings.target!r} has {gaps} missing value(s); drop those "
            f"rows first. Received: {gaps} missing targets"
        )
    return SiteColumns(site, len(frame), True, tuple(reports), target_report(
        target, settings.min_category_count if label_min_count is None else label_min_count))


# --- the merged schema ----------------------------------------------------------------------
@dataclass(frozen=True)
class SchemaColumn:
    """One column of the agreed schema."""

    name: str
    kind: str  # numeric | boolean | categorical
    categories: tuple[str, ...] = ()
    missing_indicator: bool = False

    def encoded_names(self) -> list[str]:
        """The model inputs this column becomes."""
        names = ([f"{self.name}={c}" for c in self.categories] if self.kind == "categorical"
                 else [self.name])
        return names + ([f"{self.name}{MISSING_SUFFIX}"] if self.missing_indicator else [])


@dataclass(frozen=True)
class Schema:
    """The versioned schema every site encodes with; travels with the model."""

    columns: tuple[SchemaColumn, ...]
    target: str
    task: str
    labels: tuple[str, ...] = ()
    id_column: str = ""
    ignore_columns: tuple[str, ...] = ()
    na_values: tuple[str, ...] = ()
    min_category_count: int = MIN_CATEGORY_COUNT
    version: int = SCHEMA_VERSION
    event: str = ""  # survival: the event column (``target`` is the time column)

    @property
    def feature_names(self) -> list[str]:
        """Encoded feature names, in model input order."""
        return [n for c in self.columns for n in c.encoded_names()]

    @property
    def settings(self) -> TableSettings:
        """How to read a table for this schema."""
        return TableSettings(self.target, self.id_column, self.ignore_columns, self.na_values,
                             self.min_category_count, self.event)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``format``, ``version``, columns, target, labels, reading settings;
        ``event`` only for survival, so other schemas read and hash as before)."""
        out = {
            "format": SCHEMA_FORMAT, "version": self.version, "target": self.target,
            "task": self.task, "labels": list(self.labels), "id_column": self.id_column,
            "ignore_columns": list(self.ignore_columns), "na_values": list(self.na_values),
            "min_category_count": self.min_category_count,
            "columns": [{"name": c.name, "kind": c.kind, "categories": list(c.categories),
                         "missing_indicator": c.missing_indicator} for c in self.columns],
        }
        if self.event:
            out["event"] = self.event
        return out

    def to_json(self) -> str:
        """Compact, key-sorted JSON (stable: the same schema gives the same text)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """sha256 of `to_json` (first 16 hex digits), to name a schema in logs."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> Schema:
        """Parse and check a schema (strict: unknown fields or versions are refused)."""
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
            _keys(raw, {"format", "version", "target", "task", "labels", "id_column",
                        "ignore_columns", "na_values", "min_category_count", "columns"},
                  "schema", optional=frozenset({"event"}))
            if raw["format"] != SCHEMA_FORMAT:
                raise ValueError(f"format must be {SCHEMA_FORMAT!r}, not {raw['format']!r}")
            if raw["version"] != SCHEMA_VERSION:
                raise ValueError(f"version {raw['version']!r}; this fedsplit reads version "
                                 f"{SCHEMA_VERSION} (upgrade fedsplit)")
            if raw["task"] not in task_names():
                raise ValueError(f"task {raw['task']!r} (registered: {', '.join(task_names())})")
            event = str(raw.get("event", ""))
            if task_kind(raw["task"]).time_event != bool(event):
                raise ValueError(f"task {raw['task']!r} with event column {event!r} (a survival "
                                 f"schema names its event column; no other does)")
            columns = []
            for c in raw["columns"]:
                _keys(c, {"name", "kind", "categories", "missing_indicator"}, "schema column")
                if c["kind"] not in ("numeric", "boolean", "categorical"):
                    raise ValueError(f"column kind {c['kind']!r}")
                columns.append(SchemaColumn(str(c["name"]), c["kind"],
                                            tuple(str(v) for v in c["categories"]),
                                            bool(c["missing_indicator"])))
            return cls(tuple(columns), str(raw["target"]), raw["task"],
                       tuple(str(v) for v in raw["labels"]), str(raw["id_column"]),
                       tuple(str(v) for v in raw["ignore_columns"]),
                       tuple(str(v) for v in raw["na_values"]), int(raw["min_category_count"]),
                       event=event)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"Not a fedsplit table schema (protocol/schema.py): {e}. "
                              f"Received: {str(text)[:200]!r}") from e


@dataclass(frozen=True)
class MergedSchema:
    """`merge_reports`' result: the schema and the warnings about suspicious columns."""

    schema: Schema
    warnings: list[str]


def _fix(column: str) -> str:
    return f"or leave the column out at every site with --ignore-column {column}"


def merge_reports(reports: Sequence[SiteColumns], settings: TableSettings, *,
                  task: str = "auto", max_labels: int = MAX_LABELS) -> MergedSchema:
    """Merge the sites' column reports into one schema; conflicts raise `ConfigError`.

    Conflicts: more than ``max_labels`` distinct class labels (checked first, in linear time),
    a column absent at some site, text at one site and numbers (or booleans) at another,
    targets of different kinds, text labels a site shares with no other site, a regression
    task on text labels. Warnings: a column entirely missing at a site (or at every site: it is
    dropped), text categories or class labels withheld at a site and unknown to the others, a
    text column with more than 50 categories (an ID?).
    """
    if not reports:
        raise ConfigError("No hospital reported its columns. Received: 0 reports")
    if label_encoding(task) in (None, LabelEncoding.CLASSES):
        check_label_count(reports, settings.target, max_labels)
    ordered = sorted(reports, key=lambda r: r.site)
    ref = ordered[0]
    warnings: list[str] = []
    by_site = {r.site: {c.name: c for c in r.columns} for r in ordered}
    # the odd hospital(s) against the majority, both sides of each difference (column_sets)
    check_same_columns({r.site: [c.name for c in r.columns] for r in ordered})
    columns = []
    withheld: list[str] = []
    for col in ref.columns:
        name = col.name
        per_site = {s: cols[name] for s, cols in by_site.items()}
        for site, c in per_site.items():
            if c.kind == "empty":
                warnings.append(f"column {name!r} is entirely missing at {site} "
                                f"({c.missing} rows): its rows there count as missing")
        kinds = {s: c.kind for s, c in per_site.items() if c.kind != "empty"}
        if not kinds:
            warnings.append(f"column {name!r} is empty at every hospital; it is left out")
            continue
        kind = _merge_kind(name, kinds, per_site)
        gaps = any(c.missing > 0 for c in per_site.values())
        cats: tuple[str, ...] = ()
        if kind == "categorical":
            union = sorted({k for c in per_site.values() for k in c.categories})
            cats = tuple(union)
            held = [f"{site} ({c.withheld})" for site, c in per_site.items() if c.withheld]
            if held:
                withheld.append(f"{name} at {', '.join(held)}")
            if not cats:
                warnings.append(f"column {name!r}: no category reaches {settings.min_category_count}"
                                f" rows at any hospital; every value encodes as unseen")
            if len(cats) > MANY_CATEGORIES:
                warnings.append(f"column {name!r} has {len(cats)} categories; if it is an ID, "
                                f"pass --id-column {name} or --ignore-column {name}")
            gaps = gaps or any(c.withheld for c in per_site.values())
        columns.append(SchemaColumn(name, kind, cats, gaps))
    if withheld:
        warnings.append(
            f"rare categories withheld (held by fewer than {settings.min_category_count} rows at "
            f"a hospital; their rows encode as unseen unless another hospital reports them): "
            f"{'; '.join(withheld)}")
    if not columns:
        raise ConfigError("No feature column holds any value at any hospital. Received: "
                          f"columns {[c.name for c in ref.columns]}")
    task, labels = _merge_target(ordered, settings, task)
    if task_kind(task).classes and (rare := [f"{r.site} ({r.target.withheld})" for r in ordered
                                              if r.target is not None and r.target.withheld]):
        warnings.append(
            f"rare class labels withheld (held by fewer than {settings.min_category_count} rows "
            f"at a hospital, never named): {', '.join(rare)}; a hospital trains and scores on "
            f"such rows only when another hospital names the label")
    schema = Schema(tuple(columns), settings.target, task, labels, settings.id_column,
                    tuple(settings.ignore_columns), tuple(settings.na_values),
                    settings.min_category_count, event=settings.event)
    return MergedSchema(schema, warnings)


def check_label_count(reports: Sequence[SiteColumns], target: str,
                      max_labels: int = MAX_LABELS) -> None:
    """Refuse more than ``max_labels`` distinct class labels over the hospitals' reports (each
    is a model output at every hospital), in one line naming the hospital(s) that brought the
    most and how many; linear in the number of labels."""
    union: set[str] = set()
    sizes: dict[str, int] = {}
    for r in reports:
        if r.target is not None and r.target.labels:
            sizes[r.site] = len(r.target.labels)
            union.update(r.target.labels)
    if len(union) <= max_labels:
        return
    most = max(sizes.values())
    top = sorted(s for s, n in sizes.items() if n == most)
    names = ", ".join(top[:5]) + (f" and {len(top) - 5} more" if len(top) > 5 else "")
    who = "hospital" if len(top) == 1 else "hospitals"
    raise ConfigError(
        f"The target {target!r} holds {len(union):,} distinct class labels across the hospitals, "
        f"more than the {max_labels} a federation accepts (each label is a model output at every "
        f"hospital); {who} {names} brought the most ({most:,}{' each' if len(top) > 1 else ''}). "
        f"Map the labels to at most {max_labels} classes at {names} (or use task=regression "
        f"for a numeric target). "
        f"Received: {most:,} labels from {names}, {len(union):,} in all")


def _merge_kind(name: str, kinds: Mapping[str, str], per_site: Mapping[str, ColumnReport]) -> str:
    found = set(kinds.values())
    if found == {"numeric"}:
        return "numeric"
    if found == {"categorical"}:
        return "categorical"
    if found <= {"numeric", "boolean"}:
        wide = [s for s, k in kinds.items() if k == "numeric" and not per_site[s].binary]
        if not wide:
            return "boolean"
        bools = [s for s, k in kinds.items() if k == "boolean"]
        raise ConfigError(
            f"Column {name!r} holds booleans (true/false, yes/no) at {', '.join(bools)} but numbers "
            f"other than 0/1 at {', '.join(wide)}. Write the same values at every hospital "
            f"{_fix(name)}. Received: kinds {dict(kinds)}"
        )
    text = [s for s, k in kinds.items() if k == "categorical"]
    other = [s for s, k in kinds.items() if k != "categorical"]
    example = next((next(iter(per_site[s].categories)) for s in text if per_site[s].categories),
                   None)
    shown = f" (e.g. {example!r})" if example is not None else ""
    raise ConfigError(
        f"Column {name!r} holds text at {', '.join(text)}{shown} but numbers or booleans at "
        f"{', '.join(other)}. Clean the values at {', '.join(text)}, declare the text markers "
        f"as missing with --na-values, {_fix(name)}. Received: kinds {dict(kinds)}"
    )


def _merge_target(reports: Sequence[SiteColumns], settings: TableSettings,
                  task: str) -> tuple[str, tuple[str, ...]]:
    target = settings.target
    kinds = {r.site: r.target.kind for r in reports if r.target is not None}
    wanted, time_event = label_encoding(task), LabelEncoding.TIME_EVENT
    if settings.event or wanted is time_event or time_event in kinds.values():
        if not settings.event or wanted not in (None, time_event):
            raise ConfigError(
                f"A survival task needs its time and event columns: --task survival --time COLUMN "
                f"--event COLUMN. Received: task={task!r}, time={target!r}, "
                f"event={settings.event!r}")
        odd = sorted(s for s, k in kinds.items() if k != time_event)
        if odd:
            raise ConfigError(f"Hospital(s) {', '.join(odd)} reported a {kinds[odd[0]]!r} target, "
                              f"not survival columns: every hospital must run the same task. "
                              f"Received: kinds {kinds}")
        return (task if wanted else inferred_kind(time_event).name), ()
    text_sites = [s for s, k in kinds.items() if k == "categorical"]
    if len(set(kinds.values())) > 1:
        first = sorted(kinds)[0]
        odd = [s for s, k in kinds.items() if k != kinds[first]]
        raise ConfigError(
            f"The target {target!r} holds {kinds[first]} labels at {first} but "
            f"{kinds[odd[0]]} ones at {', '.join(odd)}: the label sets differ. Write the same "
            f"labels at every hospital. Received: kinds {kinds}"
        )
    continuous = [r.site for r in reports if r.target is not None and r.target.labels is None]
    if wanted is None:  # auto: numbers are values (regression), labels classes
        task = inferred_kind(LabelEncoding.VALUES if continuous else LabelEncoding.CLASSES).name
    if task_kind(task).values:
        if text_sites or set(kinds.values()) == {"boolean"}:
            raise ConfigError(f"task={task} needs a numeric target; {target!r} holds labels. "
                              f"Use a task of classes (classification). Received: kinds {kinds}")
        return task, ()
    if continuous:
        raise ConfigError(
            f"task={task} needs class labels, but {target!r} at {', '.join(continuous)} holds "
            f"more than {MAX_CLASSES} distinct or non-integer numbers. Use a task of values "
            f"(regression). Received: {target!r}"
        )
    label_sets = {r.site: set(r.target.labels or {}) for r in reports if r.target is not None}
    if text_sites and len(label_sets) > 1:
        for site, mine in label_sets.items():
            others = set().union(*(v for s, v in label_sets.items() if s != site))
            if not mine & others:
                raise ConfigError(
                    f"Hospital {site}'s labels for {target!r} ({sorted(mine)[:6]}) share none with "
                    f"the other hospitals' ({sorted(others)[:6]}): the label sets differ. Map them "
                    f"to one set of labels at every hospital. Received: {sorted(mine)[:6]}"
                )
    union = set().union(*label_sets.values()) if label_sets else set()
    numeric = all(_number(v) is not None for v in union)
    labels = sorted(union, key=(lambda v: float(v)) if numeric else (lambda v: v))
    return task, tuple(labels)


def moment_warnings(schema: Schema, sites: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                    ) -> list[str]:
    """Warnings from each site's per-feature (count, sum, sum of squares) of encoded features.

    A numeric column constant at a site (every row the same value, while other sites vary:
    e.g. a cholesterol of 0 recorded for every patient), or whose typical magnitude (root mean
    square) differs from the other sites' by a factor of `RANGE_FACTOR` or more (a unit mismatch).
    A 0/1 indicator column (at every site its sum equals its sum of squares: an exported one-hot
    column) is not judged: a rare category absent at a small hospital is no placeholder.
    """
    names = schema.feature_names
    out: list[str] = []
    for col in schema.columns:
        if col.kind != "numeric":
            continue
        k = names.index(col.name)
        stats = {s: (float(m[0][k]), float(m[1][k]), float(m[2][k])) for s, m in sites.items()}
        if all(abs(total - sq) <= 1e-9 * max(1.0, n) and 0 <= total <= n
               for n, total, sq in stats.values()):
            continue
        for site, (n, total, sq) in stats.items():
            if n < 2:
                continue
            mean = total / n
            var = max(sq / n - mean**2, 0.0)
            others = [v for s, v in stats.items() if s != site and v[0] > 0]
            if var <= 1e-12 * max(1.0, mean**2):
                if any(max(o[2] / o[0] - (o[1] / o[0]) ** 2, 0.0) > 1e-12 for o in others):
                    out.append(f"column {col.name!r} is constant at {site} ({mean:g} in all {int(n)} "
                               f"rows) but varies elsewhere: a placeholder for missing values? "
                               f"Declare it with --na-values {col.name}={mean:g}, or leave the "
                               f"column out")
                continue
            if not others:
                continue
            on, osq = sum(o[0] for o in others), sum(o[2] for o in others)
            rms, orms = math.sqrt(sq / n), math.sqrt(osq / on)
            if rms > 0 and orms > 0 and max(rms / orms, orms / rms) >= RANGE_FACTOR:
                out.append(f"column {col.name!r} at {site} is about {rms / orms:.3g}x the other "
                           f"hospitals' values (root mean square {rms:.3g} vs {orms:.3g}): "
                           f"another unit?")
    return out


# --- encoding -------------------------------------------------------------------------------
def encode_frame(schema: Schema, frame: Any, *, where: str, need_target: bool = True,
                 refuse_unknown: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Encode a raw table (a DataFrame) with ``schema``: ``(x float32, y or None)``.

    ``y`` holds class indices into ``schema.labels`` (classification) or float32 values
    (regression); None when ``need_target`` is False and the table has no target column.
    Refuses a missing schema column, a value of the wrong kind (naming column and value), a
    label outside the schema, and with ``refuse_unknown`` any column the schema does not know.
    """
    settings = schema.settings
    names = [str(c) for c in frame.columns]
    has_target = schema.target in names and (not schema.event or schema.event in names)
    present = split_columns(list(frame.columns), settings, where=where,
                            need_target=need_target)
    known = {c.name for c in schema.columns}
    unknown = [c for c in present if c not in known]
    if lacking := [c.name for c in schema.columns if c.name not in present]:
        # both sides: a column it lacks beside one the model does not know is likely a rename
        odd = (f"; it has column(s) the model does not know: {', '.join(unknown)} (renamed? "
               f"give them the model's names)" if unknown else "")
        raise ConfigError(
            f"{where} lacks column(s) the model needs: {', '.join(lacking)}{odd}. Add the "
            f"missing column(s) (empty cells are fine when the values are unknown). Received: "
            f"lacks {lacking}" + (f", unknown {unknown}" if unknown else "")
            + f"; columns {present}"
        )
    if refuse_unknown and unknown:
        raise ConfigError(
            f"{where} has column(s) the model does not know: {', '.join(unknown)}. The model was "
            f"trained on {', '.join(sorted(known))}; drop the others. Received: {unknown}"
        )
    n = len(frame)
    parts: list[np.ndarray] = []
    for col in schema.columns:
        raw = read_column(col.name, frame[col.name].tolist(), na_set(settings.na_values, col.name))
        gap = np.array([c is None for c in raw.cells])
        if col.kind == "numeric":
            if raw.kind not in ("numeric", "empty"):
                bad = next(c for c in raw.cells if c is not None and _number(c) is None)
                raise ConfigError(f"{where}: column {col.name!r} must hold numbers; {bad!r} is not "
                                  f"one (a missing marker? add it with --na-values). Received: {bad!r}")
            block = raw.numbers.reshape(n, 1)
        elif col.kind == "boolean":
            block = np.full((n, 1), np.nan)
            for i, c in enumerate(raw.cells):
                if c is None:
                    continue
                low = c.lower()
                if low not in TRUE_WORDS | FALSE_WORDS:
                    raise ConfigError(f"{where}: column {col.name!r} must hold true/false, yes/no "
                                      f"or 1/0; {c!r} is none of them. Received: {c!r}")
                block[i, 0] = 1.0 if low in TRUE_WORDS else 0.0
        else:
            index = {v: j for j, v in enumerate(col.categories)}
            block = np.zeros((n, len(col.categories)))
            for i, c in enumerate(raw.cells):
                if c is None:
                    continue
                j = index.get(c)
                if j is None:  # the documented fallback: unseen -> treated as missing
                    gap[i] = True
                else:
                    block[i, j] = 1.0
        parts.append(block)
        if col.missing_indicator:
            parts.append(gap.astype(np.float64).reshape(n, 1))
    x = np.concatenate(parts, axis=1).astype(np.float32) if parts else np.zeros((n, 0), np.float32)
    if not has_target:
        return x, None
    if schema.event:  # survival: y = (time, event), every row read by the survival rules
        t, e = read_survival(where, frame, schema.target, schema.event, schema.na_values,
                             whole=False)
        return x, np.column_stack([t, e]).astype(np.float32)
    return x, encode_target(schema, frame[schema.target].tolist(), where=where)


def encode_target(schema: Schema, values: Sequence[Any], *, where: str) -> np.ndarray:
    """Class indices into ``schema.labels``, or float32 values (a task of values: regression)."""
    col = read_column(schema.target, values, na_set(schema.na_values, schema.target))
    if any(c is None for c in col.cells):
        raise ConfigError(f"{where}: target column {schema.target!r} has missing values; drop "
                          f"those rows first. Received: {sum(c is None for c in col.cells)} missing")
    if task_kind(schema.task).values:
        if col.kind != "numeric":
            raise ConfigError(f"{where}: target {schema.target!r} must hold numbers for "
                              f"{schema.task}. Received: kind {col.kind}")
        return col.numbers.astype(np.float32)
    index = {v: i for i, v in enumerate(schema.labels)}
    out = np.empty(len(col.cells), dtype=np.int64)
    for i, c in enumerate(col.cells):
        key = _label(c, col.kind)
        if key not in index:
            raise ConfigError(f"{where}: label {c!r} of {schema.target!r} is not one of the "
                              f"federation's labels {list(schema.labels)}. Received: {c!r}")
        out[i] = index[key]
    return out

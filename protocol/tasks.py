"""The task kinds: one registry says what each learning task is, and everything else asks it.

A `TaskKind` declares, in one place:

- ``metrics``: what an evaluation reports besides the loss, in order, and ``selection``, the
  metric (higher is better) that picks the kept round (`protocol.selection`) and the column the
  plots and tables show;
- ``scores``: how the built-in models compute those metrics from truth and prediction (a kind
  whose recipe computes its own, as the Cox recipe does, leaves it empty);
- ``labels``: how a hospital's target column is read and encoded (`LabelEncoding`);
- ``baselines``: the models a ``simulate`` run compares the federated one with (`BASELINES`);
- ``plots``: what a ``simulate`` run draws after its rounds (``module:function`` entries called
  with the federation's folder; each returns the run-summary fields it fills);
- ``server_phases``: ``module:function`` entries the general coordinator runs
  (`server.phases`): ``fit`` instead of the rounds (returns False where it does not apply),
  ``after`` after them;
- ``client_phases``: ``query.<name>`` messages the hospital's agent answers, by the
  ``module:function`` that answers each;
- ``recipe`` (with ``recipe_settings``, the run settings passed as its parameters): the model a
  hospital trains when no recipe is named; empty: the built-in MLP or CNN by the data;
- ``report``: a ``module:function`` giving lines for ``fedsplit up`` to print at the end;
- ``vertical``: whether split learning (``fedsplit vertical``) trains it.

The built-in kinds are `CLASSIFICATION`, `REGRESSION` and `SURVIVAL`. A new kind is one
`register` call in one module (see docs/architecture.md, "Task kinds"); an installed package
names that module under the entry-point group `ENTRY_POINT_GROUP`, so every process of a
federation (coordinator, hospitals, the command) finds it by name. Code outside this module
asks a kind what it declares (`task_kind(name).labels`, ``.selection``, ...) and never
compares task names (tests/protocol/test_task_kinds.py).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError

#: Entry-point group under which an installed package names the module registering its kinds.
ENTRY_POINT_GROUP = "fedsplit.tasks"
#: The run setting that lets the data decide the task (`protocol.schema` infers it).
AUTO = "auto"

Score = Callable[[np.ndarray, np.ndarray], float]
#: The baselines a ``simulate`` run can train beside the federation: the pooled rows, and each
#: hospital's rows alone (same model, same optimizer steps).
CENTRALIZED = "centralized"
LOCAL = "local"
BASELINES = (CENTRALIZED, LOCAL)


class LabelEncoding(StrEnum):
    """How a kind's labels are read from the target column and encoded for training."""

    #: a category per row (text or whole numbers), encoded as class indices 0..k-1 of the
    #: schema's sorted labels; the model has one output per class
    CLASSES = "classes"
    #: a number per row, float32; the built-in models standardise it with the federation's
    #: pooled mean and standard deviation; one output
    VALUES = "values"
    #: a time and an event column per row (`protocol.survival_rows`); one output (the risk)
    TIME_EVENT = "time-event"


def accuracy(truth: np.ndarray, predicted: np.ndarray) -> float:
    """The share of rows whose predicted class is the true one."""
    return float((np.asarray(predicted) == np.asarray(truth)).mean()) if len(truth) else math.nan


def r2(truth: np.ndarray, predicted: np.ndarray) -> float:
    """1 - SS_res / SS_tot (0 where the truth does not vary)."""
    truth, predicted = np.asarray(truth, np.float64), np.asarray(predicted, np.float64)
    ss_tot = float(((truth - truth.mean()) ** 2).sum())
    return 1.0 - float(((truth - predicted) ** 2).sum()) / ss_tot if ss_tot > 0 else 0.0


def rmse(truth: np.ndarray, predicted: np.ndarray) -> float:
    """The root mean squared error, in target units."""
    truth, predicted = np.asarray(truth, np.float64), np.asarray(predicted, np.float64)
    return float(np.sqrt(((truth - predicted) ** 2).mean())) if len(truth) else math.nan


@dataclass(frozen=True)
class TaskKind:
    """One learning task (module docstring): what it reports, keeps, reads, draws and runs."""

    name: str
    labels: LabelEncoding
    metrics: tuple[str, ...]
    selection: str
    scores: Mapping[str, Score] = field(default_factory=dict)
    baselines: tuple[str, ...] = BASELINES
    plots: tuple[str, ...] = ()
    server_phases: Mapping[str, str] = field(default_factory=dict)
    client_phases: Mapping[str, str] = field(default_factory=dict)
    recipe: str = ""
    recipe_settings: tuple[str, ...] = ()
    report: str = ""
    vertical: bool = False

    def __post_init__(self) -> None:
        if not self.name or self.name == AUTO or not self.name.replace("-", "").isalnum():
            raise ConfigError(f"A task kind's name is a word (letters, digits, '-'), not "
                              f"{AUTO!r}. Received: {self.name!r}")
        if self.selection not in self.metrics:
            raise ConfigError(f"Task kind {self.name}'s selection metric must be one of its "
                              f"metrics {self.metrics}. Received: {self.selection!r}")
        if unknown := sorted(set(self.scores) - set(self.metrics)):
            raise ConfigError(f"Task kind {self.name} scores metrics it does not declare: "
                              f"{unknown}; add them to metrics={self.metrics}")
        if unknown := sorted(set(self.baselines) - set(BASELINES)):
            raise ConfigError(f"Task kind {self.name}'s baselines are some of {BASELINES}. "
                              f"Received: {unknown}")
        if self.server_phases.keys() - SERVER_PHASES:
            raise ConfigError(f"Task kind {self.name}'s server phases are {sorted(SERVER_PHASES)}. "
                              f"Received: {sorted(self.server_phases)}")
        object.__setattr__(self, "scores", MappingProxyType(dict(self.scores)))
        object.__setattr__(self, "server_phases", MappingProxyType(dict(self.server_phases)))
        object.__setattr__(self, "client_phases", MappingProxyType(dict(self.client_phases)))

    @property
    def classes(self) -> bool:
        """Whether labels are class indices (one output per class; rare labels can be withheld)."""
        return self.labels is LabelEncoding.CLASSES

    @property
    def values(self) -> bool:
        """Whether labels are one number per row (standardised by the pooled statistics)."""
        return self.labels is LabelEncoding.VALUES

    @property
    def time_event(self) -> bool:
        """Whether labels are a time and an event column (survival data)."""
        return self.labels is LabelEncoding.TIME_EVENT

    def score(self, truth: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
        """Every metric this kind computes from truth and prediction (`scores`), in order."""
        return {name: float(self.scores[name](truth, predicted))
                for name in self.metrics if name in self.scores}


#: The phases a kind may give the general coordinator (`server.phases`).
SERVER_PHASES = frozenset({"fit", "after"})

CLASSIFICATION = TaskKind(
    name="classification",
    labels=LabelEncoding.CLASSES,
    metrics=("accuracy",),
    selection="accuracy",
    scores={"accuracy": accuracy},
    vertical=True,
)
REGRESSION = TaskKind(
    name="regression",
    labels=LabelEncoding.VALUES,
    metrics=("r2", "rmse"),
    selection="r2",
    scores={"r2": r2, "rmse": rmse},
    vertical=True,
)
SURVIVAL = TaskKind(
    name="survival",
    labels=LabelEncoding.TIME_EVENT,
    metrics=("c_index", "auc"),
    selection="c_index",
    plots=("fedsplit.orchestration.survival_summary:summary_plots",),
    server_phases={"fit": "fedsplit.server.survival.exact:exact_phase",
                   "after": "fedsplit.server.survival.summary:summary_phase"},
    client_phases={"survival": "fedsplit.client.survival.summary:answer"},
    recipe="fedsplit.client.survival.recipe:Cox",
    recipe_settings=("hidden", "penalizer"),
    report="fedsplit.orchestration.survival_summary:up_report",
)

_KINDS: dict[str, TaskKind] = {}
_plugins_loaded = False


def register(kind: TaskKind) -> TaskKind:
    """Add ``kind`` (a module imported again registers its kinds again); returns it. A built-in
    kind is never replaced."""
    if kind.name in BUILTIN and kind is not BUILTIN[kind.name]:
        raise ConfigError(f"Task kind {kind.name!r} is built in; give the new kind another name. "
                          f"Received: {kind}")
    _KINDS[kind.name] = kind
    return kind


BUILTIN: Mapping[str, TaskKind] = MappingProxyType(
    {kind.name: kind for kind in (CLASSIFICATION, REGRESSION, SURVIVAL)})
_KINDS.update(BUILTIN)


def _load_plugins() -> None:
    """Import every module named under `ENTRY_POINT_GROUP` (once): each registers its kinds."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        point.load()


def task_names() -> tuple[str, ...]:
    """Every registered kind's name (the built-ins first, then plugins in registration order)."""
    _load_plugins()
    return tuple(_KINDS)


def task_kind(name: str) -> TaskKind:
    """The kind named ``name``; `ConfigError` naming the registered kinds when none is."""
    kind = _KINDS.get(name)
    if kind is None:
        _load_plugins()
        kind = _KINDS.get(name)
    if kind is None:
        raise ConfigError(
            f"No task kind is named {name!r}. Registered: {', '.join(task_names())}. A new kind "
            f"is registered with fedsplit.protocol.tasks.register in a module named under the "
            f"entry-point group {ENTRY_POINT_GROUP!r} (docs/architecture.md, 'Task kinds').")
    return kind


def declared(task: str | None) -> TaskKind | None:
    """The kind a run setting names, or None where the data decides (`AUTO`, None, "")."""
    return None if not task or task == AUTO else task_kind(task)


def label_encoding(task: str | None) -> LabelEncoding | None:
    """How a run setting's task reads its labels, or None where the data decides (`AUTO`)."""
    kind = declared(task)
    return kind.labels if kind is not None else None


def inferred_kind(labels: LabelEncoding) -> TaskKind:
    """The kind `AUTO` picks for labels the data shows read so: the built-in one
    (classes: classification; values: regression; time and event: survival)."""
    return next(kind for kind in BUILTIN.values() if kind.labels is labels)


#: a numeric target with more distinct values than this, or with fractions, is read as values
MAX_INFERRED_CLASSES = 20


def infer_task(values: np.ndarray) -> str:
    """The kind `AUTO` picks for a target column's values: classes (text, booleans, or at most
    `MAX_INFERRED_CLASSES` distinct whole numbers: classification), else values (regression)."""
    values = np.asarray(values)
    if values.dtype.kind not in "iuf":
        return inferred_kind(LabelEncoding.CLASSES).name
    uniq = np.unique(values[~np.isnan(values)] if values.dtype.kind == "f" else values)
    classes = bool(np.all(np.mod(uniq, 1) == 0)) and len(uniq) <= MAX_INFERRED_CLASSES
    return inferred_kind(LabelEncoding.CLASSES if classes else LabelEncoding.VALUES).name


def check_task(task: str) -> str:
    """``task`` if it is `AUTO` or a registered kind, else the `ConfigError` naming them."""
    declared(task)
    return task


def recipe_kind(ref: str) -> TaskKind | None:
    """The kind whose own recipe ``ref`` is (survival: the Cox recipe), or None."""
    return next((kind for kind in _KINDS.values() if kind.recipe and kind.recipe == ref), None)


def resolve(entry: str) -> Any:
    """The object a ``module:attribute`` entry names (a kind's phase, plot or recipe)."""
    module, _, attribute = entry.partition(":")
    if not module or not attribute:
        raise ConfigError(f"A task kind's entry is 'module:attribute'. Received: {entry!r}")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found

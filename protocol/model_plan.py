"""Planning the federation's model from the hospitals' ``query.stats`` / ``query.setup``
replies (`protocol.horizontal_wire`): the model request the pooled statistics and the run
settings give (`plan_model`), and the starting weights a hospital's model check becomes once the
pooled statistics are placed in the tensors it named (`statistic_value`, `place_statistics`).

The coordinator plans with every hospital's stats and the agreed schema (`server.setup`); a
hospital plans its own model check the same way with its own stats (`client.app`), so the two
agree on `protocol.horizontal_wire.model_key` whenever the hospital's view of the federation is
the agreed one. The wire module holds only what crosses the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.horizontal_wire import InitialModel, ModelRequest, SiteStats
from fedsplit.protocol.recipe import RECIPE_KIND, RecipeIdentity, request_kind
from fedsplit.protocol.tasks import task_kind
from fedsplit.protocol.update import to_array_record

STD_FLOOR = 1e-6  # a standard deviation at or below it standardises by 1 (`Recipe.set_statistics`)


def plan_model(stats: Sequence[SiteStats], *, task: str, model: str, num_classes: int,
               hidden: Sequence[int], norm: str, schema_task: str | None = None,
               labels: int = 0, recipe: RecipeIdentity | None = None) -> ModelRequest:
    """The model request the sites' stats (in name order) and the run settings give: pooled
    statistics, task (the run's, else the schema's, else the one every site inferred), the
    number of outputs (``num_classes``, else the schema's labels or the largest label + 1; at
    least 2 for classification), the model kind (`protocol.recipe.request_kind`: for the
    hospitals' ``recipe`` a built-in's kind by the data or ``model``, else `RECIPE_KIND`; no
    recipe: the built-in one).

    The coordinator plans with every hospital's stats and the agreed schema; a hospital plans
    its model check with its own stats and the schema it encoded with, so the two agree on
    `model_key` whenever the hospital's view of the federation is the agreed one. Raises
    `ConfigError` for undecidable tasks and a ``norm`` the model cannot take."""
    from fedsplit.protocol.stats import combine_moments

    ref = stats[0]
    tasks = {s.task for s in stats}
    chosen = task if task != "auto" else (tasks.pop() if len(tasks) == 1 else None)
    if schema_task is not None:
        chosen = schema_task
    if chosen is None:
        raise ConfigError(
            f"Hospitals inferred different tasks from their targets ({sorted(tasks)}); set "
            f"task=classification or task=regression in the run config. Received: {sorted(tasks)}"
        )
    mean, std = combine_moments([(s.count, s.sum, s.sumsq) for s in stats])
    n = sum(s.num_examples for s in stats)
    y_mean = sum(s.y_sum for s in stats) / n
    y_std = float(np.sqrt(max(sum(s.y_sumsq for s in stats) / n - y_mean**2, 0.0)))
    if task_kind(chosen).classes:  # one output per class; else one (values, a risk)
        outputs = num_classes or max(labels, 1 + max(s.label_max for s in stats))
        outputs = max(outputs, 2)
    else:
        outputs = 1
    kind = request_kind(recipe, ref.kind if model == "auto" else model)
    if kind != RECIPE_KIND and norm != "none" and kind != "mlp":
        raise ConfigError(
            f"norm={norm} adds BatchNorm after the MLP's hidden layers, but the hospitals' "
            f"data gets a {kind} model. Use norm=none, or model=mlp for tabular data. "
            f"Received: norm={norm!r}, model kind {kind!r}"
        )
    return ModelRequest(kind=kind, task=chosen, input_shape=ref.input_shape,
                        num_outputs=int(outputs), hidden=tuple(hidden), norm=norm, mean=mean,
                        std=std, y_mean=float(y_mean), y_std=float(y_std))


def statistic_value(source: str, shape: Sequence[int], dtype: Any, mean: np.ndarray,
                    std: np.ndarray, y_mean: float, y_std: float) -> np.ndarray | None:
    """The value a tensor of ``shape`` and ``dtype`` holds when it stores ``source`` (one of
    `protocol.horizontal_wire.STATISTIC_SOURCES`) of these statistics, as the recipes'
    `set_statistics` stores them: mean and std (floored: at most `STD_FLOOR` becomes 1)
    reshaped, the target's mean and std filled in. None: the statistic does not fit the tensor's shape."""
    shape = tuple(int(d) for d in shape)
    if source in ("y-mean", "y-std"):
        value = float(y_mean) if source == "y-mean" else (
            float(y_std) if float(y_std) > STD_FLOOR else 1.0)
        return np.full(shape, value, dtype=np.float64).astype(dtype)
    values = np.asarray(mean if source == "mean" else std, dtype=np.float64).reshape(-1)
    if source == "std":
        values = np.where(values > STD_FLOOR, values, 1.0)
    if values.size != int(np.prod(shape, dtype=np.int64)):
        return None
    return values.reshape(shape).astype(dtype)


def place_statistics(model: InitialModel, statistics: Mapping[str, str],
                     request: ModelRequest) -> InitialModel | None:
    """``model`` (a model check) with the request's pooled statistics in the tensors
    ``statistics`` names: the model ``query.init`` would have built for ``request``. None: a
    statistic does not fit its tensor (ask ``query.init`` instead)."""
    from flwr.app import ArrayRecord

    placed = {}
    for name, source in statistics.items():
        array = model.arrays[name]
        value = statistic_value(source, tuple(array.shape), np.dtype(array.dtype), request.mean,
                                request.std, request.y_mean, request.y_std)
        if value is None:
            return None
        placed[name] = to_array_record({name: value})[name]
    record = ArrayRecord()  # the other tensors are the model's own Arrays, not copies
    for name, array in model.arrays.items():
        record[name] = placed.get(name, array)
    return InitialModel(record, model.model_id, model.federated, model.site)

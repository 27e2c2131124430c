"""Before round 1: agree on the model and its standardisation without seeing any rows.

1. ``query.stats`` to every hospital: schema (input shape, feature names, task) and per-feature
   count / sum / sum of squares. The coordinator checks that the schemas match and pools the
   moments into one mean and standard deviation.
2. ``query.init`` to one hospital: build the model with those statistics; its weights become
   the shared starting point every site trains from (sites must share an initialisation for
   averaging to work).

The coordinator never imports model code: it only routes statistics and arrays.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from protocol.config import RunConfig
from protocol.errors import ConfigError, FederationError
from protocol.stats import combine_moments
from protocol.weights import read_weights

log = logging.getLogger(__name__)


@dataclass
class ModelSetup:
    """The shared starting model."""

    arrays: ArrayRecord
    model_id: str


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


def _ask(grid: Grid, nodes: list[int], message_type: str, config: dict[str, Any],
         timeout: float) -> list[Message]:
    msgs = [
        Message(RecordDict({"config": ConfigRecord(config)}), dst_node_id=n,
                message_type=message_type)
        for n in nodes
    ]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    errors = [r for r in replies if r.has_error()]
    if errors:
        reasons = "; ".join(f"node {r.metadata.src_node_id}: {r.error.reason}" for r in errors)
        raise FederationError(f"Hospital agent(s) failed during {message_type}: {reasons}")
    if len(replies) < len(nodes):
        raise FederationError(
            f"Only {len(replies)} of {len(nodes)} hospitals answered {message_type} within "
            f"{timeout:.0f} s. Check the SuperNode logs. Received: {len(replies)} replies"
        )
    return replies


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
        return ModelSetup(update.to_array_record(), update.model)

    replies = _ask(grid, nodes, "query.stats", {}, cfg.round_timeout)
    schemas = [r.content.config_records["schema"] for r in replies]
    stats = [r.content.metric_records["stats"] for r in replies]
    ref = schemas[0]
    for other in schemas[1:]:
        for key in ("kind", "input-shape", "features"):
            if list(np.atleast_1d(other[key])) != list(np.atleast_1d(ref[key])):
                raise ConfigError(
                    f"Hospitals {ref['name']} and {other['name']} disagree on {key}: horizontal "
                    f"federation needs every site to hold the same columns in the same order. "
                    f"Sites holding different columns need vertical fusion instead. Received: "
                    f"{list(np.atleast_1d(ref[key]))[:8]} vs {list(np.atleast_1d(other[key]))[:8]}"
                )
    tasks = {str(s["task"]) for s in schemas}
    task = cfg.task if cfg.task != "auto" else (tasks.pop() if len(tasks) == 1 else None)
    if task is None:
        raise ConfigError(
            f"Hospitals inferred different tasks from their targets ({sorted(tasks)}); set "
            f"task=classification or task=regression in the run config. Received: {sorted(tasks)}"
        )
    mean, std = combine_moments([(s["count"], s["sum"], s["sumsq"]) for s in stats])
    n = sum(int(s["num-examples"]) for s in stats)
    y_mean = sum(float(s["y-sum"]) for s in stats) / n
    y_std = float(np.sqrt(max(sum(float(s["y-sumsq"]) for s in stats) / n - y_mean**2, 0.0)))
    if task == "classification":
        outputs = cfg.num_classes or 1 + max(int(s["label-max"]) for s in stats)
        outputs = max(outputs, 2)
    else:
        outputs = 1
    kind = str(ref["kind"]) if cfg.model == "auto" else cfg.model
    init_config = {
        "kind": kind, "task": task, "input-shape": [int(d) for d in np.atleast_1d(ref["input-shape"])],
        "num-outputs": int(outputs), "mean": mean.tolist(), "std": std.tolist(),
        "y-mean": float(y_mean), "y-std": float(y_std),
    }
    log.info("Model setup: %s, %s, %d rows over %d hospitals", kind, task, n, len(nodes))
    reply = _ask(grid, nodes[:1], "query.init", init_config, cfg.round_timeout)[0]
    return ModelSetup(reply.content.array_records["arrays"],
                      str(reply.content.config_records["model"]["model-id"]))

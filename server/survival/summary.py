"""After the last round of a survival run (`fedsplit simulate --task survival`): the pooled
Kaplan-Meier curve and the Breslow baseline of the kept model, on the run's own Flower grid.

Called by the horizontal ServerApp (`server.app`) once training is over. Two sum exchanges,
through the survival paths' `Coordinator` (plain, or one SecAgg+ sum each under
``secure-aggregation``), messages as `protocol.survival_summary`:

1. the Kaplan-Meier exchange of `fedsplit km` (``km-times``: the grid of event times, in the
   clear; ``km-counts``: summed numbers at risk and events per grid time), published after the
   minimum-count rule (`server.survival.km`): ``OUT/km.json``, the format of `fedsplit km`;
2. ``baseline``: the kept model (``global.h5``: arrays, model id, schema) goes to every hospital,
   which scores its own training rows with its recipe and returns, per grid time, its number of
   events and the sum of ``exp(risk)`` over its patients at risk (time >= t). Summed, they give
   Breslow's cumulative hazard ``H0(t) = sum_{t_i <= t} d_i / sum_{j: t_j >= t_i} exp(risk_j)``
   (a ``Standardize`` layer inside the model makes ``risk`` that of standardized inputs, as at
   prediction). Published at the same points as the curve: ``OUT/global.baseline.json``, with
   the sha256 of ``global.h5`` (`protocol.survival_summary.Baseline`).

The minimum-count rule's K is the run config's ``min-count`` (default 5), read once with the
rest of it (`protocol.config.RunConfig.min_count`). Both exchanges use the
rows the kept model was fitted on (``rows``): each hospital's training rows less its validation
rows, or all of them after the exact Cox fit (`server.survival.exact`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.atomic import write_json_atomic
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import FederationError
from fedsplit.protocol.record.summary import SurvivalFiles
from fedsplit.protocol.record.survival import KM_FILE
from fedsplit.protocol.weights import read_schema, read_weights
from fedsplit.server.history import RunHistory
from fedsplit.server.setup import ModelSetup, wait_for_nodes
from fedsplit.server.survival import km as kmm
from fedsplit.server.survival.app import Coordinator, pooled_km
from fedsplit.server.survival.exact import uses_newton
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

MODEL_FILE = "global.h5"
SHARED_BASELINE = ("per hospital: the number of events and the sum of exp(risk) over its "
                   "patients at risk at each grid time (summed; secure when on), risk the kept "
                   "model's log relative hazard of its training rows; the grid (event times) "
                   "was shared in the clear by the km exchange")


def publish_baseline(grid: np.ndarray, at_risk: np.ndarray, km_events: np.ndarray,
                     events: np.ndarray, risk_sums: np.ndarray, min_count: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(published times, H0 there): Breslow's cumulative hazard over every grid time, kept at the
    points the minimum-count rule publishes for the curve (the pooled km counts decide)."""
    if not np.array_equal(np.rint(events), np.rint(km_events)):
        raise FederationError("The hospitals' event counts differ between the Kaplan-Meier and "
                              "baseline exchanges (a hospital's rows changed in between); rerun. "
                              f"Received: {int(np.rint(events).sum())} vs "
                              f"{int(np.rint(km_events).sum())} events")
    hazard = np.cumsum(ss.breslow_increments(np.rint(events), risk_sums))
    keep, groups = kmm.min_count_groups(at_risk, km_events, min_count)
    last = keep[[g[-1] for g in groups]] if groups else np.zeros(0, np.int64)
    return np.asarray(grid, np.float64)[last], hazard[last]


def summary_phase(grid: Grid, cfg: RunConfig, setup: ModelSetup, history: RunHistory) -> None:
    """The survival kind's ``after`` phase (`protocol.tasks`, `server.phases`): `run_summary`."""
    run_summary(grid, cfg)


def run_summary(grid: Grid, cfg: RunConfig, run_config: Mapping[str, Any] | None = None
                ) -> SurvivalFiles:
    """The two exchanges (module docstring); writes ``km.json`` and ``global.baseline.json`` in
    ``out-dir`` and returns their paths (``km_plot`` is drawn by the runner:
    `orchestration.survival_summary.write_plots`).

    Every setting comes parsed in ``cfg`` (the minimum-count rule: ``cfg.min_count``);
    ``run_config``, Flower's raw run config, is not read (kept for the caller's signature)."""
    started = time.monotonic()
    out = Path(cfg.out_dir)
    model_path = out / MODEL_FILE
    if not model_path.exists():
        raise FederationError(f"The survival summary needs the kept model {model_path}, which "
                              f"the rounds did not write (no round produced a model). "
                              f"Received: {sorted(p.name for p in out.iterdir())}")
    min_count = cfg.min_count
    digest = ss.file_sha256(model_path)
    update = read_weights(model_path)
    schema = read_schema(model_path)
    if not update.model or not schema:
        raise FederationError(f"{model_path} lacks its model id or schema, so hospitals cannot "
                              f"rebuild it. Received: model={update.model!r}")
    # the rows the model was fitted on: all of each hospital's after the exact Cox fit
    rows = "all" if uses_newton(cfg, update.model) else "train"
    nodes = wait_for_nodes(grid, cfg.min_nodes, cfg.round_timeout)
    coord = Coordinator(grid, nodes, cfg)
    km = pooled_km(coord, min_count, {"schema": schema, "rows": rows})
    km.document.save(out / KM_FILE)
    inputs = {"schema": schema, "grid": [float(g) for g in km.grid], "model-id": update.model,
              "rows": rows}
    vector = coord.total("baseline", inputs, arrays={ss.MODEL: update.to_array_record()},
                         bits=ss.STAGE_BITS["baseline"])
    n = len(km.grid)
    if len(vector) != 2 * n:
        raise FederationError(f"A baseline reply holds events and risk sums per grid time (2 x "
                              f"{n} values). Received: {len(vector)}")
    times, hazard = publish_baseline(km.grid, km.at_risk, km.events, vector[:n], vector[n:],
                                     min_count)
    if not len(times):
        raise FederationError(f"Too few events for the minimum-count rule: no baseline point "
                              f"holds {min_count} events with {min_count} patients at risk. "
                              f"Lower min-count. Received: {int(km.events.sum())} events")
    baseline = ss.Baseline(
        digest, tuple(float(t) for t in times), tuple(float(h) for h in hazard), min_count,
        km.rows, int(km.events.sum()), model=MODEL_FILE, model_id=update.model,
        hospitals=tuple(coord.sites),
        estimator="Breslow, pooled over hospitals (one baseline for the federation)",
        secure_aggregation=km.document.secure_aggregation, shared=SHARED_BASELINE)
    path = ss.baseline_path(model_path)
    write_json_atomic(path, baseline.to_json())
    seconds = time.monotonic() - started
    log.info("survival summary: %d grid times, %d baseline points, %d sums, %.1f s",
             n, len(times), coord.sums, seconds)
    return SurvivalFiles(km=str(out / KM_FILE), baseline=str(path))

"""The exact path of `fedsplit simulate --task survival` for the linear Cox model: federated
Newton-Raphson on the run's own Flower grid, in place of training rounds.

Called by the horizontal ServerApp (`server.app`) after the model setup when
`protocol.survival_exact.newton_solver` says so (the linear model under plain FedAvg, or the
recipe's ``solver=newton``). The fit is `fedsplit cox`'s (`server.survival.newton`: pooled
standardization, Newton steps on the hospitals' summed log partial likelihoods, gradients and
Hessians, each hospital its own stratum, lifelines' ridge), on all of each hospital's training
rows (no round is picked, so no validation rows are held out: the fit equals `fedsplit cox` on
the same files), through the survival sum exchanges of `protocol.survival_summary` (plain, or
SecAgg+ sums under ``secure-aggregation``).

Each gradient/Hessian evaluation is recorded as one round of ``history.json`` with its model
(``models/round-NNN.h5``: the linear recipe model holding that iterate); the last round also
with the fit's evaluation: Harrell's C on the rows fitted (in-sample), from the hospitals'
summed concordant, tied and comparable pair counts (one exchange after the fit, not one per
round: in deployment every exchange costs the agents' polling). The kept model (``global.h5``)
is the optimum, the last round (``keep`` is ``last`` on this path: the fit is the model, not a
round picked on scores).
``OUT/cox.json`` holds the coefficient table as `fedsplit cox` writes it.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
from fedsplit.aggregation.base import AggregateResult
from fedsplit.protocol import survival as sv
from fedsplit.protocol import survival_exact as se
from fedsplit.protocol import survival_summary as ss
from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.design import derived_features
from fedsplit.protocol.errors import FederationError
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.protocol.record.survival import COX_FILE, CoxDocument
from fedsplit.protocol.schema import Schema
from fedsplit.server.history import RunHistory
from fedsplit.server.setup import ModelSetup, wait_for_nodes
from fedsplit.server.survival import newton as nt
from fedsplit.server.survival.app import Coordinator, upper_to_full
from flwr.serverapp import Grid

log = logging.getLogger(__name__)

def uses_newton(cfg: RunConfig, model_id: str | None) -> bool:
    """Whether this survival run's model is fitted here (`protocol.survival_exact.newton_solver`:
    the linear Cox recipe, plain FedAvg)."""
    return se.newton_solver(
        model_id, strategy=cfg.strategy, server_opt=cfg.server_opt, dp=cfg.dp,
        attack=cfg.attack, attackers=cfg.attackers)


def _sites(coord: Coordinator, counts: dict[str, float], metrics: dict[str, dict[str, float]]
           ) -> list[SiteEntry]:
    """History entries per hospital (none under secure aggregation: only sums are known)."""
    return [SiteEntry(site=name, num_examples=int(counts[name]), metrics=metrics.get(name, {}))
            for name in sorted(counts)] if coord.secure is None else []


def exact_phase(grid: Grid, cfg: RunConfig, setup: ModelSetup, history: RunHistory) -> bool:
    """The survival kind's ``fit`` phase (`protocol.tasks`, `server.phases`): the exact fit
    instead of the rounds where the model is the linear Cox one; False (rounds) otherwise."""
    if not uses_newton(cfg, setup.model_id):
        return False
    fit_exact(grid, cfg, setup, history)
    return True


def fit_exact(grid: Grid, cfg: RunConfig, setup: ModelSetup, history: RunHistory) -> CoxDocument:
    """Fit the linear Cox model exactly (module docstring); returns the cox.json document."""
    started = time.monotonic()
    if not setup.schema:
        raise FederationError("The exact Cox fit needs the hospitals' table schema; this run has "
                              "none (image data?). Received: no schema")
    params = se.cox_params(setup.model_id) or {}
    penalizer = float(params.get("penalizer", 0.0))
    nodes = wait_for_nodes(grid, cfg.min_nodes, cfg.round_timeout)
    coord = Coordinator(grid, nodes, cfg)
    schema = setup.schema
    agreed = Schema.from_json(schema)
    names, keep, references = sv.cox_columns(agreed)
    if not names:
        raise FederationError("No covariate is left for the Cox model (every column is the time, "
                              "the event, the ID or ignored). Received: 0 covariates")
    p = len(names)
    moments = coord.total("moments", {"schema": schema}, bits=ss.STAGE_BITS["moments"])
    rows, events = round(moments[0]), round(moments[1])
    train_rows = {k: float(v[0]) for k, v in coord.per_site.items()}
    # the design (protocol.design): derived covariates constant everywhere, or collinear, are
    # left out with a warning; the user's own constant or collinear columns stop the fit
    plan = nt.design(names, derived_features(agreed), moments[2:2 + p], moments[2 + p:2 + 2 * p],
                     moments[2 + 2 * p:])
    base = {"schema": schema, "mean": plan.mean.tolist(), "std": plan.std.tolist()}
    template = {k: v.numpy() for k, v in setup.arrays.items()}
    history.keep = "last"  # the optimum is the model, not a round picked on validation rows
    rounds = itertools.count(1)  # a resumed run refits from round 1 (the same rounds again)
    seconds: dict[int, float] = {}  # round -> its time, as recorded

    def evaluate(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """One round: the summed Newton parts at ``beta``, recorded with its model and time."""
        opened = time.monotonic()
        number = next(rounds)
        inputs = {**base, "beta": [float(b) for b in beta]}
        vec = coord.total("newton", inputs, bits=ss.STAGE_BITS["newton"])
        arrays = se.linear_cox_arrays(template, keep, plan.mean, plan.std, beta)
        report = AggregationReport(
            strategy=se.NEWTON_STRATEGY, params={"penalizer": penalizer}, num_examples=rows,
            sites=[SiteReport(site=n, num_examples=int(c), weight=c / rows)
                   for n, c in sorted(train_rows.items())],
            details={"log_likelihood": float(vec[0]), "gradient_norm": float(np.linalg.norm(
                vec[1:1 + p] - rows * penalizer * beta))})
        seconds[number] = round(time.monotonic() - opened, 3)
        history.record_train(number, AggregateResult(arrays, rows, report),
                             _sites(coord, train_rows, {}),
                             {"log_likelihood": float(vec[0])},
                             train_seconds=seconds[number], seconds=seconds[number])
        return float(vec[0]), vec[1:1 + p], upper_to_full(vec[1 + p:], p)

    result = nt.fit(plan, evaluate, penalizer)
    if plan.warnings:
        for line in plan.warnings:
            log.warning("Cox design: %s", line)
        history.set_schema(schema, [*history.record.schema_warnings,
                                    *(w for w in plan.warnings
                                      if w not in history.record.schema_warnings)])
    beta = plan.full(result.beta)
    # the fit's evaluation (one exchange; in deployment each exchange costs seconds): Harrell's
    # C over the hospitals' summed pairs, recorded as the last round's evaluation (its time too)
    scoring = time.monotonic()
    pairs = coord.total("concordance", {**base, "beta": [float(b) for b in beta]},
                        bits=ss.STAGE_BITS["concordance"])
    per_site = {k: {"c_index": nt.concordance(*v[:3]) or 0.5} for k, v in coord.per_site.items()}
    fit_rows = {k: float(v[3]) for k, v in coord.per_site.items()}
    c_index = nt.concordance(*pairs[:3])
    history.record_evaluate(result.rounds, _sites(coord, fit_rows, per_site),
                            {"c_index": 0.5 if c_index is None else c_index,
                             "comparable_pairs": float(pairs[2])},
                            seconds=round(seconds.get(result.rounds, 0.0)
                                          + time.monotonic() - scoring, 3))
    table = nt.original_scale(result, plan.used_names, plan.standardization().std)
    sites = sorted(train_rows) if coord.secure is None else list(cfg.names)
    doc = nt.summary(
        table, result, rows=rows, events=events, penalizer=penalizer, hospitals=sites,
        c_index=c_index,
        concordance_note="Harrell's C over pairs within each hospital (stratified), on the rows "
                         "fitted, at the fitted coefficients",
        rows_used="all of each hospital's training rows (no round is picked, so none are held "
                  "out for validation)",
        reference_categories=references, left_out=plan.dropped,
        secure_aggregation=coord.secure.to_spec() if coord.secure else "off",
        secure_sums=coord.sums, seconds=time.monotonic() - started)
    doc.save(history.out_dir / COX_FILE)
    log.info("exact Cox fit: %d Newton rounds, %d sums, %.1f s", result.rounds, coord.sums,
             time.monotonic() - started)
    return doc
